"""Campaign 2: simulated power loss, in the way of ALICE (OSDI'14) and CrashMonkey (OSDI'18).

1. **Record.** A save (or a fork + save) runs once on a real local root while :class:`Recorder`
   logs every file-system operation below the root's parent directory with its arguments and
   data: file creation and truncation, each ``write`` (offset and bytes), ``fsync`` of files and of
   directories (``fsync_dir`` opens the directory with ``os.open`` and fsyncs that fd), ``link``,
   ``rename``/``replace``/``renameat2``, ``unlink``, ``mkdir``, ``rmdir``. The pre-state is the
   directory tree before the run, taken as fully durable. Replaying the log on a model of the
   pre-state must give exactly the tree the real run left (checked: a recorder that missed an
   operation would fail here).
2. **Crash states.** For every prefix of the log (a power cut after op i, for every i), the
   states a file system may legally present after reboot are built from the model:

   * *file data*: what was written to a file before its last ``fsync`` survives; writes after it
     may be lost, so the file holds the durable content plus none, one, half or all of the later
     writes, or (metadata persisted, data not: ext4 writeback, delayed allocation) the durable
     content padded with zeros to the size the process saw;
   * *directory entries* (create, link, rename, unlink, mkdir, rmdir) survive if the directory
     was fsynced after them. Two models of what happens to the others:

     - ``posix``: each directory independently keeps a prefix (in program order) of its unsynced
       entry operations; a rename is atomic and survives with either directory's fsync. This is
       what POSIX guarantees and what ALICE explores (and what btrfs' log tree or an ext4
       ``fast_commit`` can expose).
     - ``ordered``: one global journal: a prefix of all metadata operations survives, and any
       fsync (of a file or a directory) commits every metadata operation before it (ext4
       ``data=ordered``, xfs).

   Every combination is explored for small crash points; where there are more than ``cap``
   combinations a seeded random sample of them is (plus the two extremes: everything unsynced
   lost, everything kept). States are deduplicated by content.
3. **Check.** Each state is written out to a fresh directory and checked with the invariants of
   campaign 1 (invariants.check: lookup, load, mix, nothing committed lost or changed, a
   restarted job can resume and save, gc leaves no leak), plus durability: once the commit
   entry's link has been followed by the fsync of ``log/`` (protocol.md section 8: "a power loss
   after step 9 returned cannot lose the commit"), lookup must return the new checkpoint.
"""

from __future__ import annotations

import builtins
import hashlib
import itertools
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Any

from tests.harness.procs import child_value

from .core import Case, Ctx, Result, classify, payload
from .invariants import check, snapshot


# =================================================================================================
# Recording
# =================================================================================================
class Unsupported(Exception):
    pass


class _RecFile:
    def __init__(self, f: Any, rec: "Recorder", h: int, pos: int):
        self._f = f
        self._rec = rec
        self._h = h
        self._pos = pos

    def write(self, data: Any) -> int:
        raw = (
            data.encode(getattr(self._f, "encoding", None) or "utf-8")
            if isinstance(data, str)
            else bytes(memoryview(data).cast("B"))
        )
        n = self._f.write(data)
        self._rec.events.append({"op": "write", "h": self._h, "off": self._pos, "data": raw})
        self._pos += len(raw)
        return n

    def seek(self, *args: Any) -> int:
        out = self._f.seek(*args)
        if "b" in getattr(self._f, "mode", "b"):
            self._pos = self._f.tell()
        else:
            raise Unsupported("seek on a text file")
        return out

    def truncate(self, size: int | None = None) -> int:
        out = self._f.truncate(size)
        self._rec.events.append({"op": "trunc", "h": self._h, "size": self._pos if size is None else size})
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self) -> "_RecFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


