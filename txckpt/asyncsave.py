"""Asynchronous saves: ``async_save`` snapshots the state and returns; a background thread runs
the ordinary save (the same transaction as ``save_checkpoint``: staging, manifest, one log
entry, publication) from the snapshot. docs/async.md states the guarantees.

One saver per root and process (keyed as the root cache keys roots). It keeps the snapshot
buffers (txckpt/snapshot.py) and the one save in flight: a second ``async_save`` of the same
root waits for the previous save to finish before it snapshots into the same buffers, so saves
commit in the order they were requested, and the state is never held more than once.

Multi-rank: the background save's collectives run on a gloo group of the asynchronous saves'
own, created once per default group by the first ``async_save`` (in the caller's thread, where
every rank calls it at the same point: ``new_group`` is a collective on the default group). The
background thread then never touches the default group nor the group synchronous txckpt calls
use, so a training job's own collectives may run while a save is in the background.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Mapping

from .coordination import Coordinator, SingleProcess, TorchDistributed, coordination_timeout
from .errors import CoordinationTimeoutError, InvalidArgumentError
from .root import open_root, root_key
from .snapshot import SnapshotPool

log = logging.getLogger("txckpt")


class _Saver:
    """One root's snapshot buffers and its save in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held from the wait for the previous save to the hand-off
        self.pool = SnapshotPool()
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


_lock = threading.Lock()
_savers: dict[tuple[Any, ...], _Saver] = {}
#: Every async save's future, in request order, until wait_for_saves has reported it.
_futures: list[Future] = []
_group: dict[str, Any] = {}  # {"world": default group, "group": the async saves' gloo group}
_exit_hook: list[bool] = []


def async_save(
    root: str | os.PathLike,
    step: int,
    files: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
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
    """
    if not isinstance(files, Mapping) or not files:
        raise InvalidArgumentError("files must be a non-empty dict of file name -> object")
    so = dict(storage_options) if storage_options is not None else None

    def prepare(pool: SnapshotPool) -> Callable[[Coordinator], str]:
        snapshot = pool.snapshot(files)
        meta = copy.deepcopy(dict(metadata or {}))  # plain data, small: not pooled
        return lambda coordinator: open_root(root, so).save(step, snapshot, metadata=meta,
                                                            coordinator=coordinator)

    return submit(root, storage_options, prepare)


def submit(
    root: str | os.PathLike,
    storage_options: Mapping[str, Any] | None,
    prepare: "Callable[[SnapshotPool], Callable[[Coordinator], Any]]",
) -> Future:
    """The machinery of :func:`async_save` for a caller that snapshots its own state (the
    Trainer integration, whose files are written by upstream code): wait for the root's save in
    flight, then, in the caller's thread, ``prepare(pool)`` snapshots into the root's reused
    buffers and returns the background job; ``job(coordinator)`` then runs on the root's worker
    thread with the coordinator of the async saves' own group (a Transaction takes it), and its
    result or error is the future's. Every guarantee of async_save (one in flight per root, step
    order, wait_for_saves, finished at exit) holds for it. An error of ``prepare`` is raised here."""
    key = root_key(root, storage_options)
    with _lock:
        saver = _savers.get(key)
        if saver is None:
            saver = _savers[key] = _Saver()
        _register_exit_hook()
    with saver.lock:
        saver.wait()  # the previous save: its buffers are reused below
        coordinator = _coordinator()
        job = prepare(saver.pool)
        future: Future = Future()
        future.set_running_or_notify_cancel()  # it runs from now on: cancel() is refused

        def run() -> None:
            saver.worker_ident = threading.get_ident()
            try:
                result = job(coordinator)
            except BaseException as e:  # noqa: BLE001 - the future carries it to the caller
                if isinstance(e, CoordinationTimeoutError):
                    _discard_group(coordinator)
                future.set_exception(e)
            else:
                future.set_result(result)

        with _lock:
            # Saves that succeeded have nothing left to report: only errors wait for
            # wait_for_saves (a long run that never calls it holds no list of every save).
            _futures[:] = [f for f in _futures if not f.done() or f.exception() is not None]
            _futures.append(future)
        saver.running = saver.worker.submit(run)
    return future


def wait_for_saves() -> None:
    """Block until every pending async save of this process has finished; raise the first error
    of the saves that finished since the last call (each error is raised once: every other one
    stays on its future)."""
    with _lock:
        futures = list(_futures)
    for f in futures:
        f.exception()  # waits
    with _lock:
        for f in futures:
            _futures.remove(f)
    for f in futures:
        e = f.exception()
        if e is not None:
            raise e


def mark_reported(future: Future) -> None:
    """``future``'s outcome was reported by its caller (the Trainer raised its error): take it
    off what wait_for_saves and the exit hook report, so no error is raised or logged twice."""
    with _lock:
        if future in _futures:
            _futures.remove(future)


def wait_for_root(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """Wait for the save in flight of ``root`` (if any), without raising its error (its future
    and wait_for_saves have it). Called by the synchronous API before it reads or changes the
    root's state, which the background save is changing."""
    with _lock:
        saver = _savers.get(root_key(root, storage_options))
    if saver is None:
        return
    with saver.lock:
        saver.wait()


def release_buffers(root: str | os.PathLike | None = None,
                    storage_options: Mapping[str, Any] | None = None) -> None:
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
        saver.worker.shutdown(wait=True)


def pending_saves() -> int:
    """How many async saves of this process have not finished yet."""
    with _lock:
        return sum(1 for f in _futures if not f.done())


def _coordinator() -> Coordinator:
    """The background save's coordinator: alone, SingleProcess; inside a process group of more
    than one rank, one on the async saves' own gloo group (created here, in the caller's thread,
    on first use)."""
    if "torch" not in sys.modules:
        return SingleProcess()
    import torch.distributed as dist

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
                phase="group creation") from e
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
    # A forked child has none of its parent's threads: its saves are its own.
    _savers.clear()
    _futures.clear()
    _group.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _register_exit_hook() -> None:
    """Finish pending saves at normal interpreter exit. threading's exit hooks run before the
    interpreter joins its threads and before atexit handlers (torch.distributed's among them),
    so a multi-rank save's group is still there; plain atexit where that hook is missing."""
    if _exit_hook:
        return
    _exit_hook.append(True)
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise AttributeError
        register(_finish_at_exit)
    except Exception:  # noqa: BLE001 - a Python without it, or already shutting down
        import atexit

        atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    with _lock:
        futures = list(_futures)
        _futures.clear()
    for f in futures:
        e = f.exception()  # waits for it
        if e is not None:
            log.error("txckpt: an async save failed and was never waited for: %s: %s", type(e).__name__, e)


__all__ = ["async_save", "submit", "mark_reported", "wait_for_saves", "wait_for_root", "release_buffers", "pending_saves"]
