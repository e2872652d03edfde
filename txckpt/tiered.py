"""A tiered root: saves commit on a fast local tier and are replicated to a durable tier (an
object store, or another directory) in the background; docs/protocol.md §14 is normative.

The two tiers are ordinary roots, each with its own log; nothing else decides anything (no
daemon, no side file): a checkpoint is *durable* once the durable tier's log commits its txid.
:class:`TieredRoot` is used wherever a root is (``save_checkpoint``, ``transaction``,
``get_last_checkpoint``, ``resume``, ``load_checkpoint`` take it) and adds
:meth:`TieredRoot.wait_durable`, :meth:`TieredRoot.replicate`, :meth:`TieredRoot.pending` and
:meth:`TieredRoot.apply_retention` (which never retires a checkpoint that is not durable yet).

Call sequence of one save (the training loop waits for 1 only):

1. the fast tier's save, protocol §8, unchanged;
2. :meth:`TieredRoot._kick` wakes the process's replicator thread (rank 0's, in a group);
3. the replicator runs :meth:`TieredRoot.replicate`: every fast commit without a durable commit,
   in fast-log order, through :func:`_replicate_one` (the lineage repeated under its id, then
   a durable :class:`~txckpt.transactions.Transaction` under the same txid whose files are
   shared with a durable copy of the same bytes, or copied and checked against the fast
   manifest's sizes and checksums).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, Iterator, Mapping

from . import reader, retention
from .asyncsave import wait_for_root
from .checksum import copy_hashing
from .commit import claim, fork, new_lineage
from .coordination import SingleProcess, decide_on_rank0
from .errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ReplicationError,
    StepConflictError,
    TxckptError,
)
from .fileio import fsync_dir, hash_file
from .layout import tx_key
from .lineage import Checkpoint, History
from .manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest_at
from .refs import ExternalParent, Ref
from .root import CheckpointRoot, open_root
from .transactions import Transaction

log = logging.getLogger("txckpt")

_CHUNK = 8 << 20


def _rank() -> int:
    """This process's rank in an initialised torch.distributed group, else 0 (torch is not
    imported for it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