class Recorder:
    """Logs the file-system operations below ``base`` (see the module doc)."""

    def __init__(self, base: str):
        self.base = os.path.realpath(base)
        self.events: list[dict[str, Any]] = []
        self.fds: dict[int, tuple[str, Any]] = {}
        self._h = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _mine(self, path: Any) -> str | None:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return None
        p = os.path.abspath(os.fsdecode(path))
        return p if p == self.base or p.startswith(self.base + os.sep) else None

    def _set(self, owner: Any, attr: str, fn: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, fn)

    def install(self) -> "Recorder":
        import txckpt._base.fileio as fileio
        import txckpt._storage.local.store as local

        rec = self
        real_open, real_os_open, real_fsync = builtins.open, os.open, os.fsync

        def rec_open(file, mode="r", *args, **kwargs):
            p = rec._mine(file)
            if p is None:
                return real_open(file, mode, *args, **kwargs)
            existed = os.path.lexists(p)
            f = real_open(file, mode, *args, **kwargs)
            rec._h += 1
            h = rec._h
            writing = bool(set(mode) & set("wax+"))
            if writing and not existed:
                rec.events.append({"op": "creat", "path": p, "h": h})
            else:
                rec.events.append({"op": "bind", "path": p, "h": h})
                if "w" in mode:
                    rec.events.append({"op": "trunc", "h": h, "size": 0})
            try:
                rec.fds[f.fileno()] = ("file", h)
            except (OSError, ValueError):
                pass
            if not writing:
                return f
            pos = os.path.getsize(p) if "a" in mode else 0
            return _RecFile(f, rec, h, pos)

        def rec_os_open(path, flags, *args, **kwargs):
            p = rec._mine(path)
            if p is not None and kwargs.get("dir_fd") is not None:
                raise Unsupported("os.open with dir_fd")
            fd = real_os_open(path, flags, *args, **kwargs)
            if p is not None:
                if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
                    raise Unsupported(f"os.open for writing: {p}")
                if os.path.isdir(p):
                    rec.fds[fd] = ("dir", p)
                else:
                    rec._h += 1
                    rec.events.append({"op": "bind", "path": p, "h": rec._h})
                    rec.fds[fd] = ("file", rec._h)
            else:
                rec.fds.pop(fd, None)
            return fd

        def rec_fsync(fd):
            real_fsync(fd)
            kind = rec.fds.get(fd)
            if kind is None:
                return
            if kind[0] == "dir":
                rec.events.append({"op": "fsync_dir", "path": kind[1]})
            else:
                rec.events.append({"op": "fsync", "h": kind[1]})

        self._set(builtins, "open", rec_open)
        self._set(os, "open", rec_os_open)
        self._set(os, "fsync", rec_fsync)

        def two(name, real):
            def fn(src, dst, *args, **kwargs):
                if kwargs.get("src_dir_fd") is not None or kwargs.get("dst_dir_fd") is not None:
                    raise Unsupported(f"{name} with dir fds")
                a, b = rec._mine(src), rec._mine(dst)
                out = real(src, dst, *args, **kwargs)
                if a or b:
                    if not (a and b):
                        raise Unsupported(f"{name} across the recorded tree: {src} -> {dst}")
                    rec.events.append({"op": "link" if name == "link" else "rename", "src": a, "dst": b})
                return out

            return fn

        def one(name, real):
            def fn(path, *args, **kwargs):
                if kwargs.get("dir_fd") is not None:
                    raise Unsupported(f"{name} with dir_fd")
                p = rec._mine(path)
                out = real(path, *args, **kwargs)
                if p:
                    rec.events.append({"op": name, "path": p})
                return out

            return fn

        for name in ("link", "rename", "replace"):
            self._set(os, name, two(name, getattr(os, name)))
        for name in ("unlink", "mkdir", "rmdir"):
            self._set(os, name, one(name, getattr(os, name)))
        self._set(os, "remove", one("unlink", os.remove))
        # LocalStorage's own binding, and fileio's, which the code above storage/ calls (fetch).
        self._set(local, "rename_noreplace", two("rename", local.rename_noreplace))
        self._set(fileio, "rename_noreplace", two("rename", fileio.rename_noreplace))
        return self

    def uninstall(self) -> None:
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved.clear()


