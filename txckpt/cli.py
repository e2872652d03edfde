"""The ``txckpt`` command: see and fix what is in a root without writing Python.

Commands: log, ls, show, verify, gc, adopt, export, resume (docs/cli.md). Every command takes a
root path or fsspec URL, ``--storage-option k=v`` (repeatable) and ``--json``.

Exit codes: 0 ok; 1 a problem was found (damage, a missing checkpoint, a failed operation, any
txckpt error); 2 a usage error (bad arguments, a ROOT or PATH that does not exist or is not a
txckpt root, a non-empty export destination).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Sequence

from . import __version__, checksum
from .errors import (
    CheckpointNotFoundError,
    IntegrityError,
    InvalidArgumentError,
    ManifestError,
    NotACheckpointError,
    NotATxckptRootError,
    SpecialFileError,
    TxckptError,
)
from .manifest import MANIFEST_NAME, FileEntry, Manifest
from .progress import BarAwareHandler, bar as progress_bar, bar_wanted, human

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A command line that cannot be run as given (exit code 2)."""


class Problem(Exception):
    """A problem found while running a command (exit code 1); the message is printed."""


# ----- formatting ----------------------------------------------------------------------------------
def human_bytes(n: int | None) -> str:
    return "-" if n is None else human(n, si=True)


def human_time(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = []
    for r in [header] + rows:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


# ----- argument handling ---------------------------------------------------------------------------
def parse_storage_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``k=v`` pairs -> dict; values are parsed as JSON when they parse (numbers, true, {...})."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE, not {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


def open_root_arg(path: str, options: dict[str, Any], *, must_exist: bool = True):
    """A CheckpointRoot for ROOT, or UsageError if there is nothing there."""
    from .root import CheckpointRoot

    if not _is_url(path) and not os.path.isdir(path):
        raise UsageError(f"ROOT {path} is not a directory")
    try:
        root = CheckpointRoot(path, options)
    except (ValueError, ImportError, TypeError) as e:
        raise UsageError(f"cannot open {path}: {e}") from None
    if must_exist and not _looks_like_root(root):
        raise NotATxckptRootError(
            f"{path} is not a txckpt root: it has no .txckpt/log and no checkpoint-N directories; "
            "give the training output_dir (or the URL) that holds them"
        )
    return root


def _looks_like_root(root: Any) -> bool:
    s = root.storage
    return bool(s.list_dir(".txckpt/log")) or bool(root.legacy_checkpoints()) or s.exists(".txckpt")


def _configure_logging(verbose: bool) -> None:
    logger = logging.getLogger("txckpt")
    if not any(getattr(h, "_txckpt_cli", False) for h in logger.handlers):
        handler = BarAwareHandler(sys.stderr)  # a record never lands inside a progress bar
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._txckpt_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False


# ----- log: the lineage graph (drawn by txckpt/logview.py) ----------------------------------------
def cmd_log(args: argparse.Namespace) -> int:
    from .logview import build_graph, render_dot, render_text

    if args.json and args.format != "text":
        raise UsageError("--json and --format dot are alternatives; give one")
    root = open_root_arg(args.root, args.storage_options)
    history = root.history()
    if history.state.seq < 0:
        legacy = root.legacy_checkpoints()
        if args.json:
            _print_json({"head": None, "lineages": [], "nodes": [], "legacy_steps": legacy})
        elif args.format == "dot":
            print("digraph txckpt {\n  " + " -> ".join(f'"checkpoint-{s} (legacy)"' for s in legacy) + "\n}")
        else:
            print(f"{root.url} has no txckpt log; legacy checkpoint-N steps: {legacy or 'none'}. "
                  "Run `txckpt adopt ROOT` to record them as a lineage.")
        return EXIT_OK
    graph = build_graph(root, history, max_count=args.max_count or None, include_retired=args.all)
    if args.json:
        _print_json({k: v for k, v in graph.items() if k != "lines"} | {"graph": [p for p, _ in graph["lines"]]})
    elif args.format == "dot":
        print(render_dot(graph, f"txckpt log {root.url}"))
    else:
        print(render_text(graph))
    return EXIT_OK


# ----- ls ------------------------------------------------------------------------------------------
def staged_leftovers(root: Any, history: Any) -> list[dict[str, Any]]:
    """Uncommitted staging directories, with whether their writer is still alive."""
    from .gc import _staged_step, _tree_bytes, read_intents, writer_status
    from .publication import TX_DIR

    intents = read_intents(root.storage)
    now = time.time()
    out = []
    for txid in root.storage.list_dir(TX_DIR):
        if txid in history.checkpoints:
            continue
        key = f"{TX_DIR}/{txid}"
        step = _staged_step(root.storage, key)
        parts = txid.split("-")
        lineage = parts[1] if len(parts) >= 3 else "?"
        intent = intents.get(txid)
        gone, why = writer_status(intent, now=now, grace_seconds=float("inf"))
        t = (intent or {}).get("time") or root.storage.modified_time(key)
        out.append({
            "step": step, "lineage": lineage, "txid": txid, "state": "staged-leftover" if gone else "staging",
            "bytes": _tree_bytes(root.storage, key), "time": t, "path": root.storage.full_path(key),
            "key": key, "adopted": False, "published": False, "writer": why,
        })
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    history = root.history()
    rows_json: list[dict[str, Any]] = []
    if history.state.seq < 0:
        for step, key in root.legacy_dirs():
            rows_json.append({"step": step, "lineage": "-", "txid": None, "state": "legacy",
                              "bytes": sum(max(0, s) for _, s in root.storage.walk_files(key)),
                              "time": root.storage.modified_time(key), "path": root.storage.full_path(key),
                              "key": key, "adopted": False, "published": True})
    else:
        lineage = "all" if args.lineage is None else args.lineage
        for info in root.checkpoints(lineage):
            if args.lineage is not None and info.state == "retired":
                continue
            rows_json.append({
                "step": info.step, "lineage": info.lineage, "txid": info.txid, "state": info.state,
                "bytes": info.bytes, "time": info.time, "path": info.path,
                "key": root.storage.key_of(info.path) if info.path else None,
                "adopted": info.adopted, "published": info.published, "files": info.files,
                "missing": info.path is None and info.state != "retired",
            })
    if args.lineage is None:
        rows_json.extend(staged_leftovers(root, history))
    rows_json.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["time"] or 0))
    if args.json:
        _print_json(rows_json)
        return EXIT_OK
    rows = []
    for r in rows_json:
        state = r["state"]
        if r.get("adopted"):
            state += " (adopted)"
        if r.get("missing"):
            state += " (data missing!)"
        where = r["key"] if r["key"] is not None else ("(deleted)" if r["state"] == "retired" else "(missing)")
        rows.append([str(r["step"] if r["step"] is not None else "?"), r["lineage"], human_bytes(r["bytes"]),
                     human_time(r["time"]), state, where])
    if not rows:
        print("no checkpoints")
        return EXIT_OK
    print(table(rows, ["STEP", "LINEAGE", "SIZE", "TIME", "STATE", "PATH"]))
    return EXIT_OK


