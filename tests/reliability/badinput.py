"""Campaign 4: bad input.

Every case damages a copy of one base root and then *probes* it in a fresh process the way users
and operators would: lookup (``get_last_checkpoint``), load of what lookup returned, load of every
committed checkpoint, ``txckpt gc``, and a restarted job's resume + save. The base root has two
lineages: A saved 2, 4, 6; a rollback to 2 started B, which saved 4. So B-4 (published as
``checkpoint-4``) is the newest, A-4 and A-6 are abandoned (kept at their homes under
``.txckpt/tx``), and there is a reader lease, a stale intent with its staging, and six log entries.

Verdict, for every probe:

* ``[untyped]``  a call raised something that is not a ``txckpt.errors.TxckptError``;
* ``[silent]``   a load returned content other than what was saved there, or lookup returned a
                 checkpoint other than B-4 without logging a warning (a silent wrong answer);
* ``[deleted]``  a file of a committed checkpoint no longer exists anywhere in the root (gc and
                 publication may move files, never delete committed ones), other than the file the
                 case itself deleted;
* ``[restart]``  the restarted job's save succeeded but lookup does not return it.

A typed error, or a fallback with a warning, passes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from tests.harness.procs import child_value, run_child

from .core import REPO, Case, Ctx, Result, classify, payload
from .invariants import capture_warnings, read_tags
from .roots import Roots


# =================================================================================================
# The base root
# =================================================================================================
def build_base(url: str, so: dict | None) -> dict[str, Any]:
    """A: 2, 4, 6; rollback to 2; B: 4. Plus a reader lease on A-2 and a dead writer's staging."""
    import txckpt
    from txckpt._base.layout import entry_key
    from txckpt._maintenance.leases import acquire_reader_lease
    from txckpt._root.root import CheckpointRoot

    tags = {}
    for s in (2, 4, 6):
        p = txckpt.save_checkpoint(url, s, payload(f"A-{s}", s), storage_options=so)
        tags[txckpt.read_manifest(p, storage_options=so).txid] = f"A-{s}"
    txckpt.resume(url, step=2, storage_options=so)
    p = txckpt.save_checkpoint(url, 4, payload("B-4", 4), storage_options=so)
    tags[txckpt.read_manifest(p, storage_options=so).txid] = "B-4"
    txckpt.forget_roots()
    r = CheckpointRoot(url, so)
    st = r.storage
    hist = r.history()
    by_tag = {tags[t]: c for t, c in hist.checkpoints.items()}
    lease = acquire_reader_lease(r, by_tag["A-2"].txid, seconds=10 * 365 * 86400)
    dead = f"8-{by_tag['B-4'].lineage}-0123456789"
    st.create_exclusive(f".txckpt/tx/{dead}/checkpoint-8/model.safetensors", b"partial", durable=False)
    intent = {
        "txid": dead,
        "step": 8,
        "lineage": by_tag["B-4"].lineage,
        "host": socket.gethostname(),
        "pid": 999999,
        "time": time.time() - 100,
        "world_size": 1,
    }
    st.create_exclusive(f".txckpt/intents/{dead}.json", json.dumps(intent).encode(), durable=False)

    # A history snapshot of the newest entry (protocol §4a; written by retention and gc every
    # 100 entries, here at once): damaged, it must be ignored, never trusted.
    from txckpt._log import log as commit_log

    every, commit_log.SNAPSHOT_EVERY = commit_log.SNAPSHOT_EVERY, 1
    try:
        assert commit_log.write_snapshot_if_due(st, hist, durable=False)
    finally:
        commit_log.SNAPSHOT_EVERY = every

    def key_of(c):
        return r.publication.locate(c.ref)

    entries = {e["seq"]: e for e in hist.entries}
    commit_seq = {e["checkpoint"]["txid"]: e["seq"] for e in hist.entries if e["action"] == "commit"}
    fork_seq = [e["seq"] for e in hist.entries if e["action"] == "fork"][-1]
    targets = {}
    for tag in ("B-4", "A-6"):
        k = key_of(by_tag[tag])
        for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "extra.dat", "txckpt-manifest.json"):
            targets[f"{tag}/{name}"] = f"{k}/{name}"
    targets["log/commit-A-4"] = entry_key(commit_seq[by_tag["A-4"].txid])
    targets["log/fork"] = entry_key(fork_seq)
    targets["log/newest"] = entry_key(max(entries))
    targets["latest"] = ".txckpt/latest"
    targets["intent"] = f".txckpt/intents/{dead}.json"
    targets["lease"] = lease
    targets["snapshot"] = commit_log.snapshot_key(hist.state.seq)
    return {
        "tags": tags,
        "targets": targets,
        "keys": {t: key_of(c) for t, c in by_tag.items()},
        "txids": {t: c.txid for t, c in by_tag.items()},
    }


