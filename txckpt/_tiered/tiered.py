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
   in fast-log order, through :func:`txckpt._tiered.replication.replicate_one` (the lineage repeated
   under its id, then a durable Transaction under the same txid, its files shared or copied).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterator, Mapping, TypeVar

from .._read import reader
from .._maintenance import retention
from . import replication as tiered_copy
from .._async.asyncsave import wait_for_root
from .._log.commit import claim, new_lineage
from .._base.coordination import decide_on_rank0, decide_once
from ..errors import (
    CheckpointNotFoundError,
    IntegrityError,
    InvalidArgumentError,
    RemoteAccessError,
    ReplicationError,
    StepConflictError,
)
from .._base.issued import issue
from .._log.lineage import Checkpoint, History, State
from .._root.interface import RootInterface
from .._root.root import CheckpointRoot, open_root
from .._save.transactions import Transaction

log = logging.getLogger("txckpt")

_T = TypeVar("_T")


def _rank() -> int:
    """This process's rank in an initialised torch.distributed group, else 0 (torch not imported)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


class TieredRoot(RootInterface):
    """One root on two tiers: ``fast`` (a local directory every rank of the job sees) and
    ``durable`` (a directory or an fsspec URL, with ``storage_options``).

    A save commits on the fast tier, and the caller waits for that only; rank 0's replicator
    thread then commits it on the durable tier under the same txid and lineage. Lookups read both
    logs and never answer older than the durable tier: the fast tier's newest checkpoint while it
    holds the durable tier's current tip (or is newer in its lineage), else the durable tier's
    (a new node, or a requeue onto a node whose fast directory is stale: another node continued
    or left the lineage since). A load reads the fast copy and fetches from the durable tier
    exactly the files that are missing or damaged there. ``max_pending``: how many checkpoints
    may wait for replication before a warning says replication lags (None: no bound).
    """

    def __init__(
        self,
        fast: str | os.PathLike,
        durable: str | os.PathLike,
        storage_options: Mapping[str, Any] | None = None,
        *,
        fast_storage_options: Mapping[str, Any] | None = None,
        max_pending: int | None = None,
    ):
        if max_pending is not None and (
            isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1
        ):
            raise InvalidArgumentError(f"max_pending must be a positive int or None, not {max_pending!r}")
        self.fast = os.fspath(fast)
        self.fast_storage_options = dict(fast_storage_options or {})
        self.durable = os.fspath(durable)
        self.storage_options = dict(storage_options or {})
        self.max_pending = max_pending
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
        self._lock = threading.Lock()  # one replication pass at a time
        self._cond = threading.Condition()  # the thread's requests and results
        self._requested = self._done = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        #: name -> bytes fetched from the durable tier by the last :meth:`load` (its repairs).
        self.last_fetched: dict[str, int] = {}
        #: The error of the newest read of the durable tier, while it is unreachable (None once
        #: a read succeeds): :meth:`pending` then answers from what this process knows.
        self.durable_unreachable: BaseException | None = None
        #: Checkpoints committed on the fast tier that this process does not know to be durable,
        #: as of the newest commit (counted when ``max_pending`` is set).
        self.lag = 0
        self._durable_txids: set[str] = set()  # what this process saw committed on the durable tier
        self._durable_seen = False  # ... once it has read the durable tier's history
        self._start_seq = self.fast_root.state().seq if max_pending is not None else -1
        # A fold of the fast log of its own, for questions asked from any thread (an async
        # saver's commit hook, a lookup beside it): one thread at a time extends it.
        self._fold_root, self._fold_lock = CheckpointRoot(self.fast, fast_storage_options), threading.Lock()
        self._lag_warned = self._durable_found = False
        self._outage_told: set[str] = set()
        self._moved_warned: set[tuple[str | None, str | None]] = set()
        self._settled = False  # a save compared the tiers and the fast lineage holds a checkpoint
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
        path = self.fast_root.save(step, files, **kwargs)  # its commit wakes the replicator
        return self.issue(path) or path

    @contextlib.contextmanager
    def transaction(self, step: int, **kwargs: Any) -> Iterator[Transaction]:
        """:func:`txckpt.transaction` on the fast tier; replicated once it commits."""
        self._after_async_saves()
        self._continue_durable_lineage(step)
        with self.fast_root.transaction(step, **kwargs) as tx:
            yield tx

    # ----- the root interface (txckpt/_root/interface.py): what the functional API calls -----------
    def async_target(self, step: int) -> tuple[str | os.PathLike, Mapping[str, Any] | None]:
        """An asynchronous save commits on the fast tier, once that follows the durable tier's
        lineage; its commit wakes the replicator."""
        self._continue_durable_lineage(step)
        return self.fast, self.fast_storage_options or None

    def last_checkpoint(self, *, missing_ok: bool = False) -> str | None:
        """:meth:`get_last_checkpoint` (a missing fast tier directory is an empty one)."""
        return self.get_last_checkpoint()

    def resume_at(
        self,
        step: int | None,
        *,
        path: str | os.PathLike | None = None,
        on_damaged: str = "raise",
        collective: bool | None = None,
    ) -> str | None:
        """:meth:`resume`, decided on rank 0; every rank gets the path with what reads it (the
        broadcast carries a plain str)."""
        return self.issue(decide_once(lambda: self.resume(step, path=path, on_damaged=on_damaged), collective))

    def read(self, path: str | os.PathLike | None, **options: Any) -> dict[str, Any]:
        """:meth:`load`: the fast tier's copy, repaired from the durable tier where needed."""
        return self.load(path, **options)

    def _continue_durable_lineage(self, step: int | None = None) -> None:
        """Before this process's first save, the fast tier follows the durable tier (§14: an
        empty one, or one whose lineage the durable tier left), and a step the durable lineage
        holds is refused before anything is written: it could never become durable. Decided on
        rank 0 (every rank calls it) until settled; then a save costs no collective and no log
        read: this job's replicator is the durable tier's writer (another job: ReplicationError)."""
        if not self._settled:
            self._settled = bool(decide_on_rank0(lambda: self._adopt_lineage(step), phase="tiered root lineage"))

    def _adopt_lineage(self, step: int | None) -> bool:
        """The decision above; True once settled."""
        fstate, dstate, why = self._sight()
        if fstate.seq < 0 and dstate is None and self.durable_unreachable is not None:
            # A new node or a first run: only the durable tier knows which lineage to continue.
            raise self.durable_unreachable
        if why is not None:
            self._follow(dstate)
        head = self.fast_root.state().head
        tip = dstate.head_tip if dstate is not None and dstate.head == head else None
        if tip is not None and step is not None and step <= tip.step:
            raise StepConflictError(
                f"cannot save step {step} on the fast tier {self.fast_root.url}: step {tip.step} is "
                f"already committed in lineage {head} of {self.durable_root.url}, "
                "which this fast tier continues (another node saved there, this is a new node, or the "
                "lineage was forked there from that step). Nothing was written. txckpt.resume(root) "
                "returns that checkpoint: load it and save a newer step; or resume(root, step=K) to roll back"
            )
        return why is None and fstate.head_tip is not None

    # ----- the two logs, compared -------------------------------------------------------------
    def _read_durable(self, doing: str, read: Callable[[], _T], default: _T) -> _T:
        """``read()`` of the durable tier; ``default`` (and one warning per outage) while it is
        unreachable, so that an outage degrades what needs the durable tier and stops nothing."""
        try:
            out = read()
        except (RemoteAccessError, OSError) as e:
            if doing not in self._outage_told:  # once per outage for each thing it degrades
                self._outage_told.add(doing)
                log.warning(
                    "the durable tier %s is unreachable (%s); %s. Saves go on committing on the "
                    "fast tier, which keeps every checkpoint that is not durable; replication "
                    "retries with each save",
                    self.durable_root.url,
                    e,
                    doing,
                )
            self.durable_unreachable = e
            return default
        self.durable_unreachable = None
        self._outage_told.clear()
        return out

    def _durable_state(self) -> State | None:
        if not self._durable_found:  # a bucket, once found, stays: one HEAD per process, not per lookup
            if self.durable_root.storage.missing_root() is not None:
                return None
            self._durable_found = True
        state = self.durable_root.state()
        return state if state.seq >= 0 else None

    def _sight(self) -> tuple[State, State | None, str | None]:
        """One look at both tiers (one log read each): the fast state, the durable state (None:
        no log there, or unreachable: the fast tier answers alone) and :meth:`_behind`'s verdict."""
        fstate = self.fast_root.state()
        dstate = self._read_durable("lookups answer from the fast tier alone", self._durable_state, None)
        why = self._behind(fstate, dstate)
        if why == "moved":
            assert dstate is not None
            self._warn_moved(fstate, dstate)
        return fstate, dstate, why

    def _behind(self, fstate: State, dstate: State | None) -> str | None:
        """Why the fast tier is older than the durable tier, or None if it is not (it holds the
        durable tier's current tip, or is newer in the same lineage, or the durable tier has no
        checkpoint): "empty" (no fast lineage: a new node), "ahead" (the durable tier continued
        the fast tier's lineage past its tip), "moved" (the durable tier's current lineage is
        another: a node resumed or rolled back there since)."""
        tip = None if dstate is None else dstate.head_tip
        if dstate is None or tip is None:
            return None
        if fstate.seq < 0 or fstate.head is None:
            return "empty"
        with self._fold_lock:
            if tip.txid in tiered_copy.history_of(self._fold_root).checkpoints:
                return None
        if fstate.head == dstate.head:
            ftip = fstate.head_tip
            return "ahead" if ftip is None or tip.step > ftip.step else None
        return "moved"

    def _warn_moved(self, fstate: State, dstate: State) -> None:
        if (fstate.head, dstate.head) in self._moved_warned:
            return
        self._moved_warned.add((fstate.head, dstate.head))
        ftip, dtip = fstate.head_tip, dstate.head_tip
        log.warning(
            "the durable tier %s has moved to lineage %s (newest step %s) since this fast tier %s last "
            "saw it; the fast tier's lineage %s (newest step %s) was abandoned there: another node "
            "resumed or rolled back. Following the durable tier: lookups answer its checkpoint and "
            "the next save continues lineage %s; the fast tier's checkpoints of %s stay on disk "
            "(`txckpt ls`), never resumed again",
            self.durable_root.url,
            dstate.head,
            dtip.step if dtip else None,
            self.fast_root.url,
            fstate.head,
            ftip.step if ftip else None,
            dstate.head,
            fstate.head,
        )

    def _follow(self, dstate: State | None) -> None:
        """Make the durable tier's current lineage the fast tier's, under the same id, continuing
        the durable tip as its external parent (§14): a new node, or a fast tier whose lineage
        the durable tier left. Nothing to do if the fast tier's head is that lineage already."""
        fast = self.fast_root
        fstate = fast.state()
        if dstate is None or dstate.head is None or fstate.head == dstate.head:
            return
        if fstate.seq >= 0 and dstate.head in fast.history().state.lineages:
            raise ReplicationError(
                f"the fast tier {fast.url} left lineage {dstate.head}, which is the current lineage of "
                f"{self.durable_root.url} again: the fast tier cannot follow it back. Remove the fast "
                "directory (every durable checkpoint stays on the durable tier) and restart",
                durable=self.durable_root.url,
            )
        tip = dstate.head_tip
        parent = (self.durable_root.locate(tip) if tip is not None else None) or self.durable_root.url
        new_lineage(fast, external_parent=parent, lineage_id=dstate.head)
        log.info(
            "the fast tier %s continues lineage %s of %s from %s", fast.url, dstate.head, self.durable_root.url, parent
        )

    def issue(self, path: str | None) -> str | None:
        """``path`` (either tier's) as a CheckpointPath that load_checkpoint reads through this root."""
        if path is None:
            return None
        fast = self.fast_root.storage.key_of(os.fspath(path)) is not None
        return issue(os.fspath(path), self.fast_storage_options if fast else self.storage_options, self)

    # ----- replication ---------------------------------------------------------------------------
    def _kick(self) -> None:
        """Ask the replicator thread for a pass (rank 0 only: the fast tier is shared)."""
        if _rank() != 0:
            return
        if self.max_pending is not None:
            self._check_lag()
        with self._cond:
            self._requested += 1
            if self._thread is None:
                # Not a daemon: an interpreter that exits waits for the pending replication.
                self._thread = threading.Thread(target=self._run, name="txckpt-replicator")
                self._thread.start()
            self._cond.notify_all()

    def _check_lag(self) -> None:
        """``max_pending``: warn once each time the checkpoints waiting for replication exceed it."""
        assert self.max_pending is not None
        with self._fold_lock:  # the hook runs in the committing thread (an async saver's too)
            self.lag = len(self._pending_known(self._fold_root, since=-1 if self._durable_seen else self._start_seq))
        if self.lag <= self.max_pending:
            self._lag_warned = False
        elif not self._lag_warned:
            self._lag_warned = True
            cause = (
                f"the durable tier is unreachable ({self.durable_unreachable})"
                if self.durable_unreachable
                else "replication is slower than saving"
            )
            log.warning(
                "replication of %s to %s lags: %d checkpoints committed on the fast tier are not durable "
                "yet (max_pending=%d): %s. Training goes on and the fast tier keeps every one of them, "
                "but losing this node now loses them. Check the durable tier, save less often, or call "
                "root.wait_durable() to let replication catch up",
                self.fast_root.url,
                self.durable_root.url,
                self.lag,
                self.max_pending,
                cause,
            )

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
                if isinstance(e, RemoteAccessError):
                    self.durable_unreachable = e
                log.warning(
                    "replicating %s to %s failed (the checkpoint stays committed on the "
                    "fast tier, which keeps it; the next save retries): %s",
                    self.fast_root.url,
                    self.durable_root.url,
                    e,
                )
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
                    raise TimeoutError(
                        f"replication of {self.fast_root.url} to {self.durable_root.url} "
                        f"did not finish within {timeout} s"
                    )
                if self._error is not None:
                    error, self._error = self._error, None
                    if isinstance(error, ReplicationError):
                        raise error
                    raise ReplicationError(
                        f"replication to {self.durable_root.url} failed: {error}", durable=self.durable_root.url
                    ) from error
        try:
            return self.replicate()  # anything left (a restart's backlog): now, on this thread
        except (RemoteAccessError, OSError) as e:
            raise ReplicationError(
                f"replication to {self.durable_root.url} failed: {e}; the fast tier "
                "keeps every checkpoint that is not durable",
                durable=self.durable_root.url,
            ) from e

    def pending(self) -> list[Checkpoint]:
        """The fast tier's committed checkpoints that are not durable yet, oldest first. While the
        durable tier is unreachable (:attr:`durable_unreachable` holds the error, and one warning
        says so) it answers from what this process knows: every fast checkpoint it has not seen
        committed on the durable tier."""

        def read() -> list[Checkpoint]:
            todo, done = tiered_copy.pending(self.fast_root, self.durable_root)
            self._learn_durable(done)
            return todo

        found = self._read_durable("pending() answers from what this process knows", read, None)
        return self._pending_known(self.fast_root) if found is None else found

    def _learn_durable(self, txids: set[str]) -> None:
        self._durable_txids |= txids
        self._durable_seen = True

    def _pending_known(self, fast: CheckpointRoot, since: int = -1) -> list[Checkpoint]:
        """The fast commits after log entry ``since`` this process has not seen durable (no durable
        read; the lag counts only its own commits until it has read the durable tier)."""
        fast_hist = tiered_copy.history_of(fast)
        return sorted(
            (
                c
                for c in fast_hist.checkpoints.values()
                if c.seq > since
                and c.txid not in self._durable_txids
                and c.txid not in fast_hist.retired
                and not c.adopted
            ),
            key=lambda c: c.seq,
        )

    def replicate(self) -> list[str]:
        """One replication pass, on this thread: every checkpoint :meth:`pending` lists, in
        fast-log order (so a checkpoint's parent, and the fork that made its lineage, are on
        the durable tier before it). Idempotent; returns the durable paths committed."""
        with self._lock:
            todo, done = tiered_copy.pending(self._source, self._target)
            self._learn_durable(done)
            fast_hist = self._source.history() if todo else History()
            out = []
            for c in todo:
                out.append(tiered_copy.replicate_one(self._source, self._target, c, fast_hist))
                self._durable_txids.add(c.txid)
            return out

    def restore(self) -> str | None:
        """Bring a fast tier that is behind the durable tier up to date (an empty one: a new
        node; or one whose lineage another node continued or left): the durable tier's newest
        checkpoint of its current lineage is copied (each file checked against the durable
        manifest) and committed on the fast tier under the same txid and lineage id, so that code
        reading the fast directory as a plain root (the Trainer) resumes from it locally.
        Returns its fast path; None if the fast tier is not behind. Call it on rank 0."""
        self._after_async_saves()
        _, dstate, why = self._sight()
        if why is None:
            return None
        assert dstate is not None and dstate.head_tip is not None
        self._follow(dstate)  # the lineage, under the durable tier's id
        claim(self.fast_root, self.fast_root.state())
        history = self.durable_root.history()
        tip = history.checkpoints[dstate.head_tip.txid]
        return tiered_copy.replicate_one(self.durable_root, self.fast_root, tip, history, hold=False)

    # ----- lookup and lineage ---------------------------------------------------------------------
    def get_last_checkpoint(self) -> str | None:
        """The newest checkpoint of the current lineage: the fast tier's while it is not behind
        the durable tier (its fast path while the fast tier holds its files, else its durable
        path), else the durable tier's current tip by its durable path."""
        self._after_async_saves()
        fstate, dstate, why = self._sight()
        if why is not None:
            assert dstate is not None and dstate.head_tip is not None
            return self.issue(self.durable_root.locate(dstate.head_tip))
        tip = fstate.head_tip
        if tip is None:
            if self.durable_unreachable is not None:
                raise self.durable_unreachable  # a new node's answer is on the durable tier alone
            return None
        key = self.fast_root.publication.locate(tip)
        if key is not None:
            return self.issue(self._fast_path(key))
        durable = self._read_durable(
            "the fast tier's newest checkpoint has no files and cannot be fetched",
            lambda: tiered_copy.history_of(self.durable_root).checkpoints.get(tip.txid),
            None,
        )
        return None if durable is None else self.issue(self.durable_root.locate(durable.ref))

    def _fast_path(self, key: str) -> str:
        return os.path.join(self.fast, *key.split("/"))

    def resume(
        self, step: int | None = None, *, path: str | os.PathLike | None = None, on_damaged: str = "raise"
    ) -> str | None:
        """:func:`txckpt.resume`: a restart continues the newest checkpoint of the current
        lineage (a fast tier that is behind the durable tier follows it first: its lineage, and
        its tip by its durable path). A rollback forks on the fast tier when the fast tier is up
        to date and holds the checkpoint (replication repeats the fork on the durable tier);
        else (a durable-only checkpoint, a new node, a stale fast tier) it forks on the durable
        tier, which the fast tier then follows. ``on_damaged="fallback"`` counts a checkpoint
        whose damaged fast files the durable tier restores as intact. Replication of what a
        previous process left pending starts here."""
        self._after_async_saves()
        fstate, dstate, why = self._sight()
        if why is not None:
            self._follow(dstate)
        if step is None and path is None:
            if why is not None and dstate is not None and dstate.head_tip is not None:
                found = self.durable_root.locate(dstate.head_tip)
            elif fstate.seq < 0:
                if self.durable_unreachable is not None:
                    raise self.durable_unreachable
                return None
            elif fstate.head_tip is None:
                found = self.get_last_checkpoint()
            else:
                found = self.fast_root.resume(
                    on_damaged=on_damaged, verify=self._repair_then_verify if on_damaged == "fallback" else None
                )
        elif why is None and self._fast_holds(step, path):
            found = self.fast_root.resume(step, path=path, on_damaged=on_damaged)
        else:
            found = self._rollback_on_durable(step, path)
        self._kick()
        return self.issue(found)

    def _fast_holds(self, step: int | None, path: str | os.PathLike | None) -> bool:
        """Does the fast tier's current view hold ``step`` (or is ``path`` on the fast tier)?"""
        fast = self.fast_root
        if path is not None:
            return fast.storage.key_of(os.fspath(path)) is not None
        if fast.state().seq < 0:
            return False
        try:
            fast.history().find(step=step)
        except CheckpointNotFoundError:
            return False
        return True

    def _rollback_on_durable(self, step: int | None, path: str | os.PathLike | None) -> str | None:
        """A rollback the fast tier cannot make: forked on the durable tier (which holds the
        checkpoint), then followed by the fast tier under the new lineage's id."""
        if path is not None and self.fast_root.storage.key_of(os.fspath(path)) is not None:
            path = self._durable_copy_of(path)
        found = self.durable_root.resume(step, path=path)
        self._follow(self.durable_root.state())
        return found

    def _durable_copy_of(self, path: str | os.PathLike) -> str:
        """The durable path of the fast-tier checkpoint at ``path`` (a rollback on a stale fast tier)."""
        c = self.fast_root._checkpoint_at_path(path, self.fast_root.history())
        durable = tiered_copy.history_of(self.durable_root).checkpoints.get(c.txid)
        where = None if durable is None else self.durable_root.locate(durable.ref)
        if where is None:
            raise CheckpointNotFoundError(
                f"{os.fspath(path)} is not durable on {self.durable_root.url}, whose lineage moved on "
                "since this fast tier saved it: roll back to a durable checkpoint (`txckpt ls "
                f"{self.fast} --durable {self.durable}`)"
            )
        return where

    def local_path(self, path: str | os.PathLike) -> str | None:
        """The fast-tier path of the checkpoint whose durable copy is at ``path``, if the fast
        tier holds it (after :meth:`restore`, the durable tip); else None."""
        key = self.durable_root.storage.key_of(os.fspath(path))
        if key is None or self.fast_root.state().seq < 0:
            return None
        txid = tiered_copy.read_manifest(self.durable_root, key).txid
        c = self.fast_root.history().checkpoints.get(txid)
        fkey = None if c is None else self.fast_root.publication.locate(c.ref)
        return None if fkey is None else self._fast_path(fkey)

    def _repair_then_verify(self, path: str) -> str:
        self.repair(path)
        reader.verify_checkpoint(path)
        return path

    def new_lineage(self, *, external_parent: str | os.PathLike | None = None) -> str:
        """:func:`txckpt.new_lineage` on the fast tier; replicated with the next checkpoint."""
        return self.fast_root.new_lineage(external_parent=external_parent)

    def apply_retention(self, policy: retention.RetentionPolicy, *, dry_run: bool = False) -> list[Any]:
        """:func:`txckpt.apply_retention` on the fast tier, keeping every checkpoint that is not
        durable yet whatever ``policy`` says (§14; during an outage, every one this process has
        not seen durable). The durable tier's retention is its own:
        ``txckpt.apply_retention(txckpt.open_root(durable_url), policy)``."""
        self._after_async_saves()
        return retention.apply_retention(self.fast_root, policy, dry_run=dry_run)  # guarded (__init__)

    # ----- loading --------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike | None = None, **kwargs: Any) -> dict[str, Any]:
        """:func:`txckpt.load_checkpoint` of ``path`` (default: :meth:`get_last_checkpoint`).
        A fast-tier checkpoint is read locally; if a file is missing or fails its checksum
        there, exactly those files are fetched from the durable tier's copy (same txid) into
        the fast tier (:attr:`last_fetched` says which, and how many bytes), then it is loaded.
        A durable path is read from the durable tier with its storage options."""
        self._after_async_saves()
        self.last_fetched = {}
        where = os.fspath(path) if path is not None else self.get_last_checkpoint()
        if where is None:
            raise CheckpointNotFoundError(f"{self!r} has no committed checkpoint to load")
        where = str(where)
        if self.fast_root.storage.key_of(where) is None:  # a durable path
            return reader.load(where, **{**_load_defaults(kwargs), "storage_options": self.storage_options})
        try:
            return reader.load(where, **_load_defaults(kwargs))
        except (IntegrityError, CheckpointNotFoundError, FileNotFoundError) as e:
            if not self.repair(where):
                raise
            log.warning(
                "%s was damaged on the fast tier (%s); restored %s from %s",
                where,
                e,
                ", ".join(sorted(self.last_fetched)),
                self.durable_root.url,
            )
        return reader.load(where, **_load_defaults(kwargs))

    def repair(self, path: str | os.PathLike) -> dict[str, int]:
        """Check every file of the fast-tier checkpoint at ``path`` and fetch from the durable
        tier exactly those that are missing or damaged (each written to a temporary file,
        checked, fsynced and renamed over the fast copy). Returns name -> bytes fetched ({} if
        every file verifies). Raises IntegrityError if a file verifies on neither tier."""
        self.last_fetched = tiered_copy.repair(self.fast_root, self.durable_root, path)
        return self.last_fetched