# ----- show ----------------------------------------------------------------------------------------
def _find_root_of(path: str, options: dict[str, Any]) -> tuple[Any, str] | None:
    """The txckpt root a checkpoint path lies in (checkpoint-N or .txckpt/tx/<txid>/checkpoint-N)."""
    from .root import CheckpointRoot

    p = path.rstrip("/")
    for up in (1, 4):
        parts = p.rsplit("/", up)
        if len(parts) != up + 1:
            continue
        base = parts[0]
        if up == 4 and not (parts[1] == ".txckpt" and parts[2] == "tx"):
            continue
        try:
            candidate = CheckpointRoot(base, options)
            if candidate.storage.list_dir(".txckpt/log"):
                return candidate, candidate.storage.key_of(path) or ""
        except Exception:
            continue
    return None


def _checkpoint_arg(args: argparse.Namespace) -> tuple[str, Any | None]:
    """PATH of a checkpoint, from PATH or from ROOT --step/--txid."""
    if args.step is None and args.txid is None:
        return args.path, None
    root = open_root_arg(args.path, args.storage_options)
    history = root.history()
    c = history.find(step=args.step, txid=args.txid)
    if c.txid in history.retired:
        raise CheckpointNotFoundError(f"checkpoint txid {c.txid} was retired by the retention policy")
    where = root.locate(c.ref)
    if where is None:
        raise CheckpointNotFoundError(f"checkpoint step {c.step} (txid {c.txid}) is committed but its data is missing")
    return where, root


