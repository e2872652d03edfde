"""The invariants of docs/protocol.md section 12, checked on a root in a fresh process.

:func:`snapshot` records a root before an operation; :func:`check` looks at the root after the
operation crashed (or finished) and returns violations, each starting with a tag:

``[log]``     the log cannot be read (it must always be readable after a crash)
``[lookup]``  lookup returned something it must not (invariant 1): not one of the checkpoints a
              crash at this point may leave, an uncommitted or retired one, or one outside the
              head's view
``[load]``    the checkpoint lookup returned does not load and verify (invariant 2)
``[mix]``     a checkpoint holds files of two saves (invariant 3)
``[kept]``    a committed checkpoint the operation had to keep is gone (invariants 4, 5)
``[changed]`` a committed checkpoint's manifest or bytes changed in place (invariant 4)
``[visible]`` a committed checkpoint that can be located does not verify (half deleted, half
              written)
``[retire]``  a checkpoint was retired that the retention policy keeps (invariant 5)
``[public]``  a ``checkpoint-N`` name holds something txckpt never publishes
``[legacy]``  a file of a legacy checkpoint changed
``[restart]`` a restarted job cannot resume and save, or lookup does not return its save
``[gc]``      gc failed, or removed something it must keep
``[leak]``    gc left staging, intents, temp files or retired data behind
``[publish]`` after gc, a name is not where the log says it belongs
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from .core import payload, tags_of_loaded, tags_of_raw


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def capture_warnings() -> _Warnings:
    h = _Warnings()
    logging.getLogger("txckpt").addHandler(h)
    return h


def snapshot(url: str, so: dict | None) -> dict[str, Any]:
    """txid -> {digest, step, lineage, retired, current} of every committed checkpoint, and the
    head's tip."""
    import txckpt
    from txckpt._root.root import CheckpointRoot

    txckpt.forget_roots()
    r = CheckpointRoot(url, so)
    hist = r.history()
    current = {c.txid for c in hist.in_view(None)}
    out = {}
    for txid, c in hist.checkpoints.items():
        key = r.publication.locate(c.ref)
        digest = None
        if key is not None:
            digest = txckpt.read_manifest(r.storage.full_path(key), storage_options=so).digest
        out[txid] = {
            "digest": digest,
            "step": c.step,
            "lineage": c.lineage,
            "retired": txid in hist.retired,
            "current": txid in current,
            "present": key is not None,
        }
    tip = hist.state.head_tip
    return {"checkpoints": out, "tip": tip and tip.txid, "seq": hist.state.seq}


def read_tags(path: str, so: dict | None, tagger: str = "payload") -> set[str]:
    """The tags of the checkpoint at ``path``, loading (and so verifying) it."""
    import txckpt
    from txckpt.errors import ManifestError
    from txckpt._storage import open_storage

    if tagger == "trainer":
        return trainer_tags(path, so)
    try:
        data = txckpt.load_checkpoint(path, storage_options=so)
    except ManifestError as e:
        if "no txckpt-manifest.json" not in str(e):
            raise
        storage = open_storage(path, so)
        return tags_of_raw(storage.read_bytes)
    return tags_of_loaded(data)


def trainer_tags(path: str, so: dict | None) -> set[str]:
    """A Trainer checkpoint's tags: the step its trainer_state.json names, the step the model's
    bias was set to before the save (the parent sets bias = step), the manifest's step."""
    import txckpt

    txckpt.verify_checkpoint(path, storage_options=so)  # every file's size and checksum
    # (training_args.bin is a pickle that weights_only=True refuses: load only what carries a tag)
    data = txckpt.load_checkpoint(path, files=["model.safetensors", "trainer_state.json"], storage_options=so)
    tags = {f"T{int(data['trainer_state.json']['global_step'])}"}
    bias = data["model.safetensors"]["fc.bias"]
    tags.add(f"T{int(round(float(bias.reshape(-1)[0])))}")
    tags.add(f"T{txckpt.read_manifest(path, storage_options=so).step}")
    return tags


