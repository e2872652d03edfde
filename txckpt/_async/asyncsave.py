"""Asynchronous saves: ``async_save`` snapshots the state and returns; a background thread runs
the ordinary save (the same transaction as ``save_checkpoint``: staging, manifest, one log
entry, publication) from the snapshot. docs/async.md states the guarantees.

One saver per root and process (keyed as the root cache keys roots). It keeps the snapshot
buffers (txckpt/_async/snapshot.py) and the one save in flight: a second ``async_save`` of the same
root waits for the previous save to finish before it snapshots into the same buffers, so saves
commit in the order they were requested, and the state is never held more than once.

Lazy snapshots (``async_save(..., optimizer=)``, the Trainer's ``txckpt_async_save=True``):
parameters and optimizer state change only in the optimizer's step, so the call copies
everything else and the background copies those (``LazySnapshot``) before it writes; the
optimizer's next step waits, in a step pre-hook, until that copy is done. The loop is blocked
for the small part and for whatever of the copy its forward and backward did not hide.

Multi-rank: the background save's collectives run on a gloo group of the asynchronous saves'
own, created once per default group by the first ``async_save`` (in the caller's thread, where
every rank calls it at the same point: ``new_group`` is a collective on the default group). The
background thread then never touches the default group nor the group synchronous txckpt calls
use, so a training job's own collectives may run while a save is in the background. A caller
that saves from one rank alone (Lightning's CheckpointIO, called on global rank 0 only) submits
with ``alone=True``: no group, a ``SingleProcess`` coordinator.

Errors and exit: an error is reported once: retrieved through its future (``SaveFuture``), raised
by ``wait_for_saves`` or by the Trainer, or else logged by the exit hook, which then makes the exit
status 120 (``_ExitStatus``). Once that hook has begun, ``async_save`` saves in its caller's thread
(``_run_at_shutdown``): nothing handed to a worker then would be waited for or reported.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import copy
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping, Sequence

from .._base import deps
from .._base.coordination import Coordinator, SingleProcess, TorchDistributed, coordination_timeout
from ..errors import CoordinationTimeoutError, InvalidArgumentError
from .._root.root import open_root
from .._log.identity import root_key
from .snapshot import SnapshotPool

log = logging.getLogger("txckpt")


class _Saver:
    """One root's snapshot buffers and its save in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held from the wait for the previous save to the hand-off
        self.pool = SnapshotPool()
        #: A lazy snapshot's first half (what is copied in the caller's thread); ``pool`` then
        #: holds the second (the optimizers' tensors, copied in the background).
        self.eager = SnapshotPool()
        #: The previous save's run in the worker (done: its buffers are free again).
        self.running: Future | None = None
        #: One worker thread, kept between saves: handing a save to a waiting thread costs no
        #: thread start inside the time async_save blocks. Its exit hook (concurrent.futures')
        #: finishes queued saves at interpreter exit.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="txckpt-async-save")
        self.worker_ident: int | None = None

    def wait(self) -> None:
        if self.running is not None and threading.get_ident() != self.worker_ident:
            self.running.result()  # run() never raises: its future carries the error


class SaveFuture(Future):
    """An async save's future. Its error is *retrieved* once ``result()`` has raised it or
    ``exception()`` has returned it (a call that timed out retrieved nothing), as
    concurrent.futures and asyncio count it: a retrieved error is handled, so neither
    wait_for_saves nor the exit hook reports it again. ``root`` and ``step``: what it saves (step
    None for a :func:`submit` that did not say); ``submitted``: ``time.monotonic()`` at the
    request (txckpt/preemption.py reports the saves of a shutdown by them)."""

    root: str | None = None
    step: int | None = None
    submitted: float = 0.0

    def result(self, timeout: float | None = None) -> Any:
        Future.exception(self, timeout)  # waits; TimeoutError here: nothing was retrieved
        mark_reported(self)
        return Future.result(self)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        e = Future.exception(self, timeout)
        mark_reported(self)
        return e