# =================================================================================================
# The model: inodes, directory entries, file contents
# =================================================================================================
@dataclass
class Effect:
    idx: int  # position in the event log (0-based); the effect happened at "after event idx"
    kind: str  # "meta", "data", "fsync"
    ino: int = 0  # data/fsync: the inode
    dirs: tuple[int, ...] = ()  # meta: directories touched
    entries: tuple[tuple, ...] = ()  # meta: ("set", dir, name, ino) / ("del", dir, name)
    data: tuple = ()  # data: ("write", off, bytes) / ("trunc", size)


@dataclass
class Model:
    base_ino: int = 1
    is_dir: dict[int, bool] = field(default_factory=dict)
    entries: dict[int, dict[str, int]] = field(default_factory=dict)  # pre-state dirs
    content: dict[int, bytes] = field(default_factory=dict)  # pre-state files
    next_ino: int = 2


def load_prestate(base: str) -> tuple[Model, dict[str, int]]:
    """The tree below ``base`` as a model (every inode durable); and path -> inode."""
    m = Model()
    m.is_dir[1] = True
    m.entries[1] = {}
    paths = {os.path.realpath(base): 1}
    for dirpath, dirnames, filenames in os.walk(base):
        d = paths[os.path.realpath(dirpath)]
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                raise Unsupported(f"symlink in the pre-state: {full}")
            ino = m.next_ino
            m.next_ino += 1
            m.entries[d][name] = ino
            paths[os.path.realpath(full)] = ino
            if os.path.isdir(full):
                m.is_dir[ino] = True
                m.entries[ino] = {}
            else:
                m.is_dir[ino] = False
                with open(full, "rb") as f:
                    m.content[ino] = f.read()
    return m, paths


def replay(m: Model, base: str, events: list[dict[str, Any]]) -> list[Effect]:
    """Resolve the recorded events against the model (paths -> inodes) into effects."""
    base = os.path.realpath(base)
    ents = {d: dict(e) for d, e in m.entries.items()}
    is_dir = dict(m.is_dir)
    handles: dict[int, int] = {}
    nxt = m.next_ino

    def lookup(path: str) -> tuple[int, str, int | None]:
        rel = os.path.relpath(path, base)
        parts = [] if rel == "." else rel.split(os.sep)
        d = 1
        for p in parts[:-1]:
            d = ents[d][p]
        if not parts:
            return 0, "", 1
        return d, parts[-1], ents[d].get(parts[-1])

    out: list[Effect] = []
    for i, ev in enumerate(events):
        op = ev["op"]
        if op == "creat":
            d, name, _ = lookup(ev["path"])
            ino = nxt
            nxt += 1
            is_dir[ino] = False
            ents[d][name] = ino
            handles[ev["h"]] = ino
            out.append(Effect(i, "meta", dirs=(d,), entries=(("set", d, name, ino),)))
            out.append(Effect(i, "newfile", ino=ino))
        elif op == "bind":
            _, _, ino = lookup(ev["path"])
            handles[ev["h"]] = ino
        elif op == "write":
            out.append(Effect(i, "data", ino=handles[ev["h"]], data=("write", ev["off"], ev["data"])))
        elif op == "trunc":
            out.append(Effect(i, "data", ino=handles[ev["h"]], data=("trunc", ev["size"])))
        elif op == "fsync":
            out.append(Effect(i, "fsync", ino=handles[ev["h"]]))
        elif op == "fsync_dir":
            _, _, ino = lookup(ev["path"])
            out.append(Effect(i, "fsync", ino=ino))
        elif op == "mkdir":
            d, name, _ = lookup(ev["path"])
            ino = nxt
            nxt += 1
            is_dir[ino] = True
            ents[ino] = {}
            ents[d][name] = ino
            out.append(Effect(i, "meta", dirs=(d,), entries=(("set", d, name, ino),)))
            out.append(Effect(i, "newdir", ino=ino))
        elif op == "link":
            _, _, ino = lookup(ev["src"])
            d, name, _ = lookup(ev["dst"])
            ents[d][name] = ino
            out.append(Effect(i, "meta", dirs=(d,), entries=(("set", d, name, ino),)))
        elif op == "rename":
            sd, sname, ino = lookup(ev["src"])
            dd, dname, _ = lookup(ev["dst"])
            del ents[sd][sname]
            ents[dd][dname] = ino
            out.append(
                Effect(i, "meta", dirs=tuple(sorted({sd, dd})), entries=(("del", sd, sname), ("set", dd, dname, ino)))
            )
        elif op in ("unlink", "rmdir"):
            d, name, _ = lookup(ev["path"])
            del ents[d][name]
            out.append(Effect(i, "meta", dirs=(d,), entries=(("del", d, name),)))
        else:  # pragma: no cover
            raise Unsupported(op)
    return out