def check(url: str, so: dict | None, expect: dict[str, Any]) -> list[str]:
    """Every invariant, then (``restart``) a restarted job's resume and save, then (``gc``) gc and
    the leak check. Runs in a fresh process (the caller forks)."""
    import txckpt
    from txckpt._root.root import CheckpointRoot

    v: list[str] = []
    tagger = expect.get("tagger", "payload")
    txckpt.forget_roots()
    warned = capture_warnings()
    r = CheckpointRoot(url, so)
    try:
        hist = r.history()
    except Exception as e:
        return [f"[log] reading the log failed: {type(e).__name__}: {e}"]
    current = {c.txid for c in hist.in_view(None)}
    before = (expect.get("before") or {}).get("checkpoints", {})
    may_retire = set(expect.get("may_retire") or [])

    # 1. Lookup, load, mix.
    allowed = expect["allowed"]
    try:
        last = txckpt.get_last_checkpoint(url, storage_options=so)
    except txckpt.errors.RootNotFoundError as e:
        # transformers' contract: a root that does not exist is FileNotFoundError, not "no
        # checkpoint". Right only where nothing was ever committed (a crash before the first
        # save created the directory); anywhere else it hides committed checkpoints.
        if hist.checkpoints:
            v.append(f"[lookup] RootNotFoundError although {len(hist.checkpoints)} checkpoint(s) are committed: {e}")
            last = "<error>"
        else:
            last = None
    except Exception as e:
        v.append(f"[lookup] get_last_checkpoint raised {type(e).__name__}: {e}")
        last = "<error>"
    if last is None:
        if None not in allowed:
            v.append(f"[lookup] lookup returned None; allowed: {allowed}")
    elif last != "<error>":
        try:
            tags = read_tags(last, so, tagger)
        except Exception as e:
            v.append(f"[load] the checkpoint lookup returned ({last}) does not load: {type(e).__name__}: {e}")
        else:
            if len(tags) != 1:
                v.append(f"[mix] {last} mixes files of {sorted(tags)}")
            elif next(iter(tags)) not in allowed:
                v.append(f"[lookup] lookup returned {last} ({next(iter(tags))}); allowed: {allowed}")
        if hist.state.seq >= 0:
            try:
                m = txckpt.read_manifest(last, storage_options=so)
            except Exception as e:
                v.append(f"[lookup] {last} has no readable manifest although the root has a log: {e}")
            else:
                if m.txid not in hist.checkpoints:
                    v.append(f"[lookup] lookup returned {last}, whose txid {m.txid} is not committed")
                elif m.txid in hist.retired:
                    v.append(f"[lookup] lookup returned retired {m.txid}")
                elif m.txid not in current:
                    v.append(f"[lookup] lookup returned {m.txid}, which is not in the head's view")
                elif (
                    hist.state.head_tip
                    and m.txid != hist.state.head_tip.txid
                    and not any("missing" in w for w in warned.messages)
                ):
                    v.append(f"[lookup] lookup returned {m.txid}, not the head's tip, without a warning")

    # 2. Committed checkpoints of the pre-state: present, unchanged; retired only if allowed.
    v += _check_kept(r, hist, before, may_retire, so, "")

    # 3. Every committed checkpoint that can be located verifies (retired ones too: a half-deleted
    #    checkpoint must never be locatable).
    for c in hist.checkpoints.values():
        key = r.publication.locate(c.ref)
        if key is None:
            if c.txid not in before and c.txid not in hist.retired:
                v.append(f"[kept] checkpoint {c.txid} (step {c.step}) is committed but its data is missing")
            continue
        try:
            m = txckpt.verify_checkpoint(r.storage.full_path(key), storage_options=so)
            if m.digest != c.digest:
                v.append(f"[changed] {c.txid}: its manifest's digest differs from the commit entry's")
        except Exception as e:
            v.append(f"[visible] committed {c.txid} at {key} does not verify: {type(e).__name__}: {e}")

    # 4. Public names (rename backends).
    if r.storage.atomic_dir_rename and hist.state.seq >= 0:
        from txckpt._log.publication import manifest_txid

        allowed_foreign = set(expect.get("foreign_names") or [])
        for name in r.storage.list_dir(""):
            if not (name.startswith("checkpoint-") and name[11:].isdigit()):
                continue
            t = manifest_txid(r.storage, name)
            if t is None:
                if name not in allowed_foreign:
                    v.append(f"[public] {name} has no manifest (txckpt never publishes one)")
            elif t not in hist.checkpoints:
                if name not in allowed_foreign:
                    v.append(f"[public] {name} holds uncommitted {t}")

    # 5. Legacy and foreign files.
    v += _check_legacy(r, expect)

    # 6. A restarted job resumes and saves.
    if expect.get("restart", True):
        v += _restart(url, so, tagger)

    # 7. gc, leaks, and the kept checkpoints once more.
    if expect.get("gc", True):
        from txckpt._maintenance.gc import collect_garbage

        txckpt.forget_roots()
        try:
            rep = collect_garbage(CheckpointRoot(url, so), now=time.time() + 7200)
            for item in rep.errors:
                v.append(f"[gc] gc could not remove {item.key}: {item.error}")
        except Exception as e:
            v.append(f"[gc] gc raised {type(e).__name__}: {e}")
        else:
            txckpt.forget_roots()
            r = CheckpointRoot(url, so)
            hist = r.history()
            v += leaks(r, hist, expect)
            v += [x.replace("[kept]", "[gc]", 1) for x in _check_kept(r, hist, before, may_retire, so, " (after gc)")]
            v += _check_legacy(r, expect)
    logging.getLogger("txckpt").removeHandler(warned)
    return v


