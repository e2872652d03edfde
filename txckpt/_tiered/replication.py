"""The copying half of a tiered root (protocol §14, docs/tiered.md): one checkpoint committed
on another tier under the same txid (replication fast -> durable, a restore durable -> fast),
the lineage held for it, a damaged fast file fetched back, and what is not durable yet.
:mod:`txckpt._tiered.tiered` decides when; this module only moves and checks bytes and log entries."""

from __future__ import annotations

import os
from typing import Any

from .._base.checksum import copy_hashing
from .._log.commit import claim, fork, new_lineage
from .._base.coordination import SingleProcess
from ..errors import (
    CheckpointNotFoundError,
    ConcurrentWriterError,
    IntegrityError,
    ReplicationError,
    StepConflictError,
    TxckptError,
    UnsafePathError,
)
from .._base.fileio import fsync_dir
from .._base.layout import tx_key
from .._log.lineage import Checkpoint, History
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import FileEntry, Manifest, read_manifest_at
from .._base.refs import ExternalParent, Ref
from .._manifest.verify import verify_checkpoint_files
from .._read import reader
from .._root.root import CheckpointRoot
from .._save.transactions import Transaction

_CHUNK = 8 << 20


def history_of(root: CheckpointRoot) -> History:
    return History() if root.state().seq < 0 else root.history()


def pending(fast: CheckpointRoot, durable: CheckpointRoot) -> tuple[list[Checkpoint], set[str]]:
    """The fast tier's committed checkpoints the durable tier does not hold, oldest first, and
    the txids the durable tier holds (what this process learnt by reading its log)."""
    fast_hist = history_of(fast)
    durable_hist = history_of(durable)
    done = durable_hist.checkpoints
    # A lineage that both tiers have left (the durable tier by another node's rollback, the fast
    # tier by following it, §14) can take no commit on the durable tier: what the fast tier
    # committed to it before it was replicated is abandoned there, not pending.
    left = {lid for lid in durable_hist.state.lineages if lid not in (durable_hist.state.head, fast_hist.state.head)}
    todo = sorted(
        (
            c
            for c in fast_hist.checkpoints.values()
            if c.txid not in done and c.txid not in fast_hist.retired and not c.adopted and c.lineage not in left
        ),
        key=lambda c: c.seq,
    )
    return todo, set(done)


def replicate_one(
    src: CheckpointRoot, dst: CheckpointRoot, c: Checkpoint, src_hist: History, *, hold: bool = True
) -> str:
    """§14 steps 1-6 for ``src``'s checkpoint ``c``: its lineage on ``dst`` (forked or claimed;
    ``hold=False``: the caller made ``dst``'s head the lineage to commit into), then a ``dst``
    transaction under ``c``'s txid and step whose files are shared or copied and checked
    against ``src``'s manifest; returns the path on ``dst``."""
    key = src.publication.locate(c.ref)
    if key is None:
        raise ReplicationError(
            f"checkpoint step {c.step} (txid {c.txid}) is committed on {src.url} but its files are gone "
            "there, so it cannot be copied; nothing else is affected",
            txid=c.txid,
            durable=dst.url,
        )
    manifest = read_manifest(src, key)
    if manifest.txid != c.txid or manifest.digest != c.digest:
        raise ReplicationError(
            f"the manifest at {src.storage.full_path(key)} is not the one the log committed for {c.txid}",
            txid=c.txid,
            durable=dst.url,
        )
    if hold:
        hold_lineage(dst, c.lineage, src_hist)
    # A replication of this txid that a crash interrupted left its staging (files, maybe a
    # staged manifest): not committed (c is pending), and no other session can commit it now
    # that this one holds the lineage, so it goes, and the save below starts from nothing.
    dst.storage.delete_tree(tx_key(c.txid))
    try:
        with Transaction(
            dst, c.step, metadata=manifest.metadata, coordinator=SingleProcess(), incremental=True, txid=c.txid
        ) as tx:
            for name, entry in sorted(manifest.files.items()):
                if not tx.share_copy(name, entry):
                    _copy_in(tx, src, f"{key}/{name}", name, entry)
    except (TxckptError, OSError) as e:
        if isinstance(e, ReplicationError):
            raise
        if isinstance(e, (StepConflictError, ConcurrentWriterError)):
            raise _owned_elsewhere(dst, c, src_hist, e) from e
        raise ReplicationError(
            f"replicating step {c.step} (txid {c.txid}) to {dst.url} failed: {e}", txid=c.txid, durable=dst.url
        ) from e
    assert tx.path is not None
    return tx.path


def _owned_elsewhere(dst: CheckpointRoot, c: Checkpoint, src_hist: History, e: TxckptError) -> ReplicationError:
    """The error of a commit that ``dst`` refused because someone else writes the lineage there."""
    info = dst.state().lineages.get(c.lineage)
    tip = info.tip if info is not None else None
    if tip is None or tip.txid in src_hist.checkpoints:
        return ReplicationError(
            f"replicating step {c.step} (txid {c.txid}) to {dst.url} failed: {e}", txid=c.txid, durable=dst.url
        )
    return ReplicationError(
        f"cannot make step {c.step} (txid {c.txid}) durable: another job owns lineage {c.lineage} on "
        f"{dst.url}. It committed step {tip.step} (txid {tip.txid}) there, which this fast tier never "
        "held: this fast tier is stale (a requeue onto another node continued the lineage), or two "
        "jobs run on one durable root. If the other job still runs, stop this one; if this job is the "
        "newest, restart it with txckpt.resume(root) (or load txckpt.get_last_checkpoint(root)), which "
        "follows the durable tier. This checkpoint stays on the fast tier.",
        txid=c.txid,
        durable=dst.url,
    )