@dataclass
class CrashState:
    entries: dict[int, dict[str, int]]
    content: dict[int, bytes]
    is_dir: dict[int, bool]

    def files(self) -> dict[str, bytes | None]:
        """path -> bytes (None for a directory), reachable from the base."""
        out: dict[str, bytes | None] = {}

        def walk(d: int, prefix: str) -> None:
            for name, ino in sorted(self.entries.get(d, {}).items()):
                p = f"{prefix}{name}"
                if self.is_dir.get(ino):
                    out[p + "/"] = None
                    walk(ino, p + "/")
                else:
                    out[p] = self.content.get(ino, b"")

        walk(1, "")
        return out

    def digest(self) -> str:
        h = hashlib.sha1()
        for p, b in self.files().items():
            h.update(p.encode() + b"\0" + (b"D" if b is None else hashlib.sha1(b).digest()))
        return h.hexdigest()

    def materialize(self, target: str) -> None:
        os.makedirs(target)
        seen: dict[int, str] = {}

        def walk(d: int, path: str) -> None:
            for name, ino in sorted(self.entries.get(d, {}).items()):
                full = os.path.join(path, name)
                if self.is_dir.get(ino):
                    if ino in seen:
                        continue  # a directory reachable twice (not produced by atomic renames)
                    seen[ino] = full
                    os.mkdir(full)
                    walk(ino, full)
                elif ino in seen:
                    os.link(seen[ino], full)
                else:
                    seen[ino] = full
                    with open(full, "wb") as f:
                        f.write(self.content.get(ino, b""))

        walk(1, target)


def _apply_data(base: bytes, ops: list[tuple]) -> bytes:
    b = bytearray(base)
    for op in ops:
        if op[0] == "write":
            off, data = op[1], op[2]
            if len(b) < off:
                b.extend(b"\0" * (off - len(b)))
            b[off : off + len(data)] = data
        else:
            del b[op[1] :]
    return bytes(b)