def _check_kept(r, hist, before: dict, may_retire: set, so, when: str) -> list[str]:
    import txckpt

    v = []
    for txid, info in before.items():
        c = hist.checkpoints.get(txid)
        if c is None:
            v.append(f"[kept] committed {txid} vanished from the log{when}")
            continue
        if txid in hist.retired:
            if not info["retired"] and txid not in may_retire:
                v.append(f"[retire] {txid} (step {info['step']}) was retired, but the policy keeps it{when}")
            continue
        if not info.get("present", True):
            continue
        key = r.publication.locate(c.ref)
        if key is None:
            v.append(f"[kept] committed {txid} (step {info['step']}) is gone{when}")
            continue
        path = r.storage.full_path(key)
        try:
            m = txckpt.verify_checkpoint(path, storage_options=so)
        except Exception as e:
            v.append(f"[changed] committed {txid} (step {info['step']}) does not verify{when}: {type(e).__name__}: {e}")
            continue
        if info.get("digest") and m.digest != info["digest"]:
            v.append(f"[changed] the manifest of committed {txid} changed{when}")
    return v


def _check_legacy(r, expect: dict[str, Any]) -> list[str]:
    v = []
    for key, b64 in (expect.get("legacy") or {}).items():
        try:
            data = r.storage.read_bytes(key)
        except FileNotFoundError:
            v.append(f"[legacy] {key} is gone")
            continue
        if data != base64.b64decode(b64):
            v.append(f"[legacy] {key} changed")
    foreign = expect.get("foreign")
    if foreign:
        # Files another tool wrote under a checkpoint-N name: still there, or moved to orphans/.
        from txckpt._base.layout import ORPHANS_DIR

        places = [foreign["name"]] + [f"{ORPHANS_DIR}/{n}" for n in r.storage.list_dir(ORPHANS_DIR)]
        want = {k: base64.b64decode(b) for k, b in foreign["files"].items()}
        found = False
        for place in places:
            try:
                if all(r.storage.read_bytes(f"{place}/{k}") == b for k, b in want.items()):
                    found = True
                    break
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue
        if not found:
            v.append(f"[legacy] the foreign {foreign['name']} (no manifest) is gone, neither in place nor in orphans/")
    return v


def _restart(url: str, so: dict | None, tagger: str) -> list[str]:
    import txckpt
    from txckpt._root.root import CheckpointRoot

    v = []
    txckpt.forget_roots()
    try:
        r = CheckpointRoot(url, so)
        r.resume()
        hist = r.history()
        steps = [c.step for c in hist.checkpoints.values()] + r.legacy_checkpoints() + [0]
        nxt = max(steps) + 1
        path = r.save(nxt, payload("R", nxt))
    except Exception as e:
        return [f"[restart] a restarted job could not resume and save: {type(e).__name__}: {e}"]
    txckpt.forget_roots()
    try:
        last = txckpt.get_last_checkpoint(url, storage_options=so)
        if last != path:
            v.append(f"[restart] after the restart's save lookup returns {last}, not {path}")
        elif read_tags(last, so) != {"R"}:
            v.append("[restart] the restart's checkpoint does not hold the restart's files")
    except Exception as e:
        v.append(f"[restart] lookup after the restart's save failed: {type(e).__name__}: {e}")
    return v


def leaks(r, hist, expect: dict[str, Any]) -> list[str]:
    """After gc: no uncommitted staging, retired data, intents or temp files; names reconciled."""
    from txckpt._base.layout import TEMP_DIRS
    from txckpt._base.layout import TX_DIR
    from txckpt._log.publication import manifest_txid, public_key
    from txckpt._base.layout import INTENTS_DIR

    v = []
    s = r.storage
    for txid in s.list_dir(TX_DIR):
        if txid not in hist.checkpoints:
            v.append(f"[leak] uncommitted staging {TX_DIR}/{txid} survived gc")
        elif txid in hist.retired:
            v.append(f"[leak] the data of retired {txid} survived gc")
    for name in s.list_dir(INTENTS_DIR):
        v.append(f"[leak] intent {name} survived gc")
    from txckpt._log import log as commit_log

    snapshots = commit_log.list_snapshots(s)
    if len(snapshots) > 1:
        v.append(f"[leak] superseded history snapshots {snapshots[:-1]} survived gc")
    for d in TEMP_DIRS:
        for name in s.list_dir(d):
            if name.endswith(".tmp"):
                v.append(f"[leak] temp file {d}/{name} survived gc")
    if s.atomic_dir_rename and hist.state.seq >= 0:
        current = {c.txid for c in hist.in_view(None)}
        foreign = set(expect.get("foreign_names") or [])
        for name in s.list_dir(""):
            if name.startswith("checkpoint-") and name[11:].isdigit():
                t = manifest_txid(s, name)
                if t and t in hist.checkpoints and t not in current:
                    v.append(f"[publish] {name} still holds {t}, which is not in the current lineage")
                if t is None and name not in foreign:
                    v.append(f"[publish] {name} holds no manifest after gc")
        for c in hist.in_view(None):
            if c.adopted:
                continue
            key = r.publication.locate(c.ref)
            if key is not None and key != public_key(c.step):
                v.append(f"[publish] current step {c.step} ({c.txid}) is not published after gc")
    if getattr(s, "bucket", None) and expect.get("s3_endpoint"):
        from . import s3 as s3mod

        ups = s3mod.incomplete_uploads(s3mod.client(expect["s3_endpoint"]), s.bucket, s.prefix + "/")
        if ups:
            v.append(f"[leak] {len(ups)} incomplete multipart upload(s) survived gc")
    return v