def cmd_show(args: argparse.Namespace) -> int:
    from .api import read_manifest

    path, root = _checkpoint_arg(args)
    if not _is_url(path) and not os.path.exists(path):
        raise UsageError(f"PATH {path} does not exist")
    try:
        manifest = read_manifest(path, storage_options=args.storage_options)
    except NotACheckpointError:
        tip = open_root_arg(path, args.storage_options).state().head_tip
        example = f"e.g. --step {tip['step']}, the newest; " if tip else ""
        raise UsageError(
            f"{path} is a root, not a checkpoint: add --step N for a step of its current lineage "
            f"({example}`txckpt ls ROOT` lists them) or --txid T for any lineage, or give a checkpoint "
            "directory"
        ) from None
    status = None
    found = (root, root.storage.key_of(path)) if root is not None else _find_root_of(path, args.storage_options)
    if found is not None:
        r, _key = found
        h = r.history()
        c = h.checkpoints.get(manifest.txid)
        if c is None or c.digest != manifest.digest:
            status = "NOT committed in this root (a staging leftover, or copied from elsewhere)"
        elif c.txid in h.retired:
            status = "retired"
        elif c.txid in {x.txid for x in h.in_view(None)}:
            status = "current" + (" (HEAD tip)" if (h.state.head_tip or {}).get("txid") == c.txid else "")
        else:
            status = "abandoned"
    info = {
        "path": path, "txid": manifest.txid, "lineage": manifest.lineage, "step": manifest.step,
        "parent": manifest.parent, "created": manifest.created, "world_size": manifest.world_size,
        "adopted": manifest.adopted, "checksum_algorithm": checksum.ALGORITHM, "digest": manifest.digest,
        "bytes": manifest.total_bytes, "metadata": manifest.metadata, "state": status,
        "files": {n: manifest.files[n].to_json() for n in sorted(manifest.files)},
    }
    if args.json:
        _print_json(info)
        return EXIT_OK
    parent = manifest.parent
    if parent and "txid" in parent:
        parent_s = f"step {parent['step']} of lineage {parent['lineage']} (txid {parent['txid']})"
    elif parent and "external" in parent:
        parent_s = f"external {parent['external']}"
    else:
        parent_s = "none (first checkpoint of a root lineage)"
    print(f"checkpoint  {path}")
    print(f"step        {manifest.step}")
    print(f"lineage     {manifest.lineage}")
    print(f"txid        {manifest.txid}")
    if status:
        print(f"state       {status}")
    print(f"parent      {parent_s}")
    print(f"created     {human_time(manifest.created)}")
    print(f"world size  {manifest.world_size}")
    if manifest.adopted:
        print("adopted     yes (checksums computed at adoption)")
    print(f"checksums   {checksum.ALGORITHM}, manifest digest {manifest.digest}")
    print(f"files       {len(manifest.files)}, {human_bytes(manifest.total_bytes)}")
    rows = [[n, human_bytes(e.size), str(e.size), e.kind, str(e.rank), e.checksum]
            for n, e in sorted(manifest.files.items())]
    print("\n" + "\n".join("  " + line for line in table(rows, ["FILE", "SIZE", "BYTES", "KIND", "RANK", "XXH3-128"]).splitlines()))
    if manifest.metadata:
        print("\nmetadata")
        for line in json.dumps(manifest.metadata, indent=2, sort_keys=True, default=str).splitlines():
            print("  " + line)
    return EXIT_OK


# ----- verify --------------------------------------------------------------------------------------
class _Task:
    __slots__ = ("storage", "key", "where", "entry")

    def __init__(self, storage: Any, key: str, where: str, entry: FileEntry):
        self.storage, self.key, self.where, self.entry = storage, key, where, entry


def _check_file(task: _Task) -> tuple[int, str | None]:
    s, key, where, entry = task.storage, task.key, task.where, task.entry
    if s.is_symlink_escape(key):
        return 0, f"{where}: a symlink that leaves the root (refused)"
    try:
        with s.open_read(key) as f:
            size, digest = checksum.digest_stream(f)
    except (FileNotFoundError, NotADirectoryError):
        return 0, f"{where}: missing (the manifest lists it, {entry.size} bytes)"
    except IsADirectoryError:
        return 0, f"{where}: a directory where the manifest lists a file"
    except SpecialFileError as e:
        return 0, f"{where}: a {e.kind}, not a regular file (not read: reading would block)"
    except OSError as e:
        return 0, f"{where}: unreadable ({e})"
    if size != entry.size:
        return size, f"{where}: {size} bytes, the manifest says {entry.size} (truncated or rewritten)"
    if digest != entry.checksum:
        return size, f"{where}: checksum mismatch (xxh3-128 {digest}, the manifest says {entry.checksum}): its bytes changed after the commit"
    return size, None


