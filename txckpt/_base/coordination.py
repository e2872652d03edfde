"""How the ranks of one job agree on a transaction.

Without an initialised torch.distributed process group everything is single-process, and this
module never imports torch.distributed (nor torch) itself. With one, a transaction needs three
collectives per save, whatever the world size:

* ``broadcast`` of the plan (staging name, txid, lineage, step) from the committing rank (0),
* ``gather_records`` of every rank's fixed-size record of its manifest part (56 bytes: the part
  that rank wrote holds its names, sizes and checksums; protocol §3a) to rank 0,
* ``broadcast`` of the outcome (committed path, or the reason for aborting) to every rank.

They run as object collectives on a dedicated gloo group on the CPU, whatever the default
backend is (NCCL object collectives need a CUDA device per rank and cannot time out cleanly).
The group is created lazily by the first :func:`current_coordinator` call of a process that sees
an initialised default group, which is ``Transaction.__enter__`` (or the Trainer integration's
resume) on every rank: ``new_group`` is itself a collective over the default group, so every
rank creates it at the same point of the program. It is created once per default group; each
transaction then sets its own timeout on it.

A rank that raises inside a transaction still takes part in the gather, carrying its error, so
every rank learns the same outcome. A rank that dies closes its gloo connections: the others'
next collective fails within milliseconds (measured: "Connection closed by peer" /
"Connection reset by peer"). A rank that is merely slow, hung, or on a host that vanished
without closing its sockets makes the others' collective time out after ``timeout`` seconds.
Either way they raise :class:`~txckpt.errors.CoordinationTimeoutError`, never hang. The timeout
bounds each wait: in the gather it is how long the first rank to finish writing waits for the
last one, so it must exceed the spread of the ranks' write times. ``timeout=`` of
``txckpt.transaction``, else ``TXCKPT_COORDINATION_TIMEOUT`` (seconds), else 600.

After a coordination failure the group is discarded (gloo closes a pair for good after an
error); the next transaction of a rank that saw the failure creates a new one. A failure of
this kind normally means the job lost a rank and has to be restarted anyway.
"""

from __future__ import annotations

import abc
import atexit
import logging
import os
import sys
import threading
from datetime import timedelta
from typing import Any, Callable, TypeVar

from . import deps
from ..errors import (
    CoordinationTimeoutError,
    InvalidArgumentError,
    TransactionAbortedError,
    decode_error,
    encode_error,
)

T = TypeVar("T")

log = logging.getLogger("txckpt")

TIMEOUT_ENV = "TXCKPT_COORDINATION_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0


