"""Adoption of a legacy root: plain ``checkpoint-N`` directories (a stock Trainer's) recorded as
the root's first lineage. Protocol: docs/protocol.md §9.

Several processes may adopt one root at once (the same job launched twice, ``txckpt adopt``
beside a first save). Before the commit, a manifest in a ``checkpoint-N`` directory is shared,
mutable state, so adoption is built such that no adopter can overwrite another one's manifest
once the log may commit it:

* **The adoption is a function of the bytes.** The lineage id, the txids and every manifest
  (including ``created``: the newest file time) are derived from the directories' names and file
  checksums, so adopters that hash the same bytes write byte-identical manifests.
* **Manifests are created if absent.** An identical manifest already there is reused as it is;
  a committed manifest is never rewritten.
* **A different manifest is replaced only when nobody may commit it**: the log has no entry 0,
  and no live adopter of other bytes exists. Every adopter announces itself with an intent
  (``.txckpt/intents/adopt-<lineage>.<session>.json``) before it writes a manifest and lists the
  others' after, so of two live adopters of different bytes at least one sees the other and
  refuses (:class:`~txckpt.errors.AdoptionInProgressError`) before it commits or replaces.
* **Entry 0 decides.** It is created if absent; the loser changes nothing more and continues as
  an ordinary writer against the winner's state.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from .._base import checksum
from .._base import progress
from ..errors import AdoptionInProgressError, AmbiguousCheckpointNameError, ManifestError
from .._maintenance.intents import intent_record, read_intents, writer_status
from .._base.layout import (
    ADOPT_INTENT_PREFIX,
    MANIFEST_NAME,
    adopt_intent_id,
    adopted_txid,
    intent_key,
    is_manifest_temp,
)
from .._log.lineage import State
from .._manifest.manifest import FileEntry, Manifest, kind_for_name
from .._log.publication import Root
from .._base.refs import Parent, Ref
from .._manifest.tensor_index import Indexer

log = logging.getLogger("txckpt")

INTENT_PREFIX = ADOPT_INTENT_PREFIX  # the name tests and tools know it by


def legacy_dirs(root: Root) -> list[tuple[int, str]]:
    """(step, directory name) of every ``checkpoint-N`` at the root's top level, by step; the name
    is the one found (``checkpoint-00500`` stays that: transformers accepts ``^checkpoint-(\\d+)$``).
    Two names for one step: :class:`AmbiguousCheckpointNameError` naming both."""
    by_step: dict[int, list[str]] = {}
    step_of = root.publication.naming.step_of  # checkpoint-N, or the root's naming (txckpt/_base/naming.py)
    for name in root.storage.list_subdirs(""):  # a file named checkpoint-N is none (transformers)
        step = step_of(name)
        if step is not None:
            by_step.setdefault(step, []).append(name)
    for step, names in sorted(by_step.items()):
        if len(names) > 1:
            paths = [root.storage.full_path(n) for n in sorted(names)]
            raise AmbiguousCheckpointNameError(
                f"{root.url} has {len(names)} directories for step {step}: {', '.join(paths)}; which one "
                "a resume should load is unknowable. Rename or remove all but one of them, then retry",
                root=root.url,
                step=step,
                paths=paths,
            )
    return [(step, names[0]) for step, names in sorted(by_step.items())]


@dataclass
class _Dir:
    step: int
    key: str
    files: dict[str, FileEntry]
    newest: float


def _hash_dir(root: Root, step: int, key: str) -> _Dir:
    s = root.storage
    files: dict[str, FileEntry] = {}
    newest = 0.0
    for name, _size in s.walk_files(key):
        # Temp files of txckpt's own atomic writes of a manifest (a crashed adoption's): not user data.
        if name == MANIFEST_NAME or is_manifest_temp(name):
            continue
        if s.is_symlink_escape(f"{key}/{name}"):
            log.warning("adoption skips %s/%s, a symlink out of the root", key, name)
            continue
        indexer = Indexer(name)  # the tensor index (protocol §3b), from the same read
        with s.open_read(f"{key}/{name}") as f:
            size, digest = checksum.copy_hashing(f, tap=indexer.update)
        progress.advance(size)
        files[name] = FileEntry(size, digest, kind_for_name(name), index=indexer.finish(size))
        newest = max(newest, s.modified_time(f"{key}/{name}") or 0.0)
    return _Dir(step, key, files, newest)


def plan_adoption(dirs: list[_Dir]) -> tuple[str, list[Manifest]]:
    """The lineage id and the manifests an adoption of ``dirs`` writes: a function of the names
    and the bytes only, so every adopter of the same bytes computes the same ones."""
    # Everything a manifest holds goes into the id, so one id means one set of manifests.
    canonical = json.dumps(
        [
            [d.step, d.key, d.newest, {n: [e.size, e.checksum, e.kind] for n, e in sorted(d.files.items())}]
            for d in dirs
        ],
        separators=(",", ":"),
    ).encode()
    lid = checksum.digest_bytes(canonical)[:8]
    manifests = []
    parent: Parent = None
    for d in dirs:
        m = Manifest(adopted_txid(d.step, lid), lid, d.step, parent, d.files, d.newest, adopted=True)
        m.encode()  # sets the digest
        manifests.append(m)
        parent = Ref(lid, d.step, m.txid, d.key, m.digest)
    return lid, manifests


class _Lost(Exception):
    """Entry 0 exists: another adopter (or a save) won."""


def _other_live_adopters(root: Root, lid: str) -> list[str]:
    """Live adopters of other bytes (another lineage id), from their intents."""
    out = []
    for name, intent in read_intents(root.storage).items():
        if not name.startswith(INTENT_PREFIX) or name[len(INTENT_PREFIX) :].split(".", 1)[0] == lid:
            continue
        gone, why = writer_status(intent, now=time.time(), grace_seconds=3600.0)
        if not gone:
            out.append(f"{name} ({why})")
    return out


def adopt(root: Root) -> str | None:
    """Adopt the legacy root; returns the new lineage id, or None if there was nothing to adopt or
    another process adopted it first (the caller then continues against the winner's state)."""
    if root.state().seq >= 0:
        return None
    found = legacy_dirs(root)
    dirs = []
    for step, key in found:
        d = _hash_dir(root, step, key)
        if not d.files:
            log.warning(
                "%s holds no files; it is not adopted (an empty checkpoint would load as "
                "nothing). Remove it, or fill it, and adopt again",
                root.storage.full_path(key),
            )
            continue
        dirs.append(d)
    if not dirs:
        return None
    lid, manifests = plan_adoption(dirs)
    s = root.storage
    intent_id = adopt_intent_id(lid, root.session)
    intent = intent_key(intent_id)
    s.replace(intent, json.dumps(intent_record({"txid": intent_id, "step": dirs[-1].step, "lineage": lid}, 1)).encode())
    try:
        stale = []
        for d, m in zip(dirs, manifests):
            if not _create_or_match(root, d.key, m):
                stale.append((d, m))
        # Listed after our intent exists: of two live adopters of different bytes, at least one
        # sees the other here (each wrote its intent before listing), and refuses.
        others = _other_live_adopters(root, lid)
        if root.state().seq >= 0:
            raise _Lost()
        if others:
            raise AdoptionInProgressError(
                f"another process is adopting {root.url} and hashed other bytes than this one "
                f"({'; '.join(others)}): the legacy checkpoints changed while they were read. Nothing "
                "was committed. Wait until no other process writes the root, then retry",
                root=root.url,
                paths=[s.full_path(d.key) for d, _ in stale],
            )
        for d, m in stale:
            # Nobody can commit what is there: no log, no live adopter of other bytes (one of the
            # same bytes writes these very bytes). A crashed adoption's, or an older txckpt's.
            log.warning(
                "replacing the uncommitted manifest in %s (left by an adoption that never "
                "committed and described other bytes: one that crashed before the files changed, or "
                "an older txckpt's)",
                s.full_path(d.key),
            )
            s.replace(f"{d.key}/{MANIFEST_NAME}", m.encode(), durable=root.durable)
        _append_adopt_entry(root, lid, dirs, manifests)
    except _Lost:
        return None
    finally:
        try:
            s.delete_file(intent)
        except OSError as e:  # the outcome stands; gc removes an intent whose writer is gone
            log.warning("could not delete the adoption intent %s (%s); `txckpt gc` removes it", intent, e)
    log.warning(
        "adopted %d checkpoint(s) of %s written without txckpt (steps %s) as lineage %s; "
        "their checksums were computed now, so damage done before adoption cannot be detected.",
        len(dirs),
        root.url,
        ", ".join(str(d.step) for d in dirs),
        lid,
    )
    return lid


def _create_or_match(root: Root, key: str, m: Manifest) -> bool:
    """Create ``key``'s manifest if absent. True if ``key`` now holds ``m`` (created, or an
    identical one there already); False if it holds another one (left for the caller)."""
    s = root.storage
    try:
        s.create_exclusive(f"{key}/{MANIFEST_NAME}", m.encode(), durable=root.durable)
        return True
    except FileExistsError:
        pass
    try:
        there = Manifest.decode(s.read_bytes(f"{key}/{MANIFEST_NAME}"))
    except (FileNotFoundError, ManifestError):
        # Unreadable, or gone again (nothing deletes one; a hand edit): not ours, so the caller
        # decides as for any other manifest (replaced only if nobody can commit it).
        return False
    return there.digest == m.digest


def _append_adopt_entry(root: Root, lid: str, dirs: list[_Dir], manifests: list[Manifest]) -> None:
    records: list[dict[str, Any]] = [
        {
            "step": d.step,
            "txid": m.txid,
            "digest": m.digest,
            "key": d.key,
            "bytes": m.total_bytes,
            "files": len(m.files),
        }
        for d, m in zip(dirs, manifests)
    ]

    def build(state: State, seq: int, now: float) -> dict[str, Any]:
        if state.seq >= 0:
            raise _Lost()
        new_state = state.after_new_lineage(seq, now, lid, None, "adopt")
        new_state.lineages[lid].tip = Ref(lid, dirs[-1].step, manifests[-1].txid, dirs[-1].key, manifests[-1].digest)
        return {"action": "adopt", "lineage": lid, "checkpoints": records, "state": new_state.to_json()}

    root.append_entry(build)