def _plan_checkpoint(storage: Any, key: str, where: str, expected: Any | None,
                     problems: list[str], warnings: list[str]) -> tuple[Manifest | None, list[_Task]]:
    prefix = f"{key}/" if key else ""
    try:
        data = storage.read_bytes(f"{prefix}{MANIFEST_NAME}")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        problems.append(f"{where}/{MANIFEST_NAME}: missing (not a committed txckpt checkpoint)")
        return None, []
    except SpecialFileError as e:
        problems.append(f"{where}/{MANIFEST_NAME}: a {e.kind}, not a regular file (not read)")
        return None, []
    try:
        manifest = Manifest.decode(data, f"{where}/{MANIFEST_NAME}")
    except ManifestError as e:
        problems.append(str(e))
        return None, []
    if expected is not None:
        if manifest.txid != expected.txid:
            problems.append(f"{where}/{MANIFEST_NAME}: names txid {manifest.txid}, the log expects {expected.txid}")
            return None, []
        if manifest.digest != expected.digest:
            problems.append(f"{where}/{MANIFEST_NAME}: differs from the manifest the log committed "
                            f"(digest {manifest.digest}, committed {expected.digest}): replaced after the commit")
    tasks = [_Task(storage, f"{prefix}{name}", f"{where}/{name}", entry) for name, entry in sorted(manifest.files.items())]
    try:
        listed = {name for name, _ in storage.walk_files(key)}
        extra = sorted(listed - set(manifest.files) - {MANIFEST_NAME})
        if extra:
            warnings.append(f"{where}: {len(extra)} file(s) not in the manifest (added after the commit?): "
                            + ", ".join(extra[:10]) + (" ..." if len(extra) > 10 else ""))
    except OSError:
        pass
    return manifest, tasks


def run_verify(target: str, options: dict[str, Any], *, workers: int | None = None,
               progress: bool = False, include_abandoned: bool = True) -> dict[str, Any]:
    """Verify a root (every committed checkpoint that is not retired) or one checkpoint."""
    from .storage import open_storage

    storage = open_storage(target, options)
    problems: list[str] = []
    warnings: list[str] = []
    tasks: list[_Task] = []
    checked: list[dict[str, Any]] = []
    if not _is_url(target) and not os.path.isdir(target):
        raise UsageError(f"{target} is not a directory")
    if storage.exists(MANIFEST_NAME) or (
        os.path.basename(target.rstrip("/")).startswith("checkpoint-") and not storage.exists(".txckpt")
        and not storage.list_dir(".txckpt/log")
    ):
        manifest, t = _plan_checkpoint(storage, "", target.rstrip("/"), None, problems, warnings)
        tasks += t
        if manifest is not None:
            checked.append({"path": target, "step": manifest.step, "txid": manifest.txid, "files": len(t)})
        kind = "checkpoint"
    else:
        root = open_root_arg(target, options)
        kind = "root"
        try:
            # An audit reads every entry (a fresh process's lookups and retention may start from
            # a history snapshot and never read old entries again: damage there shows up here).
            from . import log as commit_log

            history = commit_log.read_history(root.storage, snapshots=False)
        except TxckptError as e:
            problems.append(str(e))
            history = None
        if history is not None:
            try:
                quick = commit_log.read_history(root.storage)
            except TxckptError as e:
                problems.append(str(e))
            else:
                if quick.base_seq >= 0 and quick.state.seq == history.state.seq and not quick.folds_like(history):
                    problems.append(
                        f"the history snapshot of log entry {quick.base_seq} disagrees with the log; "
                        "delete .txckpt/snapshots/ (snapshots only save reading the log)"
                    )
        if history is not None and history.state.seq < 0:
            legacy = root.legacy_checkpoints()
            if legacy:
                warnings.append(f"{root.url} has no txckpt log: its {len(legacy)} legacy checkpoint(s) carry no "
                                "checksums to verify; `txckpt adopt` records them")
        elif history is not None:
            current = {c.txid for c in history.in_view(None)}
            for c in sorted(history.checkpoints.values(), key=lambda c: (c.step, c.seq)):
                if c.txid in history.retired or (not include_abandoned and c.txid not in current):
                    continue
                key = root.publication.locate(c.ref)
                label = f"step {c.step} (lineage {c.lineage}, txid {c.txid})"
                if key is None:
                    problems.append(f"{label}: committed, but its data is missing from {root.url} "
                                    "(no manifest naming it at checkpoint-N or its home)")
                    continue
                manifest, t = _plan_checkpoint(root.storage, key, root.storage.full_path(key), c, problems, warnings)
                tasks += t
                checked.append({"path": root.storage.full_path(key), "step": c.step, "txid": c.txid,
                                "lineage": c.lineage, "state": "current" if c.txid in current else "abandoned",
                                "files": len(t)})
    total = sum(t.entry.size for t in tasks)
    workers = workers or min(8, max(2, 2 * (os.cpu_count() or 1)))
    read = 0
    with progress_bar("verify", total=total, enabled=progress) as bar, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_check_file, t) for t in tasks]
        for done in as_completed(futures):  # the bar moves as each file finishes, in any order
            bar.update(done.result()[0])
        for size, problem in (f.result() for f in futures):  # problems in the files' order
            read += size
            if problem:
                problems.append(problem)
    return {"target": target, "kind": kind, "checkpoints": checked, "files": len(tasks), "bytes": read,
            "problems": problems, "warnings": warnings, "ok": not problems}


