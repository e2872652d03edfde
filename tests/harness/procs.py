"""The test suite's one fork runner: run a function in a forked child, bring back its JSON
result or its error, and the exit code or signal that ended it.

Children are forked from the calling process (which has imported torch and txckpt already), so a
child costs milliseconds; they start with whatever txckpt state the parent holds, so callers that
need a fresh view either never opened the root in the parent or forget it in the child. Nothing
here sleeps to wait: the result comes through a pipe and the child is reaped with a blocking
``waitpid``; an optional ``timeout`` makes the child SIGALRM itself.

Used by the crash sweeps (tests/crash_harness.py) and the reliability campaign
(tests/reliability/); the real multi-rank runs use the forkserver of tests/harness/ranks.py.
"""

from __future__ import annotations

import json
import os
import signal
import traceback
from typing import Any, Callable

def run_child(fn: Callable[[], Any], *, timeout: float | None = None) -> tuple[int, Any]:
    """Fork; run ``fn`` in the child; return (exit code, or -signal; fn's JSON result or error).

    ``timeout``: SIGKILL the child (by pid) if it is still running after that many seconds; its
    result is then ``{"error": "timeout"}``. The wait itself blocks on the pipe and ``waitpid``.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            if timeout:
                signal.alarm(int(timeout) + 1)  # self-destruct (SIGALRM kills by default)
            result = {"ok": fn()}
        except BaseException as e:  # report, never unwind into the parent's code
            result = {"error": f"{type(e).__name__}: {e}", "type": type(e).__name__,
                      "trace": traceback.format_exc(limit=-4)}
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
        raise RuntimeError(f"{what} failed in a child (exit {code}): {out and out.get('error')}\n"
                           f"{out and out.get('trace')}")
    return out["ok"]