# =================================================================================================
# Probing a damaged root (in a fresh process)
# =================================================================================================
def content_index(url: str, so: dict | None) -> dict[str, str]:
    """key -> sha1 of every file under the root."""
    from txckpt._storage import open_storage

    from txckpt.errors import SpecialFileError

    st = open_storage(url, so)
    out = {}
    for key, _ in st.walk_files(""):
        try:
            out[key] = hashlib.sha1(st.read_bytes(key)).hexdigest()
        except (FileNotFoundError, IsADirectoryError, OSError, SpecialFileError):
            continue
    return out


def committed_files(url: str, so: dict | None, info: dict[str, Any]) -> dict[str, str]:
    """(key -> sha1) of every file of every committed checkpoint and of the log."""
    idx = content_index(url, so)
    prefixes = [k + "/" for k in info["keys"].values() if k] + [".txckpt/log/"]
    return {k: h for k, h in idx.items() if any(k.startswith(p) for p in prefixes) and not k.endswith(".tmp")}


def probe(
    url: str,
    so: dict | None,
    info: dict[str, Any],
    before: dict[str, str],
    exempt: set[str],
    want: str = "B-4",
    extra: Callable | None = None,
) -> dict[str, Any]:
    import txckpt
    from txckpt.errors import TxckptError
    from txckpt._maintenance.gc import collect_garbage
    from txckpt._root.root import CheckpointRoot

    txckpt.forget_roots()
    warned = capture_warnings()
    v: list[str] = []
    outcomes: dict[str, str] = {}

    def attempt(name: str, fn: Callable) -> Any:
        try:
            out = fn()
            outcomes[name] = "ok"
            return out
        except TxckptError as e:
            outcomes[name] = type(e).__name__
            return e
        except Exception as e:
            outcomes[name] = "untyped " + type(e).__name__
            v.append(f"[untyped] {name} raised {type(e).__name__}: {e}")
            return e

    last = attempt("lookup", lambda: txckpt.get_last_checkpoint(url, storage_options=so))
    if isinstance(last, str):
        tags = attempt("load", lambda: read_tags(last, so))
        if isinstance(tags, set) and tags != {want} and not warned.messages:
            v.append(f"[silent] lookup+load gave {sorted(tags)} (wanted {want}) without a warning")
        if isinstance(tags, set) and len(tags) > 1:
            v.append(f"[silent] the checkpoint lookup returned mixes {sorted(tags)}")
    elif last is None and not warned.messages:
        v.append(f"[silent] lookup returned None (wanted {want}) without a warning")
    # Every committed checkpoint, loaded where the root says it is.
    rr = attempt("history", lambda: CheckpointRoot(url, so).checkpoints("all"))
    if isinstance(rr, list):
        # The history a fresh process reads (from a snapshot when one is usable) is the log's.
        from txckpt._log import log as commit_log

        from txckpt.cli import run_verify
        from txckpt.errors import TxckptError

        st = CheckpointRoot(url, so).storage
        quick = commit_log.read_history(st)
        try:
            full = commit_log.read_history(st, snapshots=False)
        except TxckptError:
            # An old entry is damaged under a snapshot that folded it while it was intact: the
            # answers stand, and the audit must report the damage.
            if run_verify(url, so)["ok"]:
                v.append("[silent] `txckpt verify` passes a root whose log has a damaged entry")
        else:
            if not quick.folds_like(full):
                v.append(f"[silent] the history read from snapshot {quick.base_seq} differs from the log's")
        digests = {t: c.digest for t, c in CheckpointRoot(url, so).history().checkpoints.items()}
        for c in rr:
            if c.path is None:
                continue
            tags = attempt(f"load {c.step}", lambda c=c: read_tags(c.path, so))
            expected = info["tags"].get(c.txid)
            if isinstance(tags, set) and expected and tags != {expected}:
                v.append(f"[silent] loading committed {expected} ({c.txid}) at {c.path} gave {sorted(tags)}")
            if isinstance(tags, set):
                try:
                    m = txckpt.read_manifest(c.path, storage_options=so)
                except Exception:
                    continue
                if m.digest != digests.get(c.txid) and len(m.files) != c.files:
                    v.append(
                        f"[silent] {expected or c.txid} loads without a warning from a manifest listing "
                        f"{len(m.files)} files, while its commit entry recorded {c.files} files and another "
                        "manifest digest"
                    )
    if extra is not None:
        v += extra(url, so, attempt)
    attempt("gc", lambda: collect_garbage(CheckpointRoot(url, so)))

    def restart():
        txckpt.forget_roots()
        r = CheckpointRoot(url, so)
        r.resume()
        path = r.save(50, payload("R-50", 50))
        txckpt.forget_roots()
        if txckpt.get_last_checkpoint(url, storage_options=so) != path:
            v.append("[restart] the restarted job's save is not what lookup returns")
        return path

    attempt("restart", restart)
    # Nothing committed deleted: every file (by content) is still somewhere under the root.
    after = set(content_index(url, so).values())
    for key, h in before.items():
        if key in exempt:
            continue
        if h not in after:
            v.append(f"[deleted] the committed file {key} is gone")
    return {"violations": v, "outcomes": outcomes, "warned": bool(warned.messages)}