def cmd_verify(args: argparse.Namespace) -> int:
    started = time.monotonic()
    progress = bar_wanted(args.no_progress, args.json)
    result = run_verify(args.target, args.storage_options, workers=args.workers, progress=progress)
    result["seconds"] = round(time.monotonic() - started, 3)
    if args.json:
        _print_json(result)
    else:
        for w in result["warnings"]:
            print(f"warning: {w}")
        for p in result["problems"]:
            print(f"PROBLEM: {p}")
        n = len(result["checkpoints"])
        verdict = "OK" if result["ok"] else f"{len(result['problems'])} problem(s)"
        print(f"verified {n} checkpoint(s), {result['files']} file(s), {human_bytes(result['bytes'])} "
              f"in {result['seconds']:.2f}s: {verdict}")
    return EXIT_OK if result["ok"] else EXIT_PROBLEM


# ----- gc ------------------------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace) -> int:
    from .gc import collect_garbage
    from .retention import RetentionPolicy

    root = open_root_arg(args.root, args.storage_options)
    policy = None
    if args.keep_last is not None or args.keep_every is not None or args.abandoned_ttl is not None:
        policy = RetentionPolicy(
            keep_last=args.keep_last, keep_every=args.keep_every, keep_best=args.keep or [],
            abandoned="keep" if args.abandoned_ttl is None else args.abandoned_ttl,
        )
    with progress_bar("gc", enabled=not args.dry_run and bar_wanted(args.no_progress, args.json)):
        report = collect_garbage(root, dry_run=args.dry_run, grace_seconds=args.grace, policy=policy)
    if args.json:
        _print_json(report.to_json())
        return EXIT_PROBLEM if report.errors else EXIT_OK
    verb_remove = "would remove" if args.dry_run else "removed"
    for item in report.items:
        if item.kind in ("publish", "unpublish"):
            verb = ("would " + item.kind) if args.dry_run else (item.kind + "ed" if item.done else item.kind + " FAILED")
        elif item.kind == "policy":
            verb = "would remove" if args.dry_run else ("removed" if item.done else "kept")
        else:
            verb = verb_remove if (args.dry_run or item.done) else "FAILED to remove"
        size = f"  {human_bytes(item.bytes)}" if item.bytes else ""
        err = f"  [{item.error}]" if item.error else ""
        print(f"{verb:<16} {item.kind:<9} {item.key}{size}  ({item.reason}){err}")
    for item in report.kept:
        print(f"{'kept':<16} {item.kind:<9} {item.key}  ({item.reason})")
    for o in report.orphans:
        print(f"{'orphan (kept)':<16} {'orphan':<9} {o}  (moved aside by txckpt; inspect it, then delete "
              "it or move it back by hand)")
    if not report.items:
        print("nothing to collect")
    else:
        n = len([i for i in report.items if i.kind not in ("publish", "unpublish")])
        names = [f"{k} checkpoint name(s) {'would be ' if args.dry_run else ''}{kind}ed"
                 for kind in ("publish", "unpublish")
                 if (k := sum(i.kind == kind and (args.dry_run or i.done) for i in report.items))]
        print(f"{n} item(s), {human_bytes(report.bytes)} {'reclaimable' if args.dry_run else 'reclaimed'}"
              + "".join(f"; {x}" for x in names)
              + (f", {len(report.errors)} error(s)" if report.errors else ""))
    return EXIT_PROBLEM if report.errors else EXIT_OK


