"""The test suite's one fork runner: run a function in a forked child, bring back its JSON
result or its error, and the exit code or signal that ended it.

Children are forked from the calling process (which has imported torch and txckpt already), so a
child costs milliseconds; they start with whatever txckpt state the parent holds, so callers that
need a fresh view either never opened the root in the parent or forget it in the child. Nothing
here sleeps to wait: the result comes through a pipe and the child is reaped with a blocking
``waitpid``; an optional ``timeout`` makes the child SIGALRM itself.

Used by the crash sweeps (tests/harness/crash_sweep.py) and the reliability campaign
(tests/reliability/); real multi-rank runs start from the forkserver of tests/harness/launcher.py,
or, where a rank starts processes of its own (DeepSpeed, DCP's process-based async save), from
:func:`torchrun`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from typing import Any, Callable


def after_fork() -> None:
    """Run first in every child the suite forks from a process that may have used torch: one
    intra-op thread. GNU OpenMP's thread pool does not survive ``fork``: a child's first parallel
    kernel (``torch.arange`` of 512 Ki floats is one) waits forever for the parent's pool threads
    (the CI campaign hung on it). With one thread torch runs every kernel inline."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def run_child(fn: Callable[[], Any], *, timeout: float | None = None) -> tuple[int, Any]:
    """Fork; run ``fn`` in the child; return (exit code, or -signal; fn's JSON result or error).

    ``timeout``: SIGKILL the child (by pid) if it is still running after that many seconds; its
    result is then ``{"error": "timeout"}``. The wait itself blocks on the pipe and ``waitpid``.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        after_fork()
        code = 0
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            if timeout:
                signal.alarm(int(timeout) + 1)  # self-destruct (SIGALRM kills by default)
            result = {"ok": fn()}
        except BaseException as e:  # report, never unwind into the parent's code
            result = {
                "error": f"{type(e).__name__}: {e}",
                "type": type(e).__name__,
                "trace": traceback.format_exc(limit=-4),
            }
            code = 3
        try:
            data = json.dumps(result, default=str).encode()
        except Exception as e:  # pragma: no cover
            data = json.dumps({"error": f"unserialisable result: {e}"}).encode()
        view = memoryview(data)
        while view:
            n = os.write(w, view)
            view = view[n:]
        os.close(w)
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 1 << 20)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    out = json.loads(data) if data else None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGALRM:
            return -sig, {"error": "timeout"}
        return -sig, out
    return os.WEXITSTATUS(status), out


def child_value(fn: Callable[[], Any], what: str, timeout: float | None = 300) -> Any:
    """Run ``fn`` in a fresh child and return its value; raise if it failed."""
    code, out = run_child(fn, timeout=timeout)
    if code != 0 or not out or "ok" not in out:
        raise RuntimeError(
            f"{what} failed in a child (exit {code}): {out and out.get('error')}\n{out and out.get('trace')}"
        )
    return out["ok"]


def torchrun(
    script: str,
    *args: Any,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    expect_ok: bool = True,
) -> "subprocess.CompletedProcess[str]":
    """``python -m torch.distributed.run --standalone --nproc_per_node N script args...`` in the
    script's directory: real ranks that are nobody's daemonic children (DCP's process-based async
    save and DeepSpeed start processes of their own). Collectives time out after 60 s and each
    rank uses one thread unless ``env`` says otherwise. Raises AssertionError with both streams
    when the exit status is not what ``expect_ok`` says."""
    run_env = dict(os.environ, TXCKPT_COORDINATION_TIMEOUT="60", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    run_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        script,
        *map(str, args),
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=os.path.dirname(os.path.abspath(script))
    )
    if (p.returncode == 0) != expect_ok:
        raise AssertionError(
            f"{os.path.basename(script)} {list(map(str, args))}: rc {p.returncode}\n"
            f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-6000:]}"
        )
    return p


def become_rank(rank: int, world: int, port: int) -> None:
    """In a child a test started as one rank of ``world``: the environment torchrun gives a rank
    (what torch.distributed's env:// and Lightning's environment read), the store on 127.0.0.1."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
