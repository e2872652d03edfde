"""Real processes driven step by step through queues: the concurrency campaign's writers, readers
and garbage collectors.

An :class:`Actor` is a process forked from the campaign (torch and txckpt already imported) that
executes the calls it receives on its command queue and answers on its result queue, so a test
decides exactly which process does what, and in which order, with no sleeps. A call can be told
to *pause* inside txckpt (before or after a named function): the actor reports ``("paused",
name)`` and blocks until the test sends ``go``. This is how interleavings that are rare in the
wild (a lease taken between gc's read of the leases and its deletion) are made to happen every
time.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import time
import traceback
from typing import Any, Callable

from tests.harness.procs import after_fork


def _resolve(spec: str) -> tuple[Any, str]:
    mod, _, attr = spec.partition(":")
    owner: Any = importlib.import_module(mod)
    parts = attr.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    return owner, parts[-1]


def _actor_main(cmd: Any, res: Any, env: dict[str, str], inherit: dict[str, Any]) -> None:
    after_fork()
    os.environ.update(env)
    import logging

    logging.getLogger("txckpt").propagate = False
    logging.getLogger("txckpt").addHandler(logging.NullHandler())
    import txckpt

    txckpt.forget_roots()
    state: dict[str, Any] = {"inherit": inherit}
    pauses: dict[str, dict[str, Any]] = {}

    def install_pause(spec: str, when: str, nth: int) -> None:
        owner, attr = _resolve(spec)
        real = getattr(owner, attr)
        info = {"count": 0, "nth": nth, "real": real, "owner": owner, "attr": attr}
        pauses[spec] = info

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            info["count"] += 1
            hit = info["count"] == info["nth"]
            if hit and when == "before":
                res.put(("paused", spec))
                assert cmd.get() == "go"
            out = real(*args, **kwargs)
            if hit and when == "after":
                res.put(("paused", spec))
                assert cmd.get() == "go"
            return out

        setattr(owner, attr, wrapper)

    while True:
        msg = cmd.get()
        if msg is None:
            break
        kind = msg[0]
        if kind == "pause":
            # A spec that no longer names anything (the function moved) is the test's error: say
            # so to the test instead of dying, which would leave it waiting for an answer.
            try:
                install_pause(msg[1], msg[2], msg[3])
            except (AttributeError, ImportError) as e:
                res.put(("err", type(e).__name__, f"cannot pause {msg[1]}: {e}", traceback.format_exc(limit=-2), False))
                continue
            res.put(("ok", None))
            continue
        if kind == "unpause":
            info = pauses.pop(msg[1], None)
            if info:
                setattr(info["owner"], info["attr"], info["real"])
            res.put(("ok", None))
            continue
        fn, args, kwargs = msg[1], msg[2], msg[3]
        try:
            res.put(("ok", fn(state, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - every outcome goes back to the test
            res.put(
                ("err", type(e).__name__, str(e), traceback.format_exc(limit=-4), isinstance(e, txckpt.TxckptError))
            )
    os._exit(0)


class Actor:
    def __init__(
        self,
        name: str,
        env: dict[str, str] | None = None,
        timeout: float = 180.0,
        inherit: dict[str, Any] | None = None,
    ):
        ctx = multiprocessing.get_context("fork")
        self.name = name
        self.timeout = timeout
        self.cmd = ctx.Queue()
        self.res = ctx.Queue()
        self.proc = ctx.Process(
            target=_actor_main, args=(self.cmd, self.res, dict(env or {}), dict(inherit or {})), daemon=True
        )
        self.proc.start()

    # ----- calls -------------------------------------------------------------------------------
    def send(self, fn: Callable, *args: Any, **kwargs: Any) -> None:
        self.cmd.put(("call", fn, args, kwargs))

    def wait(self) -> tuple:
        """The actor's next answer; raises if it does not come within ``timeout`` or the actor
        died (a dead actor never answers: without the check a case would wait out the timeout
        at every later call)."""
        deadline = time.monotonic() + self.timeout
        while True:
            # Wake on an answer or on the actor's exit, whichever comes first.
            multiprocessing.connection.wait(
                [self.res._reader, self.proc.sentinel],  # type: ignore[attr-defined]
                max(deadline - time.monotonic(), 0.0),
            )
            try:
                return self.res.get(block=False)
            except queue.Empty:
                pass
            if not self.proc.is_alive():
                raise RuntimeError(f"actor {self.name} died (exit {self.proc.exitcode}) without answering")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"actor {self.name} gave no answer in {self.timeout:.0f} s")

    def call(self, fn: Callable, *args: Any, **kwargs: Any) -> tuple:
        self.send(fn, *args, **kwargs)
        return self.wait()

    def value(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        out = self.call(fn, *args, **kwargs)
        if out[0] != "ok":
            raise RuntimeError(f"actor {self.name}: {out[1]}: {out[2]}\n{out[3]}")
        return out[1]

    def pause(self, spec: str, when: str = "before", nth: int = 1) -> None:
        self.cmd.put(("pause", spec, when, nth))
        out = self.wait()
        if out[0] != "ok":
            raise RuntimeError(f"actor {self.name}: {out[2]}")

    def unpause(self, spec: str) -> None:
        self.cmd.put(("unpause", spec))
        assert self.wait() == ("ok", None)

    def go(self) -> None:
        self.cmd.put("go")

    def stop(self) -> None:
        try:
            self.cmd.put(None)
            self.proc.join(30)
        finally:
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join(10)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)

    def __enter__(self) -> "Actor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ----- operations (module level: they travel through the queue by reference) -------------------
def op_save(state: dict, root: str, step: int, tag: str, so: dict | None = None) -> str:
    import txckpt

    from .core import payload

    return txckpt.save_checkpoint(root, step, payload(tag, step), storage_options=so)


def op_resume(state: dict, root: str, step: int | None = None, so: dict | None = None) -> str | None:
    import txckpt

    return txckpt.resume(root, step, storage_options=so)


def op_lookup(state: dict, root: str, so: dict | None = None) -> str | None:
    import txckpt

    return txckpt.get_last_checkpoint(root, storage_options=so)


def op_tags(state: dict, path: str, so: dict | None = None) -> list[str]:
    from .invariants import read_tags

    return sorted(read_tags(path, so))


def op_retention(state: dict, root: str, keep_last: int, so: dict | None = None) -> list[str]:
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention
    from txckpt._root.root import CheckpointRoot

    return [i.txid for i in apply_retention(CheckpointRoot(root, so), RetentionPolicy(keep_last=keep_last))]


def op_gc(state: dict, root: str, so: dict | None = None, grace: float = 3600.0) -> list[list[str]]:
    from txckpt._maintenance.gc import collect_garbage
    from txckpt._root.root import CheckpointRoot

    rep = collect_garbage(CheckpointRoot(root, so), grace_seconds=grace)
    return [[i.kind, i.key] for i in rep.items]


def op_lease(state: dict, root: str, path: str, recheck: bool = False, so: dict | None = None) -> str:
    """Take a reader lease on the checkpoint at ``path`` (optionally re-checking afterwards that it
    is still committed and not retired); returns its txid."""
    import txckpt
    from txckpt.errors import CheckpointNotFoundError
    from txckpt._maintenance.leases import acquire_reader_lease
    from txckpt._root.root import CheckpointRoot

    r = CheckpointRoot(root, so)
    txid = txckpt.read_manifest(path, storage_options=so).txid
    state["lease"] = acquire_reader_lease(r, txid)
    if recheck and txid in r.history().retired:
        raise CheckpointNotFoundError(f"{txid} was retired before the lease was taken")
    return txid


def op_leases(state: dict, root: str, so: dict | None = None) -> list[str]:
    """The txids under a live reader lease."""
    from txckpt._maintenance.retention import read_leases
    from txckpt._root.root import CheckpointRoot

    return sorted(read_leases(CheckpointRoot(root, so).storage)[0])


def op_release(state: dict, root: str, so: dict | None = None) -> None:
    from txckpt._maintenance.leases import release_reader_lease
    from txckpt._root.root import CheckpointRoot

    release_reader_lease(CheckpointRoot(root, so), state.pop("lease"))


def op_load_first(state: dict, path: str, so: dict | None = None) -> str:
    """Start loading: read and verify the manifest and the first file (a slow reader's first step)."""
    import txckpt

    m = txckpt.read_manifest(path, storage_options=so)
    first = sorted(m.files)[0]
    txckpt.load_checkpoint(path, files=[first], storage_options=so)
    state["loading"] = (path, sorted(m.files)[1:])
    return first


def op_load_rest(state: dict, so: dict | None = None) -> list[str]:
    import txckpt

    path, rest = state.pop("loading")
    txckpt.load_checkpoint(path, files=rest, storage_options=so)
    return rest


def op_call(state: dict, fn: Callable, *args: Any) -> Any:
    return fn(*args)