# ----- adopt ---------------------------------------------------------------------------------------
def cmd_adopt(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    if root.state().seq >= 0:
        msg = {"adopted": None, "message": f"{root.url} already has a txckpt log; nothing to adopt"}
    else:
        steps = root.legacy_checkpoints()
        with progress_bar("adopt", enabled=bar_wanted(args.no_progress, args.json)):  # bytes hashed
            lid = root.adopt()
        msg = {"adopted": lid, "steps": steps,
               "message": (f"adopted steps {', '.join(map(str, steps))} of {root.url} as lineage {lid}" if lid
                           else f"another process adopted {root.url} first; nothing to do"
                           if root.state().seq >= 0 else "nothing to adopt")}
    if args.json:
        _print_json(msg)
    else:
        print(msg["message"])
    return EXIT_OK


# ----- export --------------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    from .checksum import HashingWriter
    from .storage import open_storage

    root = open_root_arg(args.root, args.storage_options)
    history = root.history()
    if args.txid is None and args.step is None:
        raise UsageError("give --step N (a step of the current lineage) or --txid T")
    c = history.find(step=args.step, txid=args.txid)
    if c.txid in history.retired:
        raise CheckpointNotFoundError(f"checkpoint txid {c.txid} was retired by the retention policy")
    key = root.publication.locate(c.ref)
    if key is None:
        raise CheckpointNotFoundError(
            f"checkpoint step {c.step} (txid {c.txid}) is committed but its data is missing; see `txckpt verify`"
        )
    src = root.storage
    manifest = Manifest.decode(src.read_bytes(f"{key}/{MANIFEST_NAME}"), src.full_path(f"{key}/{MANIFEST_NAME}"))
    if manifest.digest != c.digest:
        raise IntegrityError(f"{src.full_path(key)}/{MANIFEST_NAME} differs from the manifest the log committed")
    dest_options = parse_storage_options(args.dest_storage_option) if args.dest_storage_option else args.storage_options
    dest = open_storage(args.dest, dest_options if _is_url(args.dest) else None)
    dest_local = dest.local_path("")
    if dest_local is not None and os.path.lexists(dest_local) and not os.path.isdir(dest_local):
        raise UsageError(f"DEST {args.dest} is an existing file; export into a new or empty directory")
    inside = src.key_of(dest.full_path("")) is not None and dest.full_path("").startswith(src.full_path(""))
    if dest_local is not None and src.local_path("") is not None:
        # Real paths: a DEST reached through a symlink into the root is inside it (gc would
        # take the export for garbage there).
        from .storage.local import lies_within

        inside = inside or lies_within(dest_local, src.local_path(""))
    if inside:
        raise UsageError(f"DEST {args.dest} lies inside ROOT (its real path, symlinks resolved); "
                         "export outside the root")
    if dest.exists("") and dest.list_dir(""):
        raise UsageError(f"DEST {args.dest} exists and is not empty; export into a new or empty directory")
    durable = not args.no_sync
    written: list[str] = []
    problems: list[str] = []
    bar = progress_bar("export", total=manifest.total_bytes, enabled=bar_wanted(args.no_progress, args.json))
    for name, entry in sorted(manifest.files.items()):
        if src.is_symlink_escape(f"{key}/{name}"):
            problems.append(f"{src.full_path(key)}/{name}: a symlink that leaves the root (refused)")
            break
        try:
            reader = src.open_read(f"{key}/{name}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, SpecialFileError) as e:
            what = f"a {e.kind}, not a regular file" if isinstance(e, SpecialFileError) else "missing"
            problems.append(f"{src.full_path(key)}/{name}: {what}")
            break
        writer = HashingWriter(dest.open_write(name, durable=durable))
        written.append(name)
        try:
            with reader:
                while True:
                    block = reader.read(8 << 20)
                    if not block:
                        break
                    writer.write(block)
                    bar.update(len(block))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        if writer.size != entry.size or writer.digest != entry.checksum:
            problems.append(f"{src.full_path(key)}/{name}: {writer.size} bytes / xxh3-128 {writer.digest}, "
                            f"the manifest says {entry.size} / {entry.checksum}: the source is damaged")
            break
    bar.close()
    if problems:
        for name in written:
            dest.delete_file(name)
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        print(f"export aborted; removed the {len(written)} file(s) it had written to {args.dest}", file=sys.stderr)
        return EXIT_PROBLEM
    if not args.no_manifest:
        dest.create_exclusive(MANIFEST_NAME, src.read_bytes(f"{key}/{MANIFEST_NAME}"), durable=durable)
    if durable:
        dirs = {n.rsplit("/", 1)[0] for n in manifest.files if "/" in n}
        for d in sorted(dirs, key=len, reverse=True):
            dest.sync_dir(d)
        dest.sync_dir("")
    result = {"source": src.full_path(key), "dest": dest.full_path(""), "step": c.step, "txid": c.txid,
              "lineage": c.lineage, "files": len(manifest.files), "bytes": manifest.total_bytes,
              "manifest": not args.no_manifest}
    if args.json:
        _print_json(result)
    else:
        print(f"exported step {c.step} (lineage {c.lineage}, txid {c.txid}): {len(manifest.files)} file(s), "
              f"{human_bytes(manifest.total_bytes)}, each verified against its checksum, to {result['dest']}")
    return EXIT_OK


# ----- resume --------------------------------------------------------------------------------------
def cmd_resume(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    before = root.history()
    head_before = before.state.head
    current_before = {c.txid: c for c in before.in_view(None)}
    tip = before.state.head_tip
    if args.step is None or (tip is not None and tip["step"] == args.step):
        # Nothing to roll back: only say where a restart continues. root.resume() would also
        # claim the lineage for this command's session, fencing off the job that is writing
        # it (StaleLineageError at its next save); the operator's command is no writer.
        path = root.get_last_checkpoint()
    else:
        path = root.resume(args.step)
    after = root.history()
    current_after = {c.txid for c in after.in_view(None)}
    abandoned = [c for t, c in current_before.items() if t not in current_after]
    forked = after.state.head != head_before
    result = {
        "path": path, "head": after.state.head, "forked": forked, "previous_head": head_before,
        "abandoned": [{"step": c.step, "lineage": c.lineage, "txid": c.txid} for c in abandoned],
    }
    if args.json:
        _print_json(result)
        return EXIT_OK
    if path is None:
        print(f"{root.url} has no checkpoint to resume from; training starts from scratch")
    elif forked:
        print(f"resumed at {path}: new lineage {after.state.head} (the current one from now on); "
              f"{len(abandoned)} checkpoint(s) of lineage {head_before} are abandoned and kept intact.")
        print("A training job still writing this root with the old lineage will be refused "
              "(StaleLineageError) at its next save; restart it with resume.")
    else:
        print(f"{path} is already the newest checkpoint of the current lineage {after.state.head}; nothing changed")
    return EXIT_OK


# ----- the parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=None, metavar="KEY=VALUE",
                        dest="storage_option",
                        help="fsspec storage option for ROOT (repeatable); VALUE is parsed as JSON when it parses")
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_argument("--verbose", "-v", action="store_true", help="log txckpt's INFO messages")

    p = argparse.ArgumentParser(
        prog="txckpt",
        description="Inspect and maintain txckpt checkpoint roots.",
        epilog="Exit codes: 0 ok; 1 a problem was found (damage, missing data, a failed operation); "
               "2 usage error. See docs/cli.md.",
    )
    p.add_argument("--version", action="version", version=f"txckpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sp = sub.add_parser("log", parents=[common], help="the lineage graph (like git log --graph)",
                        description="Draw the root's lineage graph, newest first, like git log --graph: every "
                                    "committed checkpoint with its step, lineage, state (current, abandoned, "
                                    "retired) and where its data is; forks, and HEAD, the lineage the next "
                                    "resume and save follow.")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("-n", "--max-count", type=int, default=None, metavar="N",
                    help="show only the N newest checkpoints (default: all)")
    sp.add_argument("--all", action="store_true",
                    help="also show checkpoints the retention policy retired (their data is deleted)")
    sp.add_argument("--format", choices=("text", "dot"), default="text",
                    help="text (default) or dot: Graphviz source, e.g. `| dot -Tpng -o lineages.png`")
    sp.set_defaults(func=cmd_log)

    sp = sub.add_parser("ls", parents=[common], help="table of committed checkpoints and leftover staging",
                        description="List every committed checkpoint of every lineage in a table (step, "
                                    "lineage, size, time, state, path), plus staging directories of saves that "
                                    "never committed.")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--lineage", default=None,
                    help='only the view of this lineage ("current" for the head); default: everything')
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("show", parents=[common], help="a checkpoint's manifest, readable",
                        description="Print one checkpoint's manifest, readable: step, lineage, txid, parent, "
                                    "files with sizes and checksums, metadata, and whether the root's log "
                                    "committed it. Give a checkpoint directory, or ROOT with --step/--txid.")
    sp.add_argument("path", metavar="PATH", help="a checkpoint directory (or ROOT with --step/--txid)")
    sp.add_argument("--step", type=int, default=None, help="PATH is a root: show this step of the current lineage")
    sp.add_argument("--txid", default=None, help="PATH is a root: show the checkpoint with this txid")
    sp.set_defaults(func=cmd_show)

    sp = sub.add_parser("verify", parents=[common], help="check sizes and checksums of a root or one checkpoint",
                        description="Read every file of every committed checkpoint of a root (or of one "
                                    "checkpoint) and check its size and checksum against the manifest; report "
                                    "every problem and exit 1 if there is any.")
    sp.add_argument("target", metavar="ROOT|PATH")
    sp.add_argument("--workers", type=int, default=None, help="parallel reads (default: 2 x CPUs, at most 8)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser("gc", parents=[common], help="reclaim leftover staging, retired data, stale files",
                        description="Remove what crashes and retention leave behind (staging of saves that "
                                    "never committed, data of retired checkpoints, stale intents, leases and "
                                    "temp files), printing each item and why. Never touches the log or a "
                                    "committed checkpoint that is not retired. Try --dry-run first.")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--dry-run", "-n", action="store_true", help="list what would be removed; change nothing")
    sp.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                    help="age after which another host's staging, intents and temp files count as abandoned "
                         "(default 3600)")
    sp.add_argument("--keep-last", type=int, default=None, metavar="N",
                    help="retention: keep the N newest checkpoints of the current lineage")
    sp.add_argument("--keep-every", type=int, default=None, metavar="K",
                    help="retention: keep checkpoints whose step is a multiple of K")
    sp.add_argument("--abandoned-ttl", type=float, default=None, metavar="SECONDS",
                    help="retention: let abandoned checkpoints go after SECONDS abandoned (default: keep)")
    sp.add_argument("--keep", action="append", default=None, metavar="TXID|PATH",
                    help="retention: always keep this checkpoint (repeatable)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser("adopt", parents=[common], help="record a legacy output_dir's checkpoint-N dirs as a lineage",
                        description="Record the checkpoint-N directories of a root written without txckpt (a "
                                    "stock Trainer output_dir) as a lineage: hash every file now, write a "
                                    "manifest into each directory, commit them with one log entry.")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_adopt)

    sp = sub.add_parser("export", parents=[common], help="copy a committed checkpoint to a plain directory, verified",
                        description="Copy one committed checkpoint to DEST, a new or empty plain directory "
                                    "(local or fsspec URL), checking every file's checksum on the way.")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("dest", metavar="DEST", help="a new or empty directory, local or fsspec URL")
    sp.add_argument("--step", type=int, default=None, help="step of the current lineage")
    sp.add_argument("--txid", default=None, help="any committed checkpoint, by txid (see `txckpt ls`)")
    sp.add_argument("--dest-storage-option", action="append", default=None, metavar="KEY=VALUE",
                    help="storage option for DEST (default: those of ROOT)")
    sp.add_argument("--no-manifest", action="store_true", help="do not copy txckpt-manifest.json")
    sp.add_argument("--no-sync", action="store_true", help="skip fsync of the exported files")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("resume", parents=[common], help="roll the root back to a committed step (forks a lineage)",
                        description="Roll the root back to committed step N of the current lineage: fork a "
                                    "new lineage from it, which becomes the current one. The checkpoints "
                                    "after N in the current lineage are abandoned: kept intact (see "
                                    "`txckpt log`), never again returned by get_last_checkpoint, and a job "
                                    "still writing the old lineage is refused at its next save "
                                    "(StaleLineageError). Without --step, or at the newest step, nothing "
                                    "changes: it prints where a restart continues.")
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--step", type=int, default=None,
                    help="committed step of the current lineage to continue from (default: the newest)")
    sp.set_defaults(func=cmd_resume)
    return p


def _stdout_gone() -> None:
    """The reader of stdout closed it (``txckpt log ROOT | head``): like git, stop quietly.
    Point stdout at /dev/null so the interpreter's final flush of what is still buffered does
    not fail again ("Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured in-process)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    _configure_logging(args.verbose)
    try:
        args.storage_options = parse_storage_options(args.storage_option)
        for name in ("step", "keep_last", "keep_every", "workers", "max_count"):
            v = getattr(args, name, None)
            if v is not None and v < (0 if name == "step" else 1):
                raise UsageError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'step' else '>= 1'}, not {v}")
        if getattr(args, "grace", 0) is not None and getattr(args, "grace", 0) < 0:
            raise UsageError("--grace must be >= 0")
        rc = int(args.func(args))
        try:
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        except BrokenPipeError:
            _stdout_gone()
        return rc
    except BrokenPipeError:  # the command stopped in the middle of its output
        _stdout_gone()
        return EXIT_OK
    except UsageError as e:
        print(f"txckpt {args.command}: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (InvalidArgumentError, NotATxckptRootError) as e:
        print(f"txckpt {args.command}: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (TxckptError, OSError) as e:  # one line; the traceback only with -v
        if args.verbose:
            traceback.print_exc()
        print(f"txckpt {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