_lock = threading.Lock()
_savers: dict[tuple[Any, ...], _Saver] = {}
#: Every async save's future, in request order, until wait_for_saves has reported it.
_futures: list[Future] = []
_group: dict[str, Any] = {}  # {"world": default group, "group": the async saves' gloo group}
_exit_hook: list[bool] = []
#: Set once the interpreter is shutting down for txckpt (its exit hook has begun, or threading
#: refused to register it): from then on async_save saves in the caller's thread.
_shutting_down = threading.Event()
#: The exit status at interpreter exit when a failed save's error was never retrieved.
UNRETRIEVED_EXIT_STATUS = 120


class _StepGate:
    """The step pre-hook of one optimizer: each step first waits for the background copies of
    the lazy snapshots that hold the optimizer's tensors. ``waits``: the seconds the latest
    steps that had a copy to wait for waited (what a lazy save blocked the loop for after its
    call returned; the benchmarks read it).

    A copy held ``after_closure`` (the Lightning plugin's lazy mode) is waited for inside the
    step's closure, after it returns: Lightning's automatic optimization runs the forward and
    backward in the closure ``step()`` calls, so a wait before it would hide nothing. Torch's
    optimizers call the closure before they change anything; a step without a closure waits
    first, as for any other copy."""

    def __init__(self, optimizer: Any):
        self._lock = threading.Lock()
        self._pending: list[tuple[threading.Event, bool]] = []
        self.waits: "collections.deque[float]" = collections.deque(maxlen=1024)
        optimizer.register_step_pre_hook(self._before_step)

    def hold(self, copied: threading.Event, after_closure: bool = False) -> None:
        with self._lock:
            self._pending.append((copied, after_closure))

    def forget(self) -> None:
        """Drop what the next step would wait for (a forked child: nobody will set it). A
        fresh lock too: the parent's may have been held by one of its threads at the fork."""
        self._lock = threading.Lock()
        self._pending = []

    def _wait(self, events: list[threading.Event]) -> None:
        if events:
            t0 = time.perf_counter()
            for copied in events:
                copied.wait()
            self.waits.append(time.perf_counter() - t0)

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            pending, self._pending = self._pending, []
        # torch passes the step's own arguments with the optimizer first: (self, closure?).
        closure: Any = kwargs.get("closure", args[1] if len(args) > 1 else None)
        later = [e for e, after in pending if after and callable(closure)]
        self._wait([e for e, after in pending if not (after and callable(closure))])
        if not later:
            return None

        def closure_then_wait() -> Any:
            try:
                return closure()
            finally:
                self._wait(later)
                later.clear()  # LBFGS calls its closure again: those waits are done

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs


_gates: "weakref.WeakKeyDictionary[Any, _StepGate]" = weakref.WeakKeyDictionary()


def step_gate(optimizer: Any) -> _StepGate:
    """``optimizer``'s gate (its step pre-hook registered on first use)."""
    with _lock:
        gate = _gates.get(optimizer)
        if gate is None:
            gate = _gates[optimizer] = _StepGate(optimizer)
        return gate


def torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` that steps: ``optimizer`` itself, or the one a wrapper
    (accelerate's AcceleratedOptimizer, DeepSpeed's) holds as ``.optimizer``."""
    inner = optimizer
    for _ in range(4):  # unwrap first: accelerate's wrapper is itself an Optimizer subclass
        held = getattr(inner, "optimizer", None)
        if held is None or held is inner or not hasattr(held, "param_groups"):
            break
        inner = held
    if isinstance(inner, deps.torch.optim.Optimizer):
        return inner
    raise InvalidArgumentError(
        f"optimizer= takes the torch.optim.Optimizer whose step() changes the saved parameters "
        f"(or a wrapper holding it as .optimizer), not {type(optimizer).__name__}"
    )


class LazySnapshot:
    """A snapshot in two halves, for state whose parameters and optimizer state change only in
    the optimizers' ``step()``.

    Made in the caller's thread (``__init__``): every tensor of ``files`` but those on the
    optimizers' parameters and state (and ``params``) is copied into ``eager``, as a copy-first
    snapshot would; those are kept live, with their version counters, and each optimizer's
    step pre-hook (:func:`step_gate`) will wait for :attr:`copied`. The background then calls
    :meth:`take` once, before it writes: it copies the live tensors, checks that none was
    changed in place since the call (the counters; a change made through ``.data`` bypasses
    them, so this catches most misuse, not all), and sets :attr:`copied`, which lets the step
    go on. :meth:`release` sets it where the background will never run (its hand-off failed).

    CUDA tensors are always in the first half: they are copied to pinned host buffers before
    the call returns (txckpt/_async/snapshot.py)."""

    def __init__(
        self,
        eager: SnapshotPool,
        files: Mapping[str, Any],
        optimizers: Sequence[Any],
        params: Iterable[Any] = (),
        remedy: str = "saves without optimizer=, which copies everything before it returns",
        after_closure: bool = False,
    ):
        self._remedy = remedy
        inners = [torch_optimizer(o) for o in optimizers]
        tensors = [p for o in inners for g in o.param_groups for p in g["params"]]
        tensors += [v for o in inners for st in o.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
        tensors += list(params)
        cpu = {id(t): t for t in tensors if t.device.type == "cpu"}
        self._versions = [(t, t._version) for t in cpu.values()]
        self.live = frozenset(t.untyped_storage().data_ptr() for t in cpu.values())
        self.files = eager.snapshot(files, live=self.live)
        self.copied = threading.Event()
        for o in inners:
            step_gate(o).hold(self.copied, after_closure)

    def take(self, pool: SnapshotPool) -> dict[str, Any]:
        """The whole snapshot: the live tensors copied into ``pool`` (background thread)."""
        try:
            snapshot = pool.snapshot(self.files, only=self.live)
            changed = [t for t, v in self._versions if t._version != v]
            if changed:
                t = changed[0]
                raise InvalidArgumentError(
                    f"nothing was saved: {len(changed)} of the optimizer's parameter and state tensors "
                    f"(the first: {tuple(t.shape)} {t.dtype}) were changed in place after async_save(..., "
                    "optimizer=) returned and before the background copied them. With optimizer=, only "
                    "optimizer.step() may change them until then (it waits for the copy); a loop that "
                    f"changes them elsewhere (an EMA, clipping weights) {self._remedy}"
                )
            return snapshot
        finally:
            self.copied.set()  # a failed copy is the future's error: the step must not hang on it

    def release(self) -> None:
        self.copied.set()


def async_save(
    root: str | os.PathLike,
    step: int,
    files: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    optimizer: Any = None,
    incremental: bool = False,
) -> "Future[str]":
    """Save ``files`` as checkpoint ``step`` in the background; see :func:`txckpt.save_checkpoint`
    for ``files`` and what is saved.

    Returns once the state has been snapshotted: from then on the caller may mutate or free
    every object it passed. ``future.result()`` is the committed checkpoint's path, what
    ``save_checkpoint`` returns; a failure of the save is the future's exception, the same typed
    error ``save_checkpoint`` raises. A save of the same root still in flight is waited for
    first (one save in flight per root and process; the time this call blocks includes that
    wait). Invalid arguments and a state that cannot be snapshotted raise here, before anything
    is saved. Inside a torch.distributed group every rank calls it, like ``save_checkpoint``.

    ``optimizer`` (one ``torch.optim.Optimizer`` or a list): a lazy snapshot. The optimizers'
    parameters and state (on the CPU) are not copied before this returns but by the background,
    before it writes, and each optimizer's next ``step()`` waits until they are: the caller may
    run its forward and backward meanwhile, and must not change those tensors other than
    through ``step()`` before it (an in-place change the background sees fails the save with
    InvalidArgumentError; docs/async.md, "Lazy snapshots"). Everything else is copied before
    this returns, as without it.

    ``incremental=True``: unchanged files are shared, not written (as :func:`txckpt.save_checkpoint`);
    the background decides, from the snapshot.
    """
    if not isinstance(files, Mapping) or not files:
        raise InvalidArgumentError("files must be a non-empty dict of file name -> object")
    so = dict(storage_options) if storage_options is not None else None
    optimizers: list[Any] = (
        [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    )
    for o in optimizers:
        torch_optimizer(o)  # a wrong argument raises before anything is saved

    def prepare(pool: SnapshotPool, eager: SnapshotPool) -> Job:
        meta = copy.deepcopy(dict(metadata or {}))  # plain data, small: not pooled
        if not optimizers:
            snapshot = pool.snapshot(files)
            return Job(
                lambda coordinator: open_root(root, so).save(
                    step, snapshot, metadata=meta, coordinator=coordinator, incremental=incremental
                )
            )
        lazy = LazySnapshot(eager, files, optimizers)

        def run(coordinator: Coordinator) -> str:
            snapshot = lazy.take(pool)  # first: the optimizers' next step waits for it
            return open_root(root, so).save(
                step, snapshot, metadata=meta, coordinator=coordinator, incremental=incremental
            )

        return Job(run, lazy)

    return submit(root, storage_options, prepare, step=step)


class Job:
    """What :func:`submit`'s ``prepare`` returns: ``run(coordinator)``, the background work, and
    the lazy snapshot it completes (None: copied before the call returned), released if the
    hand-off to the worker fails."""

    def __init__(self, run: Callable[[Coordinator], Any], lazy: LazySnapshot | None = None):
        self.run, self.lazy = run, lazy


def submit(
    root: str | os.PathLike,
    storage_options: Mapping[str, Any] | None,
    prepare: "Callable[[SnapshotPool, SnapshotPool], Job]",
    *,
    step: int | None = None,
    alone: bool = False,
) -> Future:
    """The machinery of :func:`async_save` for a caller that snapshots its own state (the
    Trainer integration, whose files are written by upstream code): wait for the root's save in
    flight, then, in the caller's thread, ``prepare(pool, eager)`` snapshots into the root's
    reused buffers (``eager``: a lazy snapshot's first half) and returns the :class:`Job`;
    ``job.run(coordinator)`` then runs on the root's worker thread with the coordinator of the
    async saves' own group (a Transaction takes it), and its result or error is the future's.
    ``alone=True``: this process saves by itself, inside a process group or not (Lightning
    calls its CheckpointIO on global rank 0 only): the job runs with ``SingleProcess()``, and no
    group is created, since creating one is a collective the other ranks would never join.
    Every guarantee of async_save (one in flight per root, step order, wait_for_saves, finished
    at exit) holds for it. An error of ``prepare`` is raised here."""
    key = root_key(root, storage_options)
    with _lock:
        saver = _savers.get(key)
        if saver is None:
            saver = _savers[key] = _Saver()
        _register_exit_hook()
    with saver.lock:
        saver.wait()  # the previous save: its buffers are reused below
        coordinator = SingleProcess() if alone else _coordinator()
        job = prepare(saver.pool, saver.eager)
        future = SaveFuture()
        future.root, future.step, future.submitted = os.fspath(root), step, time.monotonic()
        future.set_running_or_notify_cancel()  # it runs from now on: cancel() is refused
        claimed = threading.Lock()  # run once, by the worker or by the caller, never by both

        def run() -> None:
            if not claimed.acquire(blocking=False):
                return
            saver.worker_ident = threading.get_ident()
            try:
                result = job.run(coordinator)
            except BaseException as e:  # noqa: BLE001 - the future carries it to the caller
                if isinstance(e, CoordinationTimeoutError):
                    _discard_group(coordinator)
                future.set_exception(e)
            else:
                future.set_result(result)
            finally:
                saver.worker_ident = None
                if job.lazy is not None:  # a job that failed before its copy: never hang the step
                    job.lazy.release()

        with _lock:
            # Saves that succeeded have nothing left to report: only errors wait for
            # wait_for_saves (a long run that never calls it holds no list of every save).
            _futures[:] = [f for f in _futures if not f.done() or Future.exception(f) is not None]
            _futures.append(future)
            # Under _lock: the exit hook either sees this future (and waits for it) or has
            # begun, and then nobody would wait for the worker or report its error.
            inline = _shutting_down.is_set()
            if not inline:
                try:
                    saver.running = saver.worker.submit(run)
                except RuntimeError:  # concurrent.futures' exit hook ran: an atexit handler
                    inline = True
            if inline:
                here: Future = Future()  # what other callers of this root wait for
                saver.running = here
    if inline:
        _run_at_shutdown(here, run, future)
    return future


def _run_at_shutdown(running: Future, run: Callable[[], None], future: SaveFuture) -> None:
    """At interpreter shutdown nothing may be left to a background thread (the interpreter
    joins no thread started now, and no exit hook is left to report an error): the save runs
    in the caller's thread, committed before async_save returns, and its error raises here, as
    save_checkpoint's does."""
    running.set_running_or_notify_cancel()
    try:
        run()
    finally:
        running.set_result(None)
    e = Future.exception(future)
    if e is not None:
        mark_reported(future)  # raised here: not again by wait_for_saves nor the exit hook
        raise e


def wait_for_saves() -> None:
    """Block until every pending async save of this process has finished; raise the first error
    not yet reported among the saves that finished since the last call (each error is reported
    once: raised here, or retrieved through its future's ``result()`` or ``exception()``; any
    further one stays on its future)."""
    with _lock:
        futures = list(_futures)
    concurrent.futures.wait(futures)  # retrieves nothing
    with _lock:
        unreported = [f for f in futures if f in _futures]
        for f in unreported:
            _futures.remove(f)
    for f in unreported:
        e = Future.exception(f)
        if e is not None:
            raise e


def mark_reported(future: Future) -> None:
    """``future``'s outcome was reported by its caller (the Trainer raised its error; its
    ``result()`` or ``exception()`` was called): take it off what wait_for_saves and the exit
    hook report, so no error is raised or logged twice."""
    with _lock:
        if future in _futures:
            _futures.remove(future)


def wait_for_root(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """Wait for the save in flight of ``root`` (if any), without raising its error (its future
    and wait_for_saves have it). Called by the synchronous API before it reads or changes the
    root's state, which the background save is changing."""
    with _lock:
        # No saver in this process (it never saved asynchronously): nothing to wait for, and no
        # need to tell which root ``root`` is.
        saver = _savers.get(root_key(root, storage_options)) if _savers else None
    if saver is None:
        return
    with saver.lock:
        saver.wait()


def release_buffers(root: str | os.PathLike | None = None, storage_options: Mapping[str, Any] | None = None) -> None:
    """Free the snapshot buffers of ``root`` (None: of every root) once its pending save has
    finished (the end of a training run, a benchmark between sizes); the next async_save of
    that root allocates them again."""
    with _lock:
        keys = [k for k in _savers if root is None or k == root_key(root, storage_options)]
        savers = [_savers.pop(k) for k in keys]
    for saver in savers:
        with saver.lock:
            saver.wait()
            saver.pool.clear()
            saver.eager.clear()
        saver.worker.shutdown(wait=True)


def pending_saves() -> int:
    """How many async saves of this process have not finished yet."""
    with _lock:
        return sum(1 for f in _futures if not f.done())


def recent_saves() -> list[SaveFuture]:
    """This process's async saves not finished yet, and those finished since the latest request
    that wait_for_saves (or their caller) has not reported, in request order: the latest request
    is always among them until reported. Nothing is waited for or retrieved."""
    with _lock:
        return [f for f in _futures if isinstance(f, SaveFuture)]


def _coordinator() -> Coordinator:
    """The background save's coordinator: alone, SingleProcess; inside a process group of more
    than one rank, one on the async saves' own gloo group (created here, in the caller's thread,
    on first use)."""
    if "torch" not in sys.modules:
        return SingleProcess()
    dist = deps.torch_distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return SingleProcess()
    timeout_s = coordination_timeout()
    world = dist.distributed_c10d._get_default_group()
    with _lock:
        group = _group.get("group") if _group.get("world") is world else None
    if group is None:
        try:
            group = dist.new_group(backend="cpu:gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as e:
            raise CoordinationTimeoutError(
                f"txckpt.async_save: creating its gloo group over {dist.get_world_size()} ranks failed on "
                f"rank {dist.get_rank()}: {e}. Every rank must call async_save at the same point of the "
                "program; another rank died or is slower than the timeout. Nothing was saved.",
                phase="group creation",
            ) from e
        with _lock:
            _group.update(world=world, group=group)
    return TorchDistributed(timeout_s, phase=None, group=group)


def _discard_group(coordinator: Coordinator) -> None:
    # gloo closes a pair for good after an error: the next async_save makes a new group (as
    # coordination.py does for its own).
    with _lock:
        if _group.get("group") is getattr(coordinator, "group", None):
            _group.clear()


def _forget_after_fork() -> None:
    # A forked child has none of its parent's threads: its saves are its own, and no background
    # will copy the parent's lazy snapshots there, so its optimizers' steps must not wait for them.
    _savers.clear()
    _futures.clear()
    _group.clear()
    for gate in list(_gates.values()):
        gate.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _register_exit_hook() -> None:
    """Finish pending saves at normal interpreter exit. threading's exit hooks run before the
    interpreter joins its threads and before atexit handlers (torch.distributed's among them),
    so a multi-rank save's group is still there; plain atexit where that hook is missing.
    Refused because threading's exit hooks are already running: the interpreter is shutting
    down, and every save from now on runs in its caller's thread."""
    if _exit_hook:
        return
    _exit_hook.append(True)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_finish_at_exit)
            return
        except RuntimeError:  # "can't register atexit after shutdown"
            _shutting_down.set()
            return
    atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    with _lock:
        _shutting_down.set()  # a save requested from now on runs in its caller's thread
        futures = list(_futures)
    concurrent.futures.wait(futures)
    with _lock:
        failed = [f for f in futures if f in _futures and Future.exception(f) is not None]
        for f in futures:
            if f in _futures:
                _futures.remove(f)
    for f in failed:
        e = Future.exception(f)
        log.error(
            "txckpt: an async save failed and was never waited for (its error was not retrieved by "
            "future.result(), future.exception() or txckpt.wait_for_saves()): %s: %s",
            type(e).__name__,
            e,
        )
    if failed:
        _fail_exit_status(len(failed))


class _ExitStatus:
    """sys.stdout (or sys.stderr) as it was, but the interpreter's final flush of it fails once,
    which makes the process exit with status 120 (CPython: "if flushing buffered data failed").
    Everything else of the shutdown still runs: atexit handlers, the join of the threads, the
    flush of every stream; only the status changes, and the reason is printed where it is set."""

    def __init__(self, stream: Any, failed: int):
        self._stream, self._failed, self._raised = stream, failed, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def flush(self) -> None:
        self._stream.flush()
        if sys.is_finalizing() and not self._raised:  # not an atexit handler's flush: the final one
            self._raised = True
            raise SystemExit(
                f"txckpt sets the exit status to {UNRETRIEVED_EXIT_STATUS}: {self._failed} async save(s) failed and "
                "their errors were never retrieved (logged above). Call future.result() or txckpt.wait_for_saves() "
                "before exiting to handle them (docs/async.md, 'At exit')."
            )

    def __repr__(self) -> str:
        return f"txckpt's exit status for unretrieved async save errors (around {self._stream!r})"


def _fail_exit_status(failed: int) -> None:
    for name in ("stdout", "stderr"):  # the interpreter's final flush covers both
        stream = getattr(sys, name, None)
        if isinstance(stream, _ExitStatus):
            return
        if stream is not None and not getattr(stream, "closed", True):
            setattr(sys, name, _ExitStatus(stream, failed))
            return
    log.error("txckpt: no open sys.stdout or sys.stderr: the exit status cannot say that a save failed")


__all__ = [
    "async_save",
    "submit",
    "Job",
    "SaveFuture",
    "LazySnapshot",
    "step_gate",
    "torch_optimizer",
    "mark_reported",
    "wait_for_saves",
    "wait_for_root",
    "release_buffers",
    "pending_saves",
    "recent_saves",
]