class TieredRoot:
    """One root on two tiers: ``fast`` (a local directory every rank of the job sees) and
    ``durable`` (a directory or an fsspec URL, with ``storage_options``).

    A save commits on the fast tier, and the caller waits for that only; rank 0's replicator
    thread then commits it on the durable tier under the same txid and lineage. Lookups pick the
    newest checkpoint of the current lineage committed on either tier; a load reads the fast
    copy and fetches from the durable tier exactly the files that are missing or damaged there.
    A fast tier that is empty (a new node) continues the durable tier's current lineage.
    """

    def __init__(self, fast: str | os.PathLike, durable: str | os.PathLike,
                 storage_options: Mapping[str, Any] | None = None, *,
                 fast_storage_options: Mapping[str, Any] | None = None):
        self.fast = os.fspath(fast)
        self.fast_storage_options = dict(fast_storage_options or {})
        self.durable = os.fspath(durable)
        self.storage_options = dict(storage_options or {})
        #: The fast tier is the process's root for that directory (the functional API's too).
        self.fast_root = open_root(self.fast, fast_storage_options)
        #: The durable tier as the caller's thread reads it (lookups, repairs).
        self.durable_root = CheckpointRoot(self.durable, self.storage_options)
        # The replicator's own objects for both tiers, used only under _lock: a root object
        # caches the history it folded, which two threads must not extend at once. On the
        # durable tier it is a session of its own: a restarted job's replicator claims the
        # lineage there, so a zombie's can no longer commit (§10).
        self._source = CheckpointRoot(self.fast, fast_storage_options)
        self._target = CheckpointRoot(self.durable, self.storage_options)
        self._lock = threading.Lock()        # one replication pass at a time
        self._cond = threading.Condition()   # the thread's requests and results
        self._requested = 0
        self._done = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        #: name -> bytes fetched from the durable tier by the last :meth:`load` (its repairs).
        self.last_fetched: dict[str, int] = {}
        self._settled = False  # the fast tier's lineage holds a checkpoint (_continue_durable_lineage)
        # Every commit this process makes on the fast tier wakes the replicator, whatever made
        # it (save, transaction, async_save, the DCP writer); the newest TieredRoot of a fast
        # tier is the one that replicates it.
        self.fast_root.shared.on_commit["tiered root"] = lambda: self._kick()
        # And every retention of the fast tier in this process (the Trainer's save_total_limit
        # too) keeps what is not durable yet.
        self.fast_root.shared.retention_guards["tiered root"] = lambda: {c.txid for c in self.pending()}

    def _after_async_saves(self) -> None:
        """As the functional API does for a root: an async save of the fast tier (``async_save``
        with this TieredRoot) commits first, so a call never reads the state it is changing."""
        wait_for_root(self.fast, self.fast_storage_options or None)

    def __repr__(self) -> str:
        return f"TieredRoot(fast={self.fast!r}, durable={self.durable!r})"

    # ----- saving --------------------------------------------------------------------------------
    def save(self, step: int, files: Mapping[str, Any], **kwargs: Any) -> str:
        """:func:`txckpt.save_checkpoint` on the fast tier; replicated in the background."""
        self._after_async_saves()
        self._continue_durable_lineage(step)
        return self.fast_root.save(step, files, **kwargs)  # its commit wakes the replicator

    @contextlib.contextmanager
    def transaction(self, step: int, **kwargs: Any) -> Iterator[Transaction]:
        """:func:`txckpt.transaction` on the fast tier; replicated once it commits."""
        self._after_async_saves()
        self._continue_durable_lineage(step)
        with self.fast_root.transaction(step, **kwargs) as tx:
            yield tx

    def _continue_durable_lineage(self, step: int | None = None) -> None:
        """An empty fast tier beside a durable tier with a log continues the durable tier's
        current lineage under its id, with the durable tip as its external parent (§14), as a
        plain root's first save continues its head: never a new root lineage that would
        abandon the durable tier's. Decided on rank 0 (every rank calls it) until the fast
        tier's lineage holds a checkpoint; from then on there is nothing to decide, and a save
        costs no collective and no log read for it."""
        if not self._settled:
            self._settled = bool(decide_on_rank0(lambda: self._adopt_lineage(step), phase="tiered root lineage"))

    def _adopt_lineage(self, step: int | None) -> bool:
        """The decision above; True once the fast tier's current lineage holds a checkpoint."""
        fast = self.fast_root
        fstate = fast.state()
        if fstate.seq < 0:
            dstate = self.durable_root.state()
            if dstate.head is None:
                return False
            tip = dstate.head_tip
            parent = (self.durable_root.locate(tip) if tip is not None else None) or self.durable_root.url
            new_lineage(fast, external_parent=parent, lineage_id=dstate.head)
            log.info("the fast tier %s was empty: it continues lineage %s of %s from %s",
                     fast.url, dstate.head, self.durable_root.url, parent)
            fstate = fast.state()
        if fstate.head_tip is not None:
            return True
        if step is None or fstate.head is None:
            return False
        # The lineage continues a durable checkpoint the fast tier never held: a step that is
        # not newer could be committed here but never on the durable tier.
        info = self.durable_root.state().lineages.get(fstate.head)
        if info is not None and info.tip is not None and step <= info.tip.step:
            raise StepConflictError(
                f"cannot save step {step}: step {info.tip.step} is already committed in lineage "
                f"{fstate.head} of {self.durable_root.url}, which {fast.url} continues; save a "
                "newer step, or resume(root, step=K) to roll back")
        return False

    # ----- replication ---------------------------------------------------------------------------
    def _kick(self) -> None:
        """Ask the replicator thread for a pass (rank 0 only: the fast tier is shared)."""
        if _rank() != 0:
            return
        with self._cond:
            self._requested += 1
            if self._thread is None:
                # Not a daemon: an interpreter that exits waits for the pending replication.
                self._thread = threading.Thread(target=self._run, name="txckpt-replicator")
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._done >= self._requested:
                    self._thread = None  # idle: the next kick starts a new thread
                    return
                target = self._requested
            error: BaseException | None = None
            try:
                self.replicate()
            except BaseException as e:  # kept for wait_durable; the fast commit stands
                error = e
                log.warning("replicating %s to %s failed (the checkpoint stays committed on the "
                            "fast tier, which keeps it; the next save retries): %s",
                            self.fast_root.url, self.durable_root.url, e)
            with self._cond:
                self._done, self._error = target, error
                self._cond.notify_all()

    def wait_durable(self, timeout: float | None = None) -> list[str]:
        """Wait until every checkpoint committed on the fast tier so far (an async save in flight
        first commits) is committed on the durable tier too; returns the durable paths of those
        replicated by this call's pass.
        Raises :class:`ReplicationError` if replication failed (the checkpoints stay on the
        fast tier), ``TimeoutError`` after ``timeout`` seconds."""
        self._after_async_saves()  # an async save in flight: committed (and so waited for) too
        if _rank() != 0:
            return []
        with self._cond:
            if self._thread is not None:
                target = self._requested
                if not self._cond.wait_for(lambda: self._done >= target, timeout):
                    raise TimeoutError(f"replication of {self.fast_root.url} to {self.durable_root.url} "
                                       f"did not finish within {timeout} s")
                if self._error is not None:
                    error, self._error = self._error, None
                    if isinstance(error, ReplicationError):
                        raise error
                    raise ReplicationError(f"replication to {self.durable_root.url} failed: {error}",
                                           durable=self.durable_root.url) from error
        return self.replicate()  # anything left (a restart's backlog): now, on this thread

    def pending(self) -> list[Checkpoint]:
        """The fast tier's committed checkpoints that are not durable yet, oldest first."""
        return _pending(self.fast_root, self.durable_root)

    def replicate(self) -> list[str]:
        """One replication pass, on this thread: every checkpoint :meth:`pending` lists, in
        fast-log order (so a checkpoint's parent, and the fork that made its lineage, are on
        the durable tier before it). Idempotent; returns the durable paths committed."""
        with self._lock:
            todo = _pending(self._source, self._target)
            fast_hist = self._source.history() if todo else History()
            return [_replicate_one(self._source, self._target, c, fast_hist) for c in todo]

    def restore(self) -> str | None:
        """Make an empty fast tier hold the durable tier's newest checkpoint of its current
        lineage: copied (each file checked against the durable manifest) and committed on the
        fast tier under the same txid and lineage id, so that code reading the fast directory as
        a plain root (the Trainer) resumes from it locally. Returns its fast path; None if the
        fast tier has a log already or the durable tier has no checkpoint. Call it on rank 0."""
        if self.fast_root.state().seq >= 0 or not self._durable_exists():
            return None
        tip = self.durable_root.state().head_tip
        if tip is None:
            return None
        self._adopt_lineage(None)  # the lineage, under the durable tier's id
        history = self.durable_root.history()
        return _replicate_one(self.durable_root, self.fast_root, history.checkpoints[tip.txid], history)

    # ----- lookup and lineage ---------------------------------------------------------------------
    def get_last_checkpoint(self) -> str | None:
        """The newest checkpoint of the current lineage committed on either tier: its fast path
        while the fast tier holds it, else its durable path."""
        self._after_async_saves()
        fstate = self.fast_root.state()
        if fstate.seq < 0 or fstate.head is None:
            return self.durable_root.get_last_checkpoint() if self._durable_exists() else None
        tip = fstate.head_tip
        if tip is not None:
            key = self.fast_root.publication.locate(tip)
            if key is not None:
                return self._fast_path(key)
            durable = _history(self.durable_root).checkpoints.get(tip.txid)
            return None if durable is None else self.durable_root.locate(durable.ref)
        info = self.durable_root.state().lineages.get(fstate.head)  # continuing a durable tip
        return None if info is None or info.tip is None else self.durable_root.locate(info.tip)

    def _fast_path(self, key: str) -> str:
        return os.path.join(self.fast, *key.split("/"))

    def _durable_exists(self) -> bool:
        return self.durable_root.storage.missing_root() is None

    def resume(self, step: int | None = None, *, path: str | os.PathLike | None = None,
               on_damaged: str = "raise") -> str | None:
        """:func:`txckpt.resume` on the fast tier (a rollback forks there, and replication
        repeats the fork on the durable tier). A restart on an empty fast tier continues the
        durable tier's lineage. ``on_damaged="fallback"`` counts a checkpoint whose damaged fast
        files the durable tier restores as intact. Replication of what a previous process left
        pending starts here."""
        self._after_async_saves()
        self._adopt_lineage(None)
        if self.fast_root.state().seq < 0:
            return None
        if step is None and path is None and self.fast_root.state().head_tip is None:
            found = self.get_last_checkpoint()  # a durable checkpoint the fast tier continues
        else:
            found = self.fast_root.resume(step, path=path, on_damaged=on_damaged,
                                          verify=self._repair_then_verify if on_damaged == "fallback" else None)
        self._kick()
        return found

    def _repair_then_verify(self, path: str) -> str:
        self.repair(path)
        reader.verify_checkpoint(path)
        return path

    def new_lineage(self, *, external_parent: str | os.PathLike | None = None) -> str:
        """:func:`txckpt.new_lineage` on the fast tier; replicated with the next checkpoint."""
        return self.fast_root.new_lineage(external_parent=external_parent)

    def apply_retention(self, policy: retention.RetentionPolicy, *, dry_run: bool = False) -> list[Any]:
        """:func:`txckpt.apply_retention` on the fast tier, keeping every checkpoint that is not
        durable yet whatever ``policy`` says (§14). The durable tier's retention is its own:
        ``txckpt.apply_retention(txckpt.open_root(durable_url), policy)``."""
        self._after_async_saves()
        return retention.apply_retention(self.fast_root, policy, dry_run=dry_run)  # guarded (__init__)

    # ----- loading --------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike | None = None, **kwargs: Any) -> dict[str, Any]:
        """:func:`txckpt.load_checkpoint` of ``path`` (default: :meth:`get_last_checkpoint`).
        A fast-tier checkpoint is read locally; if a file is missing or fails its checksum
        there, exactly those files are fetched from the durable tier's copy (same txid) into
        the fast tier (:attr:`last_fetched` says which, and how many bytes), then it is loaded."""
        self._after_async_saves()
        self.last_fetched = {}
        where = os.fspath(path) if path is not None else self.get_last_checkpoint()
        if where is None:
            raise CheckpointNotFoundError(f"{self!r} has no committed checkpoint to load")
        if self.fast_root.storage.key_of(where) is None:  # a durable path
            return reader.load(where, **{**_load_defaults(kwargs), "storage_options": self.storage_options})
        try:
            return reader.load(where, **_load_defaults(kwargs))
        except (IntegrityError, CheckpointNotFoundError, FileNotFoundError) as e:
            if not self.repair(where):
                raise
            log.warning("%s was damaged on the fast tier (%s); restored %s from %s", where, e,
                        ", ".join(sorted(self.last_fetched)), self.durable_root.url)
        return reader.load(where, **_load_defaults(kwargs))

    def repair(self, path: str | os.PathLike) -> dict[str, int]:
        """Check every file of the fast-tier checkpoint at ``path`` and fetch from the durable
        tier exactly those that are missing or damaged (each written to a temporary file,
        checked, fsynced and renamed over the fast copy). Returns name -> bytes fetched ({} if
        every file verifies). Raises IntegrityError if a file verifies on neither tier."""
        fast = self.fast_root
        key = fast.storage.key_of(os.fspath(path))
        if key is None:
            raise CheckpointNotFoundError(f"{os.fspath(path)} is not in the fast tier {fast.url}")
        manifest = _read_manifest(fast, key)
        bad = [name for name, entry in sorted(manifest.files.items())
               if not _verifies(fast.storage.local_path(f"{key}/{name}"), entry)]
        fetched: dict[str, int] = {}
        if bad:
            durable = _history(self.durable_root).checkpoints.get(manifest.txid)
            dkey = None if durable is None else self.durable_root.publication.locate(durable.ref)
            if dkey is None:
                raise IntegrityError(
                    f"{os.fspath(path)} has damaged or missing files ({', '.join(bad)}) and is not "
                    f"durable on {self.durable_root.url} yet: nothing to restore them from; resume "
                    "an older checkpoint (txckpt.resume(root, on_damaged='fallback'))",
                    path=os.fspath(path))
            for name in bad:
                local = fast.storage.local_path(f"{key}/{name}")
                assert local is not None  # the fast tier is a local directory
                fetched[name] = _fetch(self.durable_root, f"{dkey}/{name}", local, manifest.files[name])
        self.last_fetched = fetched
        return fetched