# ----- for writers and readers that take a root (txckpt.integrations.dcp) -----------------------
def save_target(
    root: "str | os.PathLike[str] | TieredRoot", step: int, storage_options: Mapping[str, Any] | None
) -> tuple[str, Mapping[str, Any] | None]:
    """(path, storage_options) that a writer given ``root`` saves ``step`` to: a TieredRoot's
    fast tier (its lineage continued first, §14; its commits wake the replicator), else ``root``."""
    if isinstance(root, TieredRoot):
        root._continue_durable_lineage(step)
        return root.fast, root.fast_storage_options or None
    return os.fspath(root), storage_options


def load_source(
    path: "str | os.PathLike[str] | TieredRoot", storage_options: Mapping[str, Any] | None
) -> tuple[str, Mapping[str, Any] | None]:
    """(path, storage_options) that a reader given ``path`` reads: a TieredRoot's newest
    checkpoint (its fast copy repaired from the durable tier first, or its durable copy), else
    ``path``."""
    if not isinstance(path, TieredRoot):
        return os.fspath(path), storage_options
    where = path.get_last_checkpoint()
    if where is None:
        raise CheckpointNotFoundError(f"{path!r} has no committed checkpoint to load")
    if path.fast_root.storage.key_of(where) is None:
        return str(where), path.storage_options or None
    path.repair(where)
    return str(where), path.fast_storage_options or None


def _load_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {
        "files": None,
        "map_location": "cpu",
        "weights_only": True,
        "verify": True,
        "mmap": False,
        "storage_options": None,
    }
    out.update(kwargs)
    return out


__all__ = ["TieredRoot", "save_target", "load_source"]