def coordination_timeout(timeout_s: float | None = None) -> float:
    """The timeout in seconds: ``timeout_s``, else ``$TXCKPT_COORDINATION_TIMEOUT``, else 600."""
    source = "timeout"
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        source = TIMEOUT_ENV
        try:
            timeout_s = float(text)
        except ValueError:
            raise InvalidArgumentError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{source} must be a number of seconds, not {timeout_s!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise InvalidArgumentError(f"{source} must be a positive, finite number of seconds, not {timeout_s!r}")
    return value


class Coordinator(abc.ABC):
    """The collectives a transaction needs. Rank 0 commits."""

    rank: int = 0
    world_size: int = 1
    #: What the ranks are doing (``"resume"``, ``"save plan"``...): a CoordinationTimeoutError's
    #: ``.phase``. None: the collective's own name.
    phase: str | None = None

    @property
    def is_committer(self) -> bool:
        return self.rank == 0

    @abc.abstractmethod
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    @abc.abstractmethod
    def gather(self, obj: Any) -> list[Any] | None:
        """On rank 0, every rank's ``obj`` in rank order; None on other ranks."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return when every rank has called it."""

    def gather_records(self, record: bytes) -> list[bytes] | None:
        """On rank 0, every rank's ``record`` (the same length on every rank) in rank order; None
        on other ranks. A tensor gather, not a pickled object: rank 0 receives exactly
        ``len(record)`` bytes per rank (the per-rank manifest parts' reports, protocol §3a).
        A coordinator without a tensor gather sends the record as an object."""
        return self.gather(bytes(record))


class SingleProcess(Coordinator):
    """The coordinator of a process that saves alone: rank 0 of a world of 1, no collectives.
    The default without a process group; inside one, ``open_root(root).transaction(step,
    coordinator=SingleProcess())`` saves from one rank only, outside the job's checkpoint
    (docs/distributed.md, "Rules for callers")."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        return None


class GatheredElsewhere(Coordinator):
    """The committer of ranks that another library gathers (torch.distributed.checkpoint's own
    collectives, :meth:`txckpt._save.transactions.Transaction.begin_external`): it knows the group's
    size, which the manifest records, and makes no collective of its own."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def broadcast(self, obj: Any) -> Any:  # pragma: no cover - never called: the other library gathers
        raise InvalidArgumentError("no txckpt collective in a save that another library coordinates")

    def gather(self, obj: Any) -> list[Any] | None:  # pragma: no cover
        return self.broadcast(obj)

    def barrier(self) -> None:  # pragma: no cover
        self.broadcast(None)


# The gloo group txckpt uses, and the default group it was made for. Guarded by _lock.
_lock = threading.Lock()
_cached: dict[str, Any] = {}
#: Whether _release_group_at_exit is registered (once, when the first group is made: after
#: torch.distributed's own exit handlers, so it runs before them).
_exit_hook_registered = False


def _default_group(dist: Any) -> Any:
    return dist.distributed_c10d._get_default_group()


def _group_for(dist: Any, timeout_s: float, phase: str | None = None) -> Any:
    """txckpt's gloo group for the current default group, created on first use."""
    global _exit_hook_registered
    world = _default_group(dist)
    td = timedelta(seconds=timeout_s)
    with _lock:
        if _cached.get("world") is world and _cached.get("group") is not None:
            group = _cached["group"]
            if _cached.get("timeout") != timeout_s:
                try:
                    dist.distributed_c10d._set_pg_timeout(td, group)
                    _cached["timeout"] = timeout_s
                except Exception as e:  # pragma: no cover - a torch without _set_pg_timeout
                    log.warning(
                        "cannot change the coordination timeout of an existing gloo group (%s); it stays %.0f s",
                        e,
                        _cached.get("timeout"),
                    )
            return group
        if not dist.is_gloo_available():  # pragma: no cover - every torch wheel has gloo
            raise TransactionAbortedError(
                "txckpt coordinates ranks over a gloo group, and this torch build has no gloo"
            )
        try:
            # "cpu:gloo": a group with only a CPU backend, so object collectives stay on the CPU
            # even in a CUDA build (plain "gloo" registers for cuda too).
            group = dist.new_group(backend="cpu:gloo", timeout=td)
        except Exception as e:
            raise CoordinationTimeoutError(
                f"txckpt: {'' if phase is None else phase + ': '}creating its gloo group over "
                f"{dist.get_world_size()} ranks failed on rank "
                f"{dist.get_rank()}: {_short(e)}. Every rank must enter the same txckpt transaction "
                f"(or call the same txckpt function) within {timeout_s:.0f} s of the others; another "
                "rank died, raised before reaching it, or is slower than the timeout (set "
                f"{TIMEOUT_ENV} or timeout=). Nothing was committed.",
                phase=phase or "group creation",
            ) from e
        if not _exit_hook_registered:
            atexit.register(_release_group_at_exit)
            _exit_hook_registered = True
        _cached.update(world=world, group=group, timeout=timeout_s)
        return group


def _release_group_at_exit() -> None:
    """Destroy txckpt's gloo group while the interpreter is still whole. Left to interpreter
    teardown (this module's reference outlives even the job's own destroy_process_group), its
    C++ threads can be destroyed while joinable: std::terminate, a SIGABRT after a clean run
    (seen in the 2-rank Trainer test)."""
    with _lock:
        group = _cached.get("group")
        _cached.clear()
    if group is None:
        return
    try:
        dist = deps.torch_distributed
        if dist.is_initialized():
            dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - exiting anyway; the reference is dropped above
        pass


def _forget_group(group: Any) -> None:
    with _lock:
        if _cached.get("group") is group:
            _cached.clear()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # gloo prefixes messages with its source location: keep the part a user can act on.
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(" This is typically caused by")[0].rstrip(". ")
    return text[:400]


class TorchDistributed(Coordinator):
    """Object collectives over txckpt's gloo group (CPU), whatever the default backend is."""

    def __init__(self, timeout_s: float | None = None, phase: str | None = None, *, group: Any = None):
        """``group``: a gloo group to run on (an asynchronous save's own, txckpt/_async/asyncsave.py);
        default: txckpt's group for the current default group, created on first use."""
        dist = deps.torch_distributed
        self._dist = dist
        self.timeout_s = coordination_timeout(timeout_s)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.phase = phase
        self.group = _group_for(dist, self.timeout_s, phase) if group is None else group
        self._gathered = False

    def _fail(self, what: str, e: BaseException, committed_path: str | None = None) -> CoordinationTimeoutError:
        _forget_group(self.group)
        if not self._gathered and what != "gather":
            outcome = "Nothing was committed by this transaction."
        elif what == "gather":
            outcome = "Rank 0 did not get every rank's file list, so nothing was committed by this transaction."
        elif self.rank == 0:
            outcome = (
                f"The checkpoint WAS committed ({committed_path}), but not every rank could be told."
                if committed_path
                else "Nothing was committed by this transaction, and not every rank could be told."
            )
        else:
            outcome = (
                "Rank 0 may have committed before it failed: call txckpt.get_last_checkpoint(root) "
                "to see which checkpoint is the newest."
            )
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        cause = (
            f"another rank did not arrive within the timeout ({self.timeout_s:.0f} s; set "
            f"{TIMEOUT_ENV} or timeout=): it is slow, hung, or unreachable"
            if timed_out
            else "another rank died or closed its connection"
        )
        phase = self.phase or what
        return CoordinationTimeoutError(
            f"txckpt: {what}{'' if phase == what else f' ({phase})'} across {self.world_size} ranks "
            f"failed on rank {self.rank}: {cause} ({_short(e)}). {outcome}",
            phase=phase,
        )

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        try:
            self._dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as e:
            path = obj.get("path") if self.rank == 0 and self._gathered and isinstance(obj, dict) else None
            raise self._fail("broadcast", e, path) from e
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            self._dist.gather_object(obj, out, dst=0, group=self.group)
        except Exception as e:
            raise self._fail("gather", e) from e
        self._gathered = True
        return out

    def barrier(self) -> None:
        try:
            self._dist.barrier(group=self.group)
        except Exception as e:
            raise self._fail("barrier", e) from e

    def gather_records(self, record: bytes) -> list[bytes] | None:
        torch = deps.torch
        mine = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            self._dist.gather(mine, out, dst=0, group=self.group)
        except Exception as e:
            raise self._fail("gather", e) from e
        self._gathered = True
        return None if out is None else [t.numpy().tobytes() for t in out]


def current_coordinator(timeout_s: float | None = None, phase: str | None = None) -> Coordinator:
    """TorchDistributed inside an initialised process group of more than one rank, else
    SingleProcess.

    torch.distributed is looked at only if it is already imported (``import torch`` imports it;
    a process group cannot exist otherwise), so a process that never imported torch does not
    import it here. Every
    rank must call this at the same point: the first call in a process group creates txckpt's
    gloo group, a collective. ``phase``: what a failure to create it is reported as.
    """
    dist = sys.modules.get("torch.distributed")  # a look-up, never an import
    if dist is None:
        return SingleProcess()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributed(timeout_s, phase)
    return SingleProcess()


def decide_on_rank0(
    fn: Callable[[], T], *, phase: str, coordinator: Coordinator | None = None, timeout: float | None = None
) -> T:
    """Rank 0 runs ``fn`` and every rank returns its result, or raises its error: rank 0 its own
    exception, the others the same class with the same message and fields (the codec of
    :mod:`txckpt.errors`; an error of another library arrives as its nearest builtin class).
    One broadcast; no other rank runs ``fn``. Every rank must call it at the same point.

    ``phase`` names the decision (``"resume"``, ``"save plan"``): a failed or timed-out
    broadcast raises CoordinationTimeoutError with that ``.phase``, and the others' copy of
    rank 0's error carries a note saying where it came from. ``coordinator``: the one to use
    (default: :func:`current_coordinator` with ``timeout``). Alone (one rank) it is ``fn()``.
    """
    coord = coordinator if coordinator is not None else current_coordinator(timeout, phase)
    if coord.world_size == 1:
        return fn()
    own: BaseException | None = None
    outcome: dict[str, Any] | None = None
    if coord.rank == 0:
        try:
            outcome = {"ok": fn()}
        except BaseException as e:  # noqa: BLE001 - every rank must learn it, or wait for the timeout
            own, outcome = e, {"error": encode_error(e, rank=0)}
    previous, coord.phase = coord.phase, phase
    try:
        outcome = coord.broadcast(outcome)
    finally:
        coord.phase = previous
    if own is not None:
        raise own
    if not isinstance(outcome, dict) or not ("ok" in outcome or "error" in outcome):
        # Never expected: a collective mismatch (the ranks called txckpt in different orders).
        raise TransactionAbortedError(
            f"txckpt: rank {coord.rank} got {outcome!r} from rank 0 instead of its {phase} decision"
        )
    if "error" in outcome:
        err = decode_error(outcome["error"])
        _add_note(err, f"(raised on rank 0, which decides txckpt's {phase}; every rank raises it)")
        raise err
    return outcome["ok"]


def raise_if_any_failed(own: BaseException | None, *, phase: str, coordinator: Coordinator) -> None:
    """Every rank calls it with what it raised in ``phase`` (None: nothing); if any rank failed,
    every rank raises: a failed rank its own exception, the others the lowest failed rank's
    error (same class, message and fields: the codec of :mod:`txckpt.errors`). A gather and a
    broadcast; alone, ``own`` is raised if set."""
    coord = coordinator
    if coord.world_size == 1:
        if own is not None:
            raise own
        return
    report = None if own is None else encode_error(own, rank=coord.rank)
    previous, coord.phase = coord.phase, phase
    try:
        reports = coord.gather(report)
        verdict = coord.broadcast(next((r for r in reports or [] if r), None))
    finally:
        coord.phase = previous
    if own is not None:
        raise own
    if verdict is not None:
        err = decode_error(verdict)
        _add_note(err, f"(raised on rank {verdict.get('rank')} in txckpt's {phase}; every rank raises it)")
        raise err


def decide_once(fn: Callable[[], T], collective: bool | None, phase: str = "lineage change") -> T:
    """Run a lineage change (or lookup) once per job: on rank 0, with the result broadcast to
    every rank. ``collective=None`` means "if a torch.distributed group is initialised, every
    rank calls this"; ``False`` means only this process calls it (e.g. a caller that already
    runs it on rank 0 alone and broadcasts the answer itself)."""
    return decide_on_rank0(fn, phase=phase, coordinator=SingleProcess() if collective is False else None)


__all__ = [
    "Coordinator",
    "SingleProcess",
    "TorchDistributed",
    "current_coordinator",
    "coordination_timeout",
    "decide_on_rank0",
    "decide_once",
    "raise_if_any_failed",
    "TIMEOUT_ENV",
]


def _add_note(err: BaseException, note: str) -> None:
    # BaseException.add_note is Python 3.11+; on 3.10 (which txckpt supports) the error goes
    # without the note rather than failing with an AttributeError in its place.
    add = getattr(err, "add_note", None)
    if add is not None:
        add(note)