class StateSpace:
    """The crash states after ``i`` effects' events, under one model."""

    def __init__(self, m: Model, effects: list[Effect], upto: int, model: str):
        self.m = m
        self.model = model
        effs = [e for e in effects if e.idx < upto]
        self.is_dir = dict(m.is_dir)
        for e in effs:
            if e.kind == "newdir":
                self.is_dir[e.ino] = True
            elif e.kind == "newfile":
                self.is_dir[e.ino] = False
        last_sync: dict[int, int] = {}
        last_any_sync = -1
        for e in effs:
            if e.kind == "fsync":
                last_sync[e.ino] = e.idx
                last_any_sync = e.idx
        self.meta = [e for e in effs if e.kind == "meta"]
        # Metadata units.
        if model == "ordered":
            lb = sum(1 for e in self.meta if e.idx < last_any_sync)
            synced_dirs = {i for i, e in enumerate(self.meta) if any(last_sync.get(d, -1) > e.idx for d in e.dirs)}
            lb = max([lb] + [i + 1 for i in synced_dirs])
            self.meta_units = [("global", list(range(len(self.meta))), lb)]
        else:
            per_dir: dict[int, list[int]] = {}
            for j, e in enumerate(self.meta):
                for d in e.dirs:
                    per_dir.setdefault(d, []).append(j)
            units = []
            for d, idxs in sorted(per_dir.items()):
                lb = sum(1 for j in idxs if last_sync.get(d, -1) > self.meta[j].idx)
                # a rename survives with either directory's fsync
                for k, j in enumerate(idxs):
                    if any(last_sync.get(o, -1) > self.meta[j].idx for o in self.meta[j].dirs):
                        lb = max(lb, k + 1)
                units.append((d, idxs, lb))
            self.meta_units = units
        # Data units.
        data: dict[int, list[Effect]] = {}
        for e in effs:
            if e.kind == "data":
                data.setdefault(e.ino, []).append(e)
        self.data_units = []
        self.durable: dict[int, bytes] = {}
        self.full: dict[int, bytes] = {}
        for ino, es in data.items():
            s = last_sync.get(ino, -1)
            dur = [e.data for e in es if e.idx < s]
            rest = [e.data for e in es if e.idx >= s]
            base = _apply_data(m.content.get(ino, b""), dur)
            self.durable[ino] = base
            self.full[ino] = _apply_data(base, rest)
            if rest:
                u = len(rest)
                options = sorted({0, 1, u // 2, u})
                self.data_units.append((ino, rest, base, options + [-1]))

    def size(self) -> int:
        n = 1
        for _, idxs, lb in self.meta_units:
            n *= len(idxs) - lb + 1
        for *_, opts in self.data_units:
            n *= len(opts)
        return n

    def _consistent(self, cuts: dict[Any, int]) -> set[int] | None:
        if self.model == "ordered":
            _, idxs, _ = self.meta_units[0]
            return set(idxs[: cuts["global"]])
        inc: dict[int, bool] = {}
        for d, idxs, _ in self.meta_units:
            for k, j in enumerate(idxs):
                val = k < cuts[d]
                if inc.setdefault(j, val) != val:
                    return None
        return {j for j, v in inc.items() if v}

    def build(self, cuts: dict[Any, int], datas: dict[int, int]) -> CrashState | None:
        chosen = self._consistent(cuts)
        if chosen is None:
            return None
        entries = {d: dict(e) for d, e in self.m.entries.items()}
        for j, e in enumerate(self.meta):
            if j not in chosen:
                continue
            for ent in e.entries:
                if ent[0] == "set":
                    entries.setdefault(ent[1], {})[ent[2]] = ent[3]
                else:
                    entries.setdefault(ent[1], {}).pop(ent[2], None)
        for ino, d in self.is_dir.items():
            if d:
                entries.setdefault(ino, {})
        content = dict(self.m.content)
        content.update(self.durable)
        for ino, rest, base, _ in self.data_units:
            k = datas[ino]
            if k == -1:
                content[ino] = base + b"\0" * max(0, len(self.full[ino]) - len(base))
            else:
                content[ino] = _apply_data(base, rest[:k])
        return CrashState(entries, content, self.is_dir)

    def states(self, cap: int, rnd: random.Random) -> tuple[list[CrashState], int]:
        """Every state if there are at most ``cap`` combinations; else the systematic ones (all
        unsynced operations lost; all kept; each unit alone lost with the rest kept; each unit
        alone kept with the rest lost) plus ``cap`` random combinations. Returns (states, space)."""
        meta_opts = [(u[0], list(range(u[2], len(u[1]) + 1))) for u in self.meta_units]
        data_opts = [(u[0], u[3]) for u in self.data_units]
        space = self.size()
        combos: list[tuple[dict, dict]] = []
        if space <= cap:
            for mc in itertools.product(*[o for _, o in meta_opts]):
                for dc in itertools.product(*[o for _, o in data_opts]):
                    combos.append((dict(zip([k for k, _ in meta_opts], mc)), dict(zip([k for k, _ in data_opts], dc))))
        else:
            lo = ({k: o[0] for k, o in meta_opts}, {k: 0 for k, o in data_opts})
            hi = ({k: o[-1] for k, o in meta_opts}, {k: max(o) for k, o in data_opts})
            combos = [lo, hi]
            for k, o in meta_opts:
                if len(o) > 1:
                    combos.append(({**hi[0], k: o[0]}, hi[1]))
                    combos.append(({**lo[0], k: o[-1]}, lo[1]))
            for k, _o in data_opts:
                combos.append((hi[0], {**hi[1], k: 0}))
                combos.append((hi[0], {**hi[1], k: -1}))
            for _ in range(cap):
                combos.append(({k: rnd.choice(o) for k, o in meta_opts}, {k: rnd.choice(o) for k, o in data_opts}))
        out = []
        for mc, dc in combos:
            s = self.build(mc, dc)
            if s is not None:
                out.append(s)
        return out, space


# =================================================================================================
# Scenarios and the campaign
# =================================================================================================
def _save(root: str, step: int, tag: str) -> str:
    import txckpt

    return txckpt.save_checkpoint(root, step, payload(tag, step))


PL_SCENARIOS = {
    "save": dict(
        title="save over a root with one checkpoint",
        build=lambda root: _save(root, 2, "A-2"),
        run=lambda root: _save(root, 4, "A-4"),
        old=["A-2"],
        new="A-4",
    ),
    "first": dict(
        title="first save on an empty root (the root directory does not exist yet)",
        build=lambda root: None,
        run=lambda root: _save(root, 2, "A-2"),
        old=[None],
        new="A-2",
    ),
    "fork": dict(
        title="fork (resume to step 2 of 2,4,6) + re-save step 4",
        build=lambda root: [_save(root, s, f"A-{s}") for s in (2, 4, 6)],
        run=lambda root: (__import__("txckpt").resume(root, step=2), _save(root, 4, "B-4")),
        old=["A-6", "A-2"],
        new="B-4",
    ),
}


def record(ctx: Ctx, name: str) -> dict[str, Any]:
    """Build the pre-state and record the run, in a child (fresh txckpt state)."""
    sc = PL_SCENARIOS[name]
    base = os.path.join(ctx.workdir, f"{name}-rec")
    root = os.path.join(base, "root")

    def run():
        import txckpt

        os.makedirs(base)
        sc["build"](root)
        txckpt.forget_roots()
        pre = os.path.join(ctx.workdir, f"{name}-pre")
        shutil.copytree(base, pre, symlinks=True)
        before = snapshot(root, None) if os.path.isdir(root) else {"checkpoints": {}}
        rec = Recorder(base).install()
        try:
            sc["run"](root)
        finally:
            rec.uninstall()
        return {
            "events": [dict(e, data=e["data"].hex()) if "data" in e else e for e in rec.events],
            "before": before,
            "pre": pre,
        }

    out = child_value(run, f"recording {name}")
    for e in out["events"]:
        if "data" in e:
            e["data"] = bytes.fromhex(e["data"])
    out["base"] = base
    return out


def commit_points(events: list[dict[str, Any]], base: str) -> tuple[int | None, int | None]:
    """(index of the link of the save's commit entry, index of the fsync of log/ after it)."""
    logdir = os.path.join(base, "root", ".txckpt", "log")
    links = [i for i, e in enumerate(events) if e["op"] == "link" and os.path.dirname(e["dst"]) == logdir]
    if not links:
        return None, None
    link = links[-1]
    fs = next(
        (i for i in range(link, len(events)) if events[i]["op"] == "fsync_dir" and events[i]["path"] == logdir), None
    )
    return link, fs


def explore(ctx: Ctx, case: Case, result: Result) -> None:
    name = case.params["scenario"]
    sc = PL_SCENARIOS[name]
    rec = record(ctx, name)
    events, base, pre = rec["events"], rec["base"], rec["pre"]
    m, _ = load_prestate(pre)
    effects = replay(m, base, events)
    # Fidelity: the model after every event must be the tree the real run left.
    final = StateSpace(m, effects, len(events) + 1, "ordered")
    everything = final.build({"global": len(final.meta)}, {u[0]: len(u[1]) for u in final.data_units})
    real = {}
    for dirpath, dirnames, filenames in os.walk(base):
        rel = os.path.relpath(dirpath, base)
        for d in dirnames:
            real[(d if rel == "." else f"{rel}/{d}") + "/"] = None
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                real[f if rel == "." else f"{rel}/{f}"] = fh.read()
    if everything is None or everything.files() != real:
        got = everything.files() if everything else {}
        diff = sorted(set(got) ^ set(real)) or [p for p in real if got.get(p) != real[p]]
        raise RuntimeError(f"the recorder missed operations: model and disk differ at {diff[:5]}")
    link, log_fsync = commit_points(events, base)
    quick = ctx.quick
    cap = case.params.get("cap_quick", 3) if quick else case.params.get("cap_full", 40)
    rnd = random.Random(ctx.seed)
    before = rec["before"]
    seen: dict[str, list[str]] = {}  # state digest -> violations
    per_model = {"posix": [0, 0, 0], "ordered": [0, 0, 0]}  # states, violations, space
    found: list[str] = []
    n_points = len(events) + 1
    points = range(n_points)
    work = os.path.join(ctx.workdir, "states")
    for i in points:
        durable_commit = log_fsync is not None and i > log_fsync
        allowed = [sc["new"]] if durable_commit else sc["old"] + [sc["new"]]
        expect = {
            "allowed": allowed,
            "before": before,
            # The restart and gc run on a sample (they are the slow part of a check).
            "restart": True,
            "gc": True,
        }
        for model in ("posix", "ordered"):
            space = StateSpace(m, effects, i, model)
            states, size = space.states(cap, rnd)
            per_model[model][2] += size
            for st in states:
                dg = st.digest() + "|" + ",".join(map(str, allowed))  # same state, same expectation
                per_model[model][0] += 1
                if dg not in seen:
                    target = os.path.join(work, dg[:16])
                    shutil.rmtree(target, ignore_errors=True)
                    st.materialize(target)
                    root = os.path.join(target, "root")
                    try:
                        seen[dg] = check(root, None, expect)
                    except Exception as e:
                        seen[dg] = [f"[harness] check failed: {type(e).__name__}: {e}"]
                    shutil.rmtree(target, ignore_errors=True)
                vs = seen[dg]
                if vs:
                    per_model[model][1] += 1
                    what = (
                        events[i - 1]["op"]
                        + " "
                        + os.path.relpath(
                            events[i - 1].get("path") or events[i - 1].get("dst") or events[i - 1].get("src") or base,
                            base,
                        )
                        if i
                        else "before the first op"
                    )
                    found += [
                        f"{model}: power cut after op {i}/{len(events)} ({what}){' [commit durable]' if durable_commit else ''}: {v}"
                        for v in vs[:2]
                    ]
    result.tried = 1
    result.points = per_model["posix"][0] + per_model["ordered"][0]
    result.unit = "crash states"
    result.notes.append(
        f"{len(events)} recorded ops, {n_points} power-cut points, {len(seen)} distinct states checked; "
        f"posix: {per_model['posix'][0]} states ({per_model['posix'][1]} with violations) of a space of "
        f"{per_model['posix'][2]}; ordered: {per_model['ordered'][0]} states ({per_model['ordered'][1]} with "
        f"violations) of {per_model['ordered'][2]}; commit entry linked at op {None if link is None else link + 1}, "
        f"log/ fsynced at op {None if log_fsync is None else log_fsync + 1}"
    )
    classify(result, found, case.known)
    # Count per model in the notes for the report.
    result.notes.append(
        f"by model: posix {per_model['posix'][0]} states / {per_model['posix'][1]} violating; "
        f"ordered {per_model['ordered'][0]} states / {per_model['ordered'][1]} violating"
    )


def cases() -> list[Case]:
    out = []
    for name, sc in PL_SCENARIOS.items():
        out.append(
            Case(
                f"powerloss/{name}",
                "powerloss",
                sc["title"],
                "local",
                explore,
                known=(),
                cost=30.0,
                params={"scenario": name},
            )
        )
    return out