# =================================================================================================
# Damage on a copy of the base root
# =================================================================================================
class Damage:
    """Read, write and delete keys of one root copy, bypassing txckpt (a user's hands, a bad disk)."""

    def __init__(self, roots: Roots, url: str):
        self.roots = roots
        self.url = url

    def _path(self, key: str) -> str:
        return os.path.join(self.url, *key.split("/"))

    def _obj(self, key: str) -> str:
        return self.roots.s3_prefix_of(self.url) + "/" + key

    def read(self, key: str) -> bytes:
        if self.roots.backend == "local":
            with open(self._path(key), "rb") as f:
                return f.read()
        return self.roots.client.get_object(Bucket=self.roots.bucket, Key=self._obj(key))["Body"].read()

    def write(self, key: str, data: bytes) -> None:
        if self.roots.backend == "local":
            with open(self._path(key), "wb") as f:
                f.write(data)
        else:
            self.roots.client.put_object(Bucket=self.roots.bucket, Key=self._obj(key), Body=data)

    def delete(self, key: str) -> None:
        if self.roots.backend == "local":
            os.unlink(self._path(key))
        else:
            self.roots.client.delete_object(Bucket=self.roots.bucket, Key=self._obj(key))


def flip_positions(n: int, quick: bool, data: bytes, seed: int, every: int = 1) -> list[int]:
    """Byte positions to flip: all (full mode, or every ``every``-th), or a sample that favours
    digits and hex characters (they turn into other valid digits) in quick mode."""
    if not quick:
        return list(range(0, n, every))
    rnd = random.Random(seed)
    interesting = [i for i, b in enumerate(data) if chr(b) in "0123456789abcdef"]
    pos = {0, n // 2, n - 1}
    pos |= set(rnd.sample(interesting, min(12, len(interesting))))
    pos |= set(rnd.sample(range(n), min(6, n)))
    return sorted(pos)


class Campaign:
    """One base root per case; a fresh copy per probe."""

    def __init__(self, ctx: Ctx, backend: str, case: Case, result: Result):
        self.ctx, self.backend, self.case, self.result = ctx, backend, case, result
        self.roots = Roots(backend, ctx, "base")
        self.turl, self.tso = self.roots.template()
        turl, tso = self.turl, self.tso

        def build():
            info = build_base(turl, tso)
            info["before"] = committed_files(turl, tso, info)
            return {"info": info, "frozen": self.roots.freeze_in_child()}

        b = child_value(build, "building the bad-input base root")
        self.roots.set_frozen(b["frozen"])
        self.info = b["info"]
        self.found: list[str] = []
        self.n = 0
        self.outcomes: dict[str, int] = {}

    def run(
        self,
        label: str,
        damage: Callable[[Damage], set[str]],
        want: str = "B-4",
        extra: Callable | None = None,
        prepare: Callable | None = None,
    ) -> dict | None:
        """Copy the base root, apply ``damage`` (returns keys whose content it changed or removed),
        probe it in a fresh process."""
        self.n += 1
        point = f"p{self.n}"
        url, so = self.roots.fresh(point)
        d = Damage(self.roots, url)
        exempt = damage(d) or set()
        info = self.info

        def child():
            self.roots.enter_child(url)
            if prepare is not None:
                prepare(url, so)
            return probe(url, so, info, info["before"], exempt, want, extra)

        code, out = run_child(child, timeout=300)
        self.roots.discard(url, point)
        if code != 0 or not out or "ok" not in out:
            self.found.append(f"{label}: [harness] the probe failed: {out and out.get('error')}")
            return None
        res = out["ok"]
        self.found += [f"{label}: {x}" for x in res["violations"]]
        key = ",".join(f"{k}={v}" for k, v in sorted(res["outcomes"].items()) if not k.startswith("load "))
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        return res

    def finish(self, note: str = "") -> None:
        self.result.tried += self.n
        self.result.points += self.n
        self.result.unit = "probes"
        if note:
            self.result.notes.append(note)
        classify(self.result, self.found, self.case.known)


# =================================================================================================
# Cases
# =================================================================================================
def _flip(key: str, pos: int) -> Callable[[Damage], set[str]]:
    def f(d: Damage) -> set[str]:
        b = bytearray(d.read(key))
        b[pos] ^= 0x01
        d.write(key, bytes(b))
        return {key}

    return f


def _truncate(key: str, how: str) -> Callable[[Damage], set[str]]:
    def f(d: Damage) -> set[str]:
        b = d.read(key)
        n = {"half": len(b) // 2, "zero": 0, "minus1": len(b) - 1}[how]
        d.write(key, b[:n])
        return {key}

    return f


def _delete(key: str) -> Callable[[Damage], set[str]]:
    def f(d: Damage) -> set[str]:
        d.delete(key)
        return {key}

    return f


def _fifo(key: str) -> Callable[[Damage], set[str]]:
    """Replace the file with a FIFO (local roots): a reader that opens it blocking hangs forever,
    which the probe's timeout turns into a harness failure."""

    def f(d: Damage) -> set[str]:
        d.delete(key)
        os.mkfifo(d._path(key))
        return {key}

    return f


def file_damage(ctx: Ctx, case: Case, result: Result) -> None:
    """Flip, truncate, delete: each file kind of the newest checkpoint (and of an abandoned one),
    the manifest, three log entries, the latest hint, an intent and a lease."""
    c = Campaign(ctx, case.backend, case, result)
    t = c.info["targets"]
    which = case.params["targets"]
    small = ctx.quick and case.backend == "s3"  # ~2 s a probe on S3: a smaller sample in quick mode
    if not case.params.get("snapshot", True):
        # As a root of fewer than 100 log entries is: no history snapshot, so every fold reads
        # every entry. (With one, damage to the entries it covers is for the audit to find.)
        original = c.run

        def run_without_snapshot(label, damage, *a, **kw):
            def both(d: Damage) -> set[str]:
                d.delete(t["snapshot"])
                return damage(d) | {t["snapshot"]}

            return original(label, both, *a, **kw)

        c.run = run_without_snapshot  # type: ignore[method-assign]
    if small:
        which = which[:2] if len(which) > 3 else which
    for name in which:
        key = t[name]
        data = _read_template(c, key)
        is_json = name.startswith("log/") or name.endswith(".json") or name in ("latest", "intent", "lease", "snapshot")
        every = case.params.get("every", {}).get(name, 1)
        # Full mode on a local root: every byte of the riskiest JSON files (an abandoned checkpoint's
        # commit entry, the newest manifest, the hint, intent and lease), every 3rd byte of the others;
        # a sample on S3 (~2 s a probe).
        sample = ctx.quick or case.backend == "s3"
        positions = (
            flip_positions(len(data), sample, data, ctx.seed + len(name), every)
            if is_json
            else sorted({0, len(data) // 2, len(data) - 1})
        )
        if small:
            positions = positions[:4] if is_json else positions[1:2]
        elif case.backend == "s3" and is_json:
            positions = sorted(random.Random(ctx.seed).sample(positions, min(8, len(positions))))
        for pos in positions:
            c.run(f"{name}: flip byte {pos}/{len(data)}", _flip(key, pos))
        for how in ("half",) if small else ("half", "zero", "minus1"):
            if len(data) > 1 or how == "zero":
                c.run(f"{name}: truncate ({how})", _truncate(key, how))
        c.run(f"{name}: delete", _delete(key))
        if case.backend == "local":
            c.run(f"{name}: replaced by a FIFO", _fifo(key))
    c.finish("outcomes: " + "; ".join(f"{n}x [{k}]" for k, n in sorted(c.outcomes.items(), key=lambda x: -x[1])[:6]))


def _read_template(c: Campaign, key: str) -> bytes:
    if c.backend == "local":
        with open(os.path.join(c.turl, *key.split("/")), "rb") as f:
            return f.read()
    if c.backend == "s3":
        return c.roots.client.get_object(Bucket=c.roots.bucket, Key=c.roots.s3_prefix_of(c.turl) + "/" + key)[
            "Body"
        ].read()
    raise ValueError(c.backend)


def hostile_manifests(ctx: Ctx, case: Case, result: Result) -> None:
    """Manifests that verify (a forged digest) but name unsafe paths; a manifest from another root;
    symlinks out of the root."""
    from txckpt._base import checksum
    from txckpt._manifest.manifest import FileEntry, _digest

    c = Campaign(ctx, case.backend, case, result)
    t = c.info["targets"]
    mkey = t["B-4/txckpt-manifest.json"]
    outside = os.path.join(ctx.workdir, "outside")
    os.makedirs(outside, exist_ok=True)
    secret = os.path.join(outside, "secret.bin")
    with open(secret, "wb") as f:
        f.write(b"x")

    def forge(names: list[str], content: bytes = b"x"):
        def f(d: Damage) -> set[str]:
            body = json.loads(d.read(mkey))
            body.pop("digest", None)
            for n in names:
                body["files"][n] = FileEntry(len(content), checksum.digest_bytes(content), "bytes").to_json()
            body["digest"] = _digest(body)
            d.write(mkey, json.dumps(body).encode())
            return {mkey}

        return f

    for name in ["../x", "../../outside/secret.bin", "/etc/passwd", secret, "a/../../x", "..", "./a", "a//b", "a\\b"]:
        c.run(f"manifest names {name!r}", forge([name]))

    def edit(change, redigest: bool):
        def f(d: Damage) -> set[str]:
            body = json.loads(d.read(mkey))
            body.pop("digest")
            change(body)
            body["digest"] = _digest(body) if redigest else json.loads(d.read(mkey))["digest"]
            d.write(mkey, json.dumps(body).encode())
            return {mkey}

        return f

    def bump_size(b):
        b["files"]["model.safetensors"]["size"] += 1

    def swap_checksums(b):
        f = b["files"]
        f["optimizer.pt"]["xxh3_128"], f["extra.dat"]["xxh3_128"] = (
            f["extra.dat"]["xxh3_128"],
            f["optimizer.pt"]["xxh3_128"],
        )

    def drop_file(b):
        del b["files"]["extra.dat"]

    c.run("manifest edited (a size changed), digest left as it was", edit(bump_size, False))
    c.run("manifest edited (two checksums swapped), digest recomputed", edit(swap_checksums, True))
    c.run("manifest edited (a file removed from it), digest recomputed", edit(drop_file, True))
    # A manifest copied from another root (same step, digest valid, other txid).
    other_url = (
        os.path.join(ctx.workdir, "other", "root") if c.backend == "local" else c.turl.replace("/template/", "/other/")
    )
    tso = c.tso

    def other_manifest():
        import txckpt

        p = txckpt.save_checkpoint(other_url, 4, payload("B-4", 4), storage_options=tso)
        from txckpt._storage import open_storage

        return base64.b64encode(open_storage(p, tso).read_bytes("txckpt-manifest.json")).decode()

    foreign = base64.b64decode(child_value(other_manifest, "another root"))

    def copy_other(d: Damage) -> set[str]:
        d.write(mkey, foreign)
        return {mkey}

    c.run("the newest checkpoint's manifest replaced by one from another root (same files)", copy_other)
    if c.backend == "local":
        data_key = t["B-4/model.safetensors"]

        def symlink_file(d: Damage) -> set[str]:
            p = d._path(data_key)
            shutil.copy(p, os.path.join(outside, "model.safetensors"))
            os.unlink(p)
            os.symlink(os.path.join(outside, "model.safetensors"), p)
            return {data_key}

        c.run("a data file replaced by a symlink out of the root (same bytes)", symlink_file)

        def symlink_dir(d: Damage) -> set[str]:
            p = d._path(c.info["keys"]["A-2"])
            target = os.path.join(outside, "ckpt2")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(p, target)
            shutil.rmtree(p)
            os.symlink(target, p)
            return {k for k in c.info["before"] if k.startswith(c.info["keys"]["A-2"] + "/")}

        c.run("checkpoint-2 replaced by a symlink to a copy out of the root", symlink_dir)

        def symlink_staging(d: Damage) -> set[str]:
            victim = os.path.join(outside, "victim")
            os.makedirs(victim, exist_ok=True)
            with open(os.path.join(victim, "keep.bin"), "wb") as f:
                f.write(b"precious")
            os.symlink(victim, d._path(".txckpt/tx/9-deadbeef-0000000000"))
            return set()

        def victim_intact(url, so, attempt):
            return []

        c.run("a symlink out of the root under .txckpt/tx (gc must not follow it)", symlink_staging)
        if not os.path.exists(os.path.join(outside, "victim", "keep.bin")):
            c.found.append("[deleted] gc followed a symlink out of the root and deleted what it points to")
        if not os.path.exists(secret):
            c.found.append("[deleted] a file outside the root was deleted")
    c.finish("outcomes: " + "; ".join(f"{n}x [{k}]" for k, n in sorted(c.outcomes.items(), key=lambda x: -x[1])[:5]))


def by_hand(ctx: Ctx, case: Case, result: Result) -> None:
    """Operators' hands: checkpoint directories deleted or renamed, the head edited to a lineage
    that does not exist, a legacy checkpoint-N among txckpt's."""
    from .core import write_legacy

    c = Campaign(ctx, case.backend, case, result)
    keys = c.info["keys"]
    local = c.backend == "local"

    def rm_tree(key):
        def f(d: Damage) -> set[str]:
            if local:
                shutil.rmtree(d._path(key))
            else:
                from . import s3

                pre = d._obj(key) + "/"
                for k in s3.keys(c.roots.client, c.roots.bucket, pre):
                    c.roots.client.delete_object(Bucket=c.roots.bucket, Key=k)
            return {k for k in c.info["before"] if k.startswith(key + "/")}

        return f

    c.run("the newest checkpoint's directory deleted by hand", rm_tree(keys["B-4"]), want="A-2")
    c.run("an abandoned checkpoint's directory deleted by hand", rm_tree(keys["A-6"]))
    c.run("the fork point (checkpoint-2) deleted by hand", rm_tree(keys["A-2"]))
    if local:

        def rename(src, dst):
            def f(d: Damage) -> set[str]:
                os.rename(d._path(src), d._path(dst))
                return set()

            return f

        c.run("checkpoint-4 renamed to checkpoint-4.bak by hand", rename(keys["B-4"], "checkpoint-4.bak"), want="A-2")
        c.run("checkpoint-4 renamed to checkpoint-5 by hand", rename(keys["B-4"], "checkpoint-5"), want="A-2")
        c.run(
            "checkpoint-2 and checkpoint-4 swapped by hand",
            lambda d: (
                os.rename(d._path("checkpoint-2"), d._path("x")),
                os.rename(d._path("checkpoint-4"), d._path("checkpoint-2")),
                os.rename(d._path("x"), d._path("checkpoint-4")),
                set(),
            )[-1],
            want="A-2",
        )

    def edit_head(d: Damage) -> set[str]:
        key = c.info["targets"]["log/newest"]
        body = json.loads(d.read(key))
        body["head"]["id"] = "0badc0de"
        d.write(key, json.dumps(body).encode())
        return {key}

    c.run("the newest log entry's head edited to a lineage that does not exist", edit_head)

    def edit_head_tip(d: Damage) -> set[str]:
        key = c.info["targets"]["log/newest"]
        body = json.loads(d.read(key))
        body["head"]["tip"]["lineage"] = "0badc0de"
        d.write(key, json.dumps(body).encode())
        return {key}

    c.run("the head's tip edited to name a lineage that does not exist", edit_head_tip)

    def add_legacy(step):
        def f(d: Damage) -> set[str]:
            from txckpt._storage import open_storage

            write_legacy(
                open_storage(c.roots.template()[0] if False else d.url, c.tso), f"checkpoint-{step}", f"L-{step}", step
            )
            return set()

        return f

    res10 = c.run("a stock Trainer's checkpoint-10 (no manifest) among txckpt's", add_legacy(10))
    c.run("a stock Trainer's checkpoint-3 (no manifest) among txckpt's", add_legacy(3))
    note = ""
    if res10 is not None:
        note = "lookup with a newer legacy checkpoint-10 present: " + (
            "warns"
            if res10["warned"]
            else "returns B-4 without a warning (checkpoint-10 is not a txckpt "
            "checkpoint; the restart's save of 50 is unaffected)"
        )
    c.finish(note)


def clock(ctx: Ctx, case: Case, result: Result) -> None:
    """A writer whose clock goes backwards (time.time monkeypatched in the writer)."""
    from .actors import Actor, op_gc, op_lookup, op_retention, op_save

    root = os.path.join(ctx.workdir, "clock", "root")
    found: list[str] = []
    # (a) Between saves, the writer's clock steps back a day each time; rotation and gc run.
    with Actor("writer") as w:
        w.value(_set_clock_offset, 0)
        for i, s in enumerate((1, 2, 3, 4, 5, 6)):
            w.value(_set_clock_offset, -86400.0 * i)
            w.value(op_save, root, s, f"W-{s}")
            w.value(op_retention, root, 3)
        last = w.value(op_lookup, root)
    tags = child_value(lambda: sorted(read_tags(last, None)), "tags")
    if tags != ["W-6"]:
        found.append(f"[clock] with the writer's clock going backwards, lookup returns {tags}, not W-6")
    gone = child_value(
        lambda: [c.step for c in __import__("txckpt").CheckpointRoot(root).checkpoints("all") if c.state != "retired"],
        "list",
    )
    if sorted(gone) != [4, 5, 6]:
        found.append(f"[clock] keep_last=3 under a backwards clock kept steps {sorted(gone)}, not [4, 5, 6]")
    child_value(
        lambda: [
            [i.kind, i.key]
            for i in __import__("txckpt._maintenance.gc", fromlist=["x"])
            .collect_garbage(__import__("txckpt").CheckpointRoot(root))
            .items
            if i.kind not in ("retired",)
        ],
        "gc",
    )
    # (b) The writer's clock is an hour behind while gc runs beside its save.
    root2 = os.path.join(ctx.workdir, "clock2", "root")
    with Actor("writer") as w, Actor("gc") as g2:
        w.value(op_save, root2, 1, "W-1")
        w.value(_set_clock_offset, -3600.0)
        w.pause("txckpt._save.transactions:append_commit")
        w.send(op_save, root2, 2, "W-2")
        assert w.wait()[0] == "paused"
        items = g2.value(op_gc, root2)
        staged = [k for kind, k in items if kind == "staging"]
        if staged:
            found.append(f"[clock] gc removed the staging of a live writer whose clock is an hour behind: {staged}")
        w.go()
        out = w.wait()
    if out[0] == "ok":
        path = out[1]
        code, v = run_child(lambda: __import__("txckpt").verify_checkpoint(path) and "ok", timeout=60)
        if code != 0:
            found.append(
                f"[clock] the writer's save returned {path}, committed, but it does not verify: {v and v.get('error')}"
            )
    elif out[1] not in ("TransactionAbortedError", "StorageError", "IntegrityError"):
        found.append(f"[clock] the writer's save failed with {out[1]}: {out[2]}")
    result.tried, result.points, result.unit = 2, 7, "probes"
    classify(result, found, case.known)


def _set_clock_offset(state: dict, offset: float) -> None:
    import time as _time

    real = state.setdefault("real_time", _time.time)
    _time.time = (lambda: real() + offset) if offset else real


def enospc(ctx: Ctx, case: Case, result: Result) -> None:
    """ENOSPC at each injectable file operation of a save / first save / fork (injectors.py,
    ``enospc`` mode: the operation fails with OSError(ENOSPC) instead of running). Expected: a
    StorageError (or, past the commit point, the committed path), nothing committed lost, the
    previous checkpoint still the newest, and, once space is back, a restart saves and gc cleans."""
    from .crash import sweep_enospc

    for name in case.params["scenarios"]:
        sweep_enospc(ctx, result, name, case.known)


def readonly(ctx: Ctx, case: Case, result: Result) -> None:
    """A read-only root: a real read-only bind mount in a private mount namespace (``unshare
    -rm``) when the machine allows it, else EROFS simulated at every mutating file operation."""
    base = os.path.join(ctx.workdir, "ro", "root")
    child_value(lambda: build_base(base, None), "base")
    code = (
        r"""
import json, os, sys, hashlib, logging
logging.getLogger("txckpt").addHandler(logging.NullHandler()); logging.getLogger("txckpt").propagate = False
root = sys.argv[1]
sys.path.insert(0, %r)
import txckpt
from txckpt.errors import TxckptError, StorageError
from txckpt._root.root import CheckpointRoot
out = {}
def attempt(name, fn):
    try:
        r = fn(); out[name] = "ok"; return r
    except TxckptError as e:
        out[name] = type(e).__name__ + ": " + str(e)[:200]
    except Exception as e:
        out[name] = "UNTYPED " + type(e).__name__ + ": " + str(e)[:200]
p = attempt("lookup", lambda: txckpt.get_last_checkpoint(root))
attempt("load", lambda: sorted(txckpt.load_checkpoint(p)))
attempt("list", lambda: [c.step for c in CheckpointRoot(root).checkpoints("all")])
attempt("save", lambda: txckpt.save_checkpoint(root, 8, {"a.dat": b"x"}))
txckpt.forget_roots()
attempt("resume(step=2)", lambda: txckpt.resume(root, step=2))
txckpt.forget_roots()
from txckpt._maintenance.gc import collect_garbage
def gc():
    rep = collect_garbage(CheckpointRoot(root))
    out["gc errors reported"] = str(len(rep.errors))
attempt("gc", gc)
from txckpt._maintenance.retention import RetentionPolicy, apply_retention
attempt("retention", lambda: apply_retention(CheckpointRoot(root), RetentionPolicy(keep_last=1)))
print(json.dumps(out))
"""
        % REPO
    )
    before = _tree_hash(base)
    how = "a read-only bind mount (unshare -rm)"
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "$2" -c "$3" "$1"',
        "sh",
        base,
        sys.executable,
        code,
    ]
    proc = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is None or proc.returncode != 0 or not proc.stdout.strip():
        how = "EROFS simulated at every mutating file operation (no mount namespace here)"
        proc = subprocess.run(
            [sys.executable, "-c", _SIMULATED_RO + code, base], capture_output=True, text=True, timeout=300, env=env
        )
    found: list[str] = []
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        found.append(f"[harness] the read-only probe failed: {proc.stderr[-1500:]}")
        out = {}
    for name in ("lookup", "load", "list"):
        if out.get(name) != "ok":
            found.append(f"[readonly] {name} on a read-only root failed: {out.get(name)} (reading must not write)")
    for name in ("save", "resume(step=2)", "retention", "gc"):
        o = out.get(name, "")
        if o.startswith("UNTYPED"):
            found.append(f"[untyped] {name} on a read-only root: {o}")
        elif name in ("save", "resume(step=2)") and not o.startswith("StorageError"):
            found.append(f"[readonly] {name} on a read-only root: expected StorageError, got {o}")
    if _tree_hash(base) != before:
        found.append("[readonly] the read-only root changed")
    result.tried, result.points, result.unit = 7, 7, "probes"
    result.notes.append(f"{how}; outcomes: " + "; ".join(f"{k}: {v[:90]}" for k, v in out.items()))
    classify(result, found, case.known)


_SIMULATED_RO = r"""
import builtins, errno, os as _os
def _ro(*a, **k):
    raise OSError(errno.EROFS, "Read-only file system (simulated)")
_real_open = builtins.open
def _open(file, mode="r", *a, **k):
    if set(mode) & set("wax+"):
        _ro()
    return _real_open(file, mode, *a, **k)
builtins.open = _open
for _n in ("mkdir", "makedirs", "link", "rename", "replace", "unlink", "remove", "rmdir", "symlink"):
    setattr(_os, _n, _ro)
import txckpt._storage.local.store as _l
_l.rename_noreplace = _ro
"""


def _tree_hash(root: str) -> str:
    h = hashlib.sha1()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            h.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as fh:
                h.update(hashlib.sha1(fh.read()).digest())
    return h.hexdigest()


DATA = [
    "B-4/model.safetensors",
    "B-4/optimizer.pt",
    "B-4/trainer_state.json",
    "B-4/extra.dat",
    "A-6/model.safetensors",
    "A-6/optimizer.pt",
]
META = ["B-4/txckpt-manifest.json", "A-6/txckpt-manifest.json", "latest", "intent", "lease", "snapshot"]
LOG = ["log/commit-A-4", "log/fork", "log/newest"]


def cases() -> list[Case]:
    out = []
    for backend in ("local", "s3"):
        s3 = backend == "s3"
        out += [
            Case(
                f"badinput/{backend}/data-files",
                "badinput",
                "flipped byte, truncation, deletion (local: also a FIFO in its place) of each data file kind "
                "(safetensors, torch, json, bytes)",
                backend,
                file_damage,
                cost=40 if s3 else 8,
                needs_s3=s3,
                params={"targets": DATA},
            ),
            Case(
                f"badinput/{backend}/manifest-hint-intent-lease",
                "badinput",
                "flipped bytes (every byte in full mode, every 3rd of the abandoned manifest and the history "
                "snapshot), truncation, deletion: manifests, latest hint, intent, reader lease, history snapshot",
                backend,
                file_damage,
                cost=40 if s3 else 10,
                needs_s3=s3,
                params={"targets": META, "every": {"A-6/txckpt-manifest.json": 3, "snapshot": 3}},
            ),
            Case(
                f"badinput/{backend}/log-entries",
                "badinput",
                "flipped bytes (full mode: every byte of the first, every 3rd of the others), truncation, deletion: a commit entry of an abandoned "
                "checkpoint, the fork entry, the newest entry (no history snapshot)",
                backend,
                file_damage,
                cost=40 if s3 else 10,
                needs_s3=s3,
                params={"targets": LOG, "every": {"log/fork": 3, "log/newest": 3}, "snapshot": False},
                known=(),
            ),
            Case(
                f"badinput/{backend}/log-entries-under-snapshot",
                "badinput",
                "flipped bytes (full mode: every 5th), truncation, deletion of the same older entries with a history "
                "snapshot of the newest entry present: lookups keep working, `txckpt verify` must report the damage",
                backend,
                file_damage,
                cost=30 if s3 else 6,
                needs_s3=s3,
                params={"targets": LOG[:2], "every": {"log/commit-A-4": 5, "log/fork": 5}},
            ),
            Case(
                f"badinput/{backend}/hostile-manifests",
                "badinput",
                "manifests with ../, absolute, empty or backslash names (digest forged), from another root; "
                "symlinks out of the root"
                if not s3
                else "manifests with ../, absolute, empty or backslash names (digest forged), from another root",
                backend,
                hostile_manifests,
                cost=25 if s3 else 4,
                needs_s3=s3,
            ),
            Case(
                f"badinput/{backend}/by-hand",
                "badinput",
                "checkpoint directories deleted or renamed by hand, head edited to a missing lineage, legacy "
                "checkpoint-N among txckpt's",
                backend,
                by_hand,
                cost=20 if s3 else 4,
                needs_s3=s3,
            ),
        ]
    out += [
        Case(
            "badinput/local/clock",
            "badinput",
            "the writer's clock goes backwards (between saves; an hour behind while gc runs beside its save)",
            "local",
            clock,
            cost=3,
        ),
        Case(
            "badinput/local/enospc",
            "badinput",
            "ENOSPC at each file operation of a save, a first save and a fork + save",
            "local",
            enospc,
            cost=20,
            params={"scenarios": ["save", "first", "fork"]},
        ),
        Case(
            "badinput/local/readonly",
            "badinput",
            "a read-only root: lookup, load, save, fork, gc, retention",
            "local",
            readonly,
            known=(),
            cost=6,
        ),
    ]
    return out
