"""A second SIGTERM landing while the interpreter shuts down keeps the exit status 143 (issue 45
item 10): after the atexit hooks Python resets its signal handlers to SIG_DFL and the watchdog
thread no longer runs, so the signal killed the process (-15 to its parent: torchrun and
schedulers saw a kill, not the preemption exit). tests/children/preempt_shutdown.py reaches that
window and waits in it on a pipe: deterministic, no sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "children", "preempt_shutdown.py")


def _signal_while_finalizing(*args: str) -> tuple[int, str]:
    """Start the child, wait until it is finalizing, SIGTERM it, let it go on: (status, output)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(
        [sys.executable, CHILD, str(ready_w), str(go_r), *args],
        pass_fds=(ready_w, go_r),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    os.close(ready_w)
    os.close(go_r)
    try:
        assert os.read(ready_r, 1) == b"r", "the child ended before it finalized"
        proc.send_signal(signal.SIGTERM)  # pending before the go byte: the child meets it first
        try:
            os.write(go_w, b"g")
        except BrokenPipeError:  # the signal killed it (what the bug did)
            pass
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(ready_r)
        os.close(go_w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out.decode(errors="replace")


def test_a_second_sigterm_during_interpreter_shutdown_keeps_status_143():
    status, out = _signal_while_finalizing()
    assert "received SIGTERM" in out  # the first signal, through the handler
    assert status == 128 + signal.SIGTERM, out


def test_a_first_sigterm_during_shutdown_is_left_to_its_default():
    """Without a preemption under way nothing is swallowed: a SIGTERM at shutdown still kills."""
    status, out = _signal_while_finalizing("--no-first-signal")
    assert status == -signal.SIGTERM, out