def _history(root: CheckpointRoot) -> History:
    return History() if root.state().seq < 0 else root.history()


def _pending(fast: CheckpointRoot, durable: CheckpointRoot) -> list[Checkpoint]:
    fast_hist = _history(fast)
    done = _history(durable).checkpoints
    return sorted((c for c in fast_hist.checkpoints.values()
                   if c.txid not in done and c.txid not in fast_hist.retired and not c.adopted),
                  key=lambda c: c.seq)


# ----- for writers and readers that take a root (txckpt.integrations.dcp) -----------------------
def save_target(root: "str | os.PathLike[str] | TieredRoot", step: int,
                storage_options: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
    """(path, storage_options) that a writer given ``root`` saves ``step`` to: a TieredRoot's
    fast tier (its lineage continued first, §14; its commits wake the replicator), else ``root``."""
    if isinstance(root, TieredRoot):
        root._continue_durable_lineage(step)
        return root.fast, root.fast_storage_options or None
    return os.fspath(root), storage_options


def load_source(path: "str | os.PathLike[str] | TieredRoot",
                storage_options: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
    """(path, storage_options) that a reader given ``path`` reads: a TieredRoot's newest
    checkpoint (its fast copy repaired from the durable tier first, or its durable copy), else
    ``path``."""
    if not isinstance(path, TieredRoot):
        return os.fspath(path), storage_options
    where = path.get_last_checkpoint()
    if where is None:
        raise CheckpointNotFoundError(f"{path!r} has no committed checkpoint to load")
    if path.fast_root.storage.key_of(where) is None:
        return where, path.storage_options or None
    path.repair(where)
    return where, path.fast_storage_options or None


# ----- one replication ----------------------------------------------------------------------------
def _replicate_one(fast: CheckpointRoot, durable: CheckpointRoot, c: Checkpoint, fast_hist: History) -> str:
    """§14 steps 1-6 for fast checkpoint ``c``: its lineage on the durable tier (forked or
    claimed), then a durable transaction under ``c``'s txid and step whose files are shared or
    copied and checked against the fast manifest; returns the durable path."""
    key = fast.publication.locate(c.ref)
    if key is None:
        raise ReplicationError(
            f"checkpoint step {c.step} (txid {c.txid}) is committed on {fast.url} but its files are gone "
            "there, so it cannot be made durable; nothing else is affected", txid=c.txid, durable=durable.url)
    manifest = _read_manifest(fast, key)
    if manifest.txid != c.txid or manifest.digest != c.digest:
        raise ReplicationError(f"the manifest at {fast.storage.full_path(key)} is not the one the log "
                               f"committed for {c.txid}", txid=c.txid, durable=durable.url)
    _hold_lineage(durable, c.lineage, fast_hist)
    # A replication of this txid that a crash interrupted left its staging (files, maybe a
    # staged manifest): not committed (c is pending), and no other session can commit it now
    # that this one holds the lineage, so it goes, and the save below starts from nothing.
    durable.storage.delete_tree(tx_key(c.txid))
    try:
        with Transaction(durable, c.step, metadata=manifest.metadata, coordinator=SingleProcess(),
                         incremental=True, txid=c.txid) as tx:
            for name, entry in sorted(manifest.files.items()):
                if not tx.share_copy(name, entry):
                    _copy_in(tx, fast, f"{key}/{name}", name, entry)
    except (TxckptError, OSError) as e:
        if isinstance(e, ReplicationError):
            raise
        raise ReplicationError(f"replicating step {c.step} (txid {c.txid}) to {durable.url} failed: {e}",
                               txid=c.txid, durable=durable.url) from e
    assert tx.path is not None
    return tx.path


def _hold_lineage(durable: CheckpointRoot, lineage: str, fast_hist: History) -> None:
    """§14 steps 1-2: make ``lineage`` the durable tier's head, held by this session."""
    state = durable.state()
    if lineage not in state.lineages:
        parent = fast_hist.state.lineages[lineage].parent
        if isinstance(parent, Ref):
            hist = durable.history()
            at = hist.checkpoints.get(parent.txid)
            if at is None:
                raise ReplicationError(
                    f"lineage {lineage} forks from txid {parent.txid}, which is not durable on "
                    f"{durable.url} (retired on the fast tier before it was replicated)",
                    txid=parent.txid, durable=durable.url)
            fork(durable, at.ref, hist, reason="fork", announce=False, lineage_id=lineage)
        else:
            external = parent.path if isinstance(parent, ExternalParent) else None
            new_lineage(durable, external_parent=external, lineage_id=lineage)
        return
    if state.head != lineage:
        raise ReplicationError(
            f"lineage {lineage} is no longer the current lineage of {durable.url} (its head is "
            f"{state.head}: another job resumed there); the fast tier's checkpoints of {lineage} "
            "stay where they are", durable=durable.url)
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
                f"{digest}); run `txckpt verify` on {fast.url}", path=fast.storage.full_path(src_key))
        f.close()
    except BaseException:
        f.abort()
        raise


# ----- helpers ------------------------------------------------------------------------------------
def _read_manifest(root: CheckpointRoot, key: str) -> Manifest:
    where = root.storage.full_path(key)
    try:
        data = root.storage.read_bytes(f"{key}/{MANIFEST_NAME}")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} has no manifest") from None
    return read_manifest_at(root.storage, key, Manifest.decode(data, where=key), where)


def _verifies(local: str | None, entry: FileEntry) -> bool:
    if local is None:
        return False
    try:
        return hash_file(local) == (entry.size, entry.checksum)
    except OSError:  # missing, or not a regular file
        return False


def _fetch(durable: CheckpointRoot, key: str, local: str, entry: FileEntry) -> int:
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
                path=durable.storage.full_path(key))
        # A rename, not a write into the old file: a damaged copy may be a hard link that other
        # checkpoints share (incremental saves); each keeps its own until it is repaired.
        os.replace(tmp, local)
        fsync_dir(os.path.dirname(local))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size


def _load_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {"files": None, "map_location": "cpu", "weights_only": True, "verify": True, "mmap": False,
           "storage_options": None}
    out.update(kwargs)
    return out


__all__ = ["TieredRoot", "save_target", "load_source"]