def hold_lineage(durable: CheckpointRoot, lineage: str, fast_hist: History) -> None:
    """§14 steps 1-2: make ``lineage`` the durable tier's head, held by this session."""
    state = durable.state()
    if lineage not in state.lineages and state.partial:  # a /2 entry holds the head's record only
        state = durable.history().state
    if lineage not in state.lineages:
        parent = fast_hist.state.lineages[lineage].parent
        if isinstance(parent, Ref):
            hist = durable.history()
            at = hist.checkpoints.get(parent.txid)
            if at is None:
                raise ReplicationError(
                    f"lineage {lineage} forks from txid {parent.txid}, which is not durable on "
                    f"{durable.url} (retired on the fast tier before it was replicated)",
                    txid=parent.txid,
                    durable=durable.url,
                )
            fork(durable, at.ref, hist, reason="fork", announce=False, lineage_id=lineage)
        else:
            external = parent.path if isinstance(parent, ExternalParent) else None
            new_lineage(durable, external_parent=external, lineage_id=lineage)
        return
    if state.head != lineage:
        raise ReplicationError(
            f"lineage {lineage} is no longer the current lineage of {durable.url} (its head is "
            f"{state.head}): another job owns that root now (it resumed or rolled back there, e.g. "
            "this job requeued onto another node, or a second job on the same durable root). The fast "
            f"tier's checkpoints of {lineage} stay where they are. If the other job still runs, stop "
            "this one; if this job is the newest, restart it with txckpt.resume(root), which follows "
            "the durable tier's lineage",
            durable=durable.url,
        )
    if durable.shared.writer_lineage != lineage:
        claim(durable, state)


def _copy_in(tx: Transaction, fast: CheckpointRoot, src_key: str, name: str, entry: FileEntry) -> None:
    f: Any = tx.open(name, "wb")
    try:
        f.kind = entry.kind
        with fast.storage.open_read(src_key) as src:
            size, digest = copy_hashing(src, f, chunk=_CHUNK)
        if (size, digest) != (entry.size, entry.checksum):
            raise IntegrityError(
                f"{fast.storage.full_path(src_key)} does not match its manifest (size {size}, xxh3-128 "
                f"{digest}); run `txckpt verify` on {fast.url}",
                path=fast.storage.full_path(src_key),
            )
        f.close()
    except BaseException:
        f.abort()
        raise


def read_manifest(root: CheckpointRoot, key: str) -> Manifest:
    where = root.storage.full_path(key)
    try:
        data = root.storage.read_bytes(f"{key}/{MANIFEST_NAME}")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} has no manifest") from None
    return read_manifest_at(root.storage, key, Manifest.decode(data, where=key), where)


def damaged_files(fast: CheckpointRoot, key: str, manifest: Manifest) -> list[str]:
    """The files of the fast tier's checkpoint at ``key`` that do not verify (missing, resized,
    changed, not a regular file), each read by the one verify engine (txckpt/_manifest/verify.py)."""
    where = fast.storage.full_path(key)
    bad = []
    for name in sorted(manifest.files):
        try:
            verify_checkpoint_files(fast.storage, manifest, where, names=[name], at=key)
        except (IntegrityError, UnsafePathError, OSError):
            bad.append(name)
    return bad


def fetch(durable: CheckpointRoot, key: str, local: str, entry: FileEntry) -> int:
    """The durable copy of one file into ``local``: checked before it replaces anything."""
    tmp = f"{local}.txckpt-fetch-{os.getpid()}"
    os.makedirs(os.path.dirname(local), exist_ok=True)
    try:
        with durable.storage.open_read(key) as src, open(tmp, "wb") as out:
            size, digest = copy_hashing(src, out, chunk=_CHUNK)
            out.flush()
            os.fsync(out.fileno())
        if (size, digest) != (entry.size, entry.checksum):
            raise IntegrityError(
                f"{durable.storage.full_path(key)} fails its checksum as well: the file verifies on "
                "neither tier; resume an older checkpoint (txckpt.resume(root, on_damaged='fallback'))",
                path=durable.storage.full_path(key),
            )
        # A rename, not a write into the old file: a damaged copy may be a hard link that other
        # checkpoints share (incremental saves); each keeps its own until it is repaired.
        os.replace(tmp, local)
        fsync_dir(os.path.dirname(local))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size


def repair(fast: CheckpointRoot, durable: CheckpointRoot, path: str | os.PathLike) -> dict[str, int]:
    """:meth:`txckpt.TieredRoot.repair`: the fast-tier checkpoint at ``path``'s files that are
    missing or damaged, fetched from the durable tier's copy; name -> bytes fetched."""
    key = fast.storage.key_of(os.fspath(path))
    if key is None:
        raise CheckpointNotFoundError(f"{os.fspath(path)} is not in the fast tier {fast.url}")
    # Through the read path: the manifest checked against the fast tier's log, as any load's.
    manifest = reader.read_manifest(fast.storage.full_path(key), storage_options=fast.storage_options or None)
    bad = damaged_files(fast, key, manifest)
    fetched: dict[str, int] = {}
    if bad:
        copy = history_of(durable).checkpoints.get(manifest.txid)
        dkey = None if copy is None else durable.publication.locate(copy.ref)
        if dkey is None:
            raise IntegrityError(
                f"{os.fspath(path)} has damaged or missing files ({', '.join(bad)}) and is not "
                f"durable on {durable.url} yet: nothing to restore them from; resume "
                "an older checkpoint (txckpt.resume(root, on_damaged='fallback'))",
                path=os.fspath(path),
            )
        for name in bad:
            local = fast.storage.local_path(f"{key}/{name}")
            assert local is not None  # the fast tier is a local directory
            fetched[name] = fetch(durable, f"{dkey}/{name}", local, manifest.files[name])
    return fetched
