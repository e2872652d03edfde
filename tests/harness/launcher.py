"""The launcher of real multi-process torch.distributed runs (library; its rank targets live in
tests/children/: dist_workers, dcp_workers, claim_workers, async_workers, accelerate_workers).

Ranks are processes started from a forkserver that has already imported torch and txckpt, so a
run costs a fork and a gloo rendezvous over 127.0.0.1 instead of a Python start-up per rank;
each rank still has a process of its own (its own gloo group, its own txckpt state, and it can
be SIGKILLed alone). The forkserver never initialises torch.distributed itself.

A target is a top-level function ``target(rank, world, **kwargs)``. Each rank's outcome (its
return value, or the type and message of what it raised, and how long it took) is written to
``<result_dir>/rank<r>.json``; the launcher waits for every rank with a deadline and SIGKILLs
(by pid, only processes it started) any rank still alive at the deadline, reporting it as hung.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

_CTX: Any = None
_PRELOAD = ["torch", "torch.distributed", "txckpt", "tests.harness.launcher", "tests.children.dist_workers"]


def _forget_the_parents_forkserver() -> None:
    """Runs in the child of every ``os.fork`` of a process that imported this module.

    The child inherits the parent's forkserver record (its pid, address and alive pipe), but that
    forkserver is not the child's child: multiprocessing's next start calls ``waitpid`` on its pid
    and fails with ECHILD (CI: a reliability case forked from pytest, after an earlier test had
    started the forkserver, could not start its ranks). The child forgets the record and starts a
    forkserver of its own on first use; the parent's keeps running (the parent holds its pipe).
    """
    server = multiprocessing.forkserver._forkserver  # the module's one ForkServer
    server._lock = threading.Lock()  # another thread may have held it at the fork
    if server._forkserver_pid is None:
        return
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = None
    server._forkserver_alive_fd = None
    server._forkserver_pid = None


os.register_at_fork(after_in_child=_forget_the_parents_forkserver)


def context():
    """The forkserver context (preloaded with torch and txckpt), started once per process."""
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CTX = ctx
    return _CTX


@dataclass
class RankResult:
    rank: int
    exitcode: int | None  # -9 for SIGKILL; None if it hung and was killed by the launcher
    hung: bool = False
    ok: Any = None
    error_type: str | None = None
    error: str | None = None
    elapsed: float | None = None  # seconds inside the target
    trace: str | None = None

    @property
    def killed(self) -> bool:
        return self.exitcode == -signal.SIGKILL and not self.hung


@dataclass
class Run:
    results: list[RankResult]
    wall: float
    extra: dict = field(default_factory=dict)

    def __getitem__(self, r: int) -> RankResult:
        return self.results[r]

    def describe(self) -> str:
        return "; ".join(
            f"rank {r.rank}: exit={r.exitcode} hung={r.hung} ok={r.ok!r} err={r.error_type}: {(r.error or '')[:300]}"
            for r in self.results
        )

    def oks(self) -> list:
        """Every rank's result, after asserting that each rank exited 0 without an error."""
        for r in self.results:
            assert r.exitcode == 0 and r.error_type is None, self.describe() + "\n" + (r.trace or "")
        return [r.ok for r in self.results]


def _entry(rank: int, world: int, store: str, result_dir: str, target: Callable, kwargs: dict, env: dict) -> None:
    # The forkserver's environment is the test process's at the time it started: pin what
    # txckpt reads, then apply the run's own settings.
    os.environ["TXCKPT_DURABLE"] = "1"
    os.environ.pop("TXCKPT_COORDINATION_TIMEOUT", None)
    os.environ.update(env)
    import datetime

    import torch.distributed as dist

    out: dict[str, Any] = {}
    code = 0
    # A FileStore (no port to pick, so no port race between concurrent runs); gloo itself
    # connects over 127.0.0.1.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    t0 = time.monotonic()
    try:
        out["ok"] = target(rank, world, **kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out["error_type"] = type(e).__name__
        out["error"] = str(e)
        out["trace"] = traceback.format_exc()
        code = 17
    out["elapsed"] = time.monotonic() - t0
    tmp = os.path.join(result_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(out, f, default=str)
    os.replace(tmp, os.path.join(result_dir, f"rank{rank}.json"))
    if code == 0:
        dist.destroy_process_group()
    # A rank whose peers died skips the teardown of a broken group: the test is about txckpt
    # raising, not about how torch tears down a group whose peers are gone.
    os._exit(code)


def launch(
    world: int,
    target: Callable,
    result_dir: str,
    *,
    deadline: float = 90.0,
    env: dict | None = None,
    per_rank: dict[int, dict] | None = None,
    **kwargs: Any,
) -> Run:
    """Run ``target`` on ``world`` ranks; wait at most ``deadline`` seconds for all of them."""
    ctx = context()
    os.makedirs(result_dir, exist_ok=True)
    store = os.path.join(result_dir, "store")
    procs = []
    t0 = time.monotonic()
    for r in range(world):
        kw = dict(kwargs, **((per_rank or {}).get(r, {})))
        p = ctx.Process(target=_entry, args=(r, world, store, result_dir, target, kw, dict(env or {})), daemon=True)
        p.start()
        procs.append(p)
    end = t0 + deadline
    hung = set()
    for r, p in enumerate(procs):
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            hung.add(r)
    for r in hung:
        os.kill(procs[r].pid, signal.SIGKILL)
        procs[r].join(10)
    wall = time.monotonic() - t0
    results = []
    for r, p in enumerate(procs):
        path = os.path.join(result_dir, f"rank{r}.json")
        data: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        results.append(
            RankResult(
                r,
                None if r in hung else p.exitcode,
                r in hung,
                data.get("ok"),
                data.get("error_type"),
                data.get("error"),
                data.get("elapsed"),
                data.get("trace"),
            )
        )
    return Run(results, wall)


def run_in_fresh_process(fn: Callable, *args: Any, timeout: float = 60.0) -> Any:
    """``fn(*args)`` in a new process (no torch.distributed, no txckpt state); its return value
    or its exception re-raised here."""
    ctx = context()
    q = ctx.Queue()
    p = ctx.Process(target=_fresh_entry, args=(q, fn, args), daemon=True)
    p.start()
    try:
        ok, value = q.get(timeout=timeout)
    finally:
        p.join(10)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    if not ok:
        raise AssertionError(f"fresh process failed: {value}")
    return value


def _fresh_entry(q, fn, args) -> None:
    try:
        q.put((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001
        q.put((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
