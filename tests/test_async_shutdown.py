"""txckpt.async_save at interpreter shutdown, and how its errors are reported (docs/async.md, "At
exit" and "Errors"): issue 29, items 4 and 6.

At shutdown (an ``atexit`` handler, a threading exit hook that runs after txckpt's, a thread
still saving once that hook has begun) ``async_save`` saves synchronously: the checkpoint is
committed before the call returns, and a failure raises at the call. An error retrieved through
its future (``result()``, ``exception()``) is handled: neither logged at exit nor raised again by
``wait_for_saves``. A failure nobody retrieved is logged at exit and makes the exit status 120.
The exit-status tests run real interpreters (``python -c``) and read their exit code.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import txckpt
from txckpt._async import asyncsave
from txckpt._save import transactions
from txckpt.errors import StepConflictError, StorageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNRETRIEVED_STATUS = 120  # docs/async.md, "At exit"


def _run_script(body: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    # A real interpreter, not the zygote (tests/harness/zygote.py): these tests are about what
    # txckpt does at interpreter exit (threading's exit hooks, atexit, the exit status), which a
    # zygote child only imitates (threading._shutdown, atexit, os._exit).
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body), *args], env=env, capture_output=True, text=True, timeout=120
    )


def _committed(root: str) -> tuple[str, dict]:
    txckpt.forget_roots()
    path = txckpt.get_last_checkpoint(root)
    return path, txckpt.load_checkpoint(path)


@pytest.fixture(autouse=True)
def _no_save_left_behind(no_save_left_behind):  # tests/conftest.py
    yield


# =================================================================================================
# Item 4: async_save at shutdown
# =================================================================================================
@pytest.mark.parametrize("earlier", [False, True], ids=["first-save-at-exit", "after-an-earlier-save"])
@pytest.mark.parametrize("lazy", [False, True], ids=["copy-first", "lazy"])
def test_async_save_from_an_atexit_handler_commits_before_the_process_exits(tmp_path, earlier, lazy):
    """The final save of a job, from an atexit handler: the interpreter has already run
    threading's exit hooks (concurrent.futures refuses new work, txckpt's hook has run when an
    earlier save registered it). The save runs in the handler and is committed on exit."""
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import atexit, sys, torch, txckpt
        root, earlier, lazy = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if earlier:
            txckpt.async_save(root, 1, {"w.safetensors": {"w": torch.zeros(8)}})
        def final_save():
            with torch.no_grad():
                model.weight.fill_(9.0)
            f = txckpt.async_save(root, 9, {"model.safetensors": model.state_dict(),
                                            "optimizer.pt": opt.state_dict()},
                                  optimizer=opt if lazy else None)
            print("final save returned done=%s" % f.done(), flush=True)
            with torch.no_grad():
                model.weight.fill_(-1.0)  # after the call: must not reach the checkpoint
            print("committed", f.result(), flush=True)
        atexit.register(final_save)
    """,
        root,
        "1" if earlier else "0",
        "1" if lazy else "0",
    )
    assert done.returncode == 0, done.stderr
    assert "cannot schedule" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "final save returned done=True" in done.stdout, done.stdout
    path, data = _committed(root)
    assert path == os.path.join(root, "checkpoint-9")
    assert f"committed {path}" in done.stdout
    assert torch.equal(data["model.safetensors"]["weight"], torch.full((2, 4), 9.0))


def test_async_save_at_shutdown_that_fails_raises_the_typed_error_at_the_call(tmp_path):
    """Nobody looks at a future after the process exits: at shutdown the save's own error
    (here a step conflict) is raised by async_save, as save_checkpoint raises it."""
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import atexit, sys, txckpt
        from txckpt.errors import StepConflictError
        root = sys.argv[1]
        txckpt.save_checkpoint(root, 5, {"a.bin": b"5"})
        def final_save():
            try:
                txckpt.async_save(root, 5, {"a.bin": b"again"})
            except StepConflictError as e:
                print("raised at the call:", type(e).__name__, flush=True)
            else:
                print("returned", flush=True)
        atexit.register(final_save)
    """,
        root,
    )
    assert "raised at the call: StepConflictError" in done.stdout, (done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr  # raised and handled: nothing left to report


def test_async_save_from_a_threading_exit_hook_after_txckpts_own_is_synchronous(tmp_path):
    """A threading exit hook registered before txckpt's runs after it (they run in reverse
    order), while concurrent.futures still takes work: handed to the worker, the save's error
    would be reported by nobody. It runs in the hook and raises there."""
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import sys, threading, txckpt
        from txckpt.errors import StepConflictError
        root = sys.argv[1]
        def late_hook():
            f = txckpt.async_save(root, 6, {"a.bin": b"6"})
            print("6 done at return:", f.done(), f.result(), flush=True)
            try:
                txckpt.async_save(root, 6, {"a.bin": b"again"})
            except StepConflictError as e:
                print("raised at the call:", type(e).__name__, flush=True)
        threading._register_atexit(late_hook)
        txckpt.async_save(root, 2, {"a.bin": b"2"})  # registers txckpt's hook, after late_hook
    """,
        root,
    )
    assert done.returncode == 0, done.stderr
    assert f"6 done at return: True {os.path.join(root, 'checkpoint-6')}" in done.stdout, (done.stdout, done.stderr)
    assert "raised at the call: StepConflictError" in done.stdout, (done.stdout, done.stderr)
    assert _committed(root)[0] == os.path.join(root, "checkpoint-6")


def test_a_thread_saving_while_the_exit_hook_runs_saves_synchronously(tmp_path):
    """A non-daemon thread still training when main returns calls async_save while txckpt's exit
    hook is waiting for the pending saves: its save commits in that thread (the interpreter joins
    it) and a failure raises there, instead of landing on a future nobody will read."""
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import sys, threading, txckpt
        from txckpt._async import asyncsave
        from txckpt.errors import StepConflictError
        root = sys.argv[1]
        def trainer():
            asyncsave._shutting_down.wait()  # set by txckpt's exit hook as it begins
            f = txckpt.async_save(root, 8, {"a.bin": b"8"})
            print("8 done at return:", f.done(), flush=True)
            try:
                txckpt.async_save(root, 8, {"a.bin": b"again"})
            except StepConflictError as e:
                print("raised in the thread:", type(e).__name__, flush=True)
        txckpt.async_save(root, 3, {"a.bin": b"3"}).result()
        threading.Thread(target=trainer).start()
    """,
        root,
    )
    assert done.returncode == 0, done.stderr
    assert "8 done at return: True" in done.stdout, (done.stdout, done.stderr)
    assert "raised in the thread: StepConflictError" in done.stdout, (done.stdout, done.stderr)
    assert _committed(root)[0] == os.path.join(root, "checkpoint-8")


# =================================================================================================
# Item 6: errors retrieved through the future are handled; unretrieved ones fail the exit status
# =================================================================================================
@pytest.mark.parametrize("how", ["result", "exception"])
def test_an_error_retrieved_through_its_future_is_not_raised_again_by_wait_for_saves(tmp_path, how):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 3, {"a.bin": b"3"})
    future = txckpt.async_save(root, 3, {"a.bin": b"again"})
    if how == "result":
        with pytest.raises(StepConflictError):
            future.result()
    else:
        assert isinstance(future.exception(), StepConflictError)
    txckpt.wait_for_saves()  # handled: nothing to raise
    assert asyncsave.pending_saves() == 0


def test_a_timed_out_result_retrieves_nothing(tmp_path, monkeypatch):
    """result(timeout) that times out has not seen the error: wait_for_saves still raises it."""
    root = str(tmp_path / "out")
    release = threading.Event()
    reached = threading.Event()

    def write_object(name, obj, out):
        reached.set()
        release.wait()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transactions, "write_object", write_object)
    future = txckpt.async_save(root, 1, {"a.bin": b"1"})
    reached.wait()
    with pytest.raises(TimeoutError):
        future.result(timeout=0)
    with pytest.raises(TimeoutError):
        future.exception(timeout=0)
    release.set()
    with pytest.raises(StorageError):
        txckpt.wait_for_saves()
    txckpt.wait_for_saves()  # raised once


def test_an_error_retrieved_through_its_future_is_not_logged_at_exit(tmp_path):
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import sys, txckpt
        from txckpt.errors import StepConflictError
        txckpt.save_checkpoint(sys.argv[1], 3, {"a.bin": b"3"})
        f = txckpt.async_save(sys.argv[1], 3, {"a.bin": b"again"})
        try:
            f.result()
        except StepConflictError:
            print("handled", flush=True)
    """,
        root,
    )
    assert "handled" in done.stdout, done.stderr
    assert "never" not in done.stderr and "StepConflictError" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


def test_a_failed_save_nobody_retrieved_is_logged_and_fails_the_exit_status(tmp_path):
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import atexit, sys, txckpt
        txckpt.save_checkpoint(sys.argv[1], 3, {"a.bin": b"3"})
        txckpt.async_save(sys.argv[1], 3, {"a.bin": b"again"})
        atexit.register(lambda: print("atexit handlers still run", flush=True))
        print("main returned", flush=True)
    """,
        root,
    )
    assert "StepConflictError" in done.stderr and "never retrieved" in done.stderr, done.stderr
    assert done.returncode == UNRETRIEVED_STATUS, (done.returncode, done.stderr)
    assert "main returned" in done.stdout and "atexit handlers still run" in done.stdout  # nothing cut short
    assert "exit status" in done.stderr, done.stderr  # the status is explained where it is set


def test_a_successful_save_nobody_waited_for_leaves_the_exit_status_0(tmp_path):
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import sys, txckpt
        txckpt.async_save(sys.argv[1], 4, {"a.bin": b"4"})
    """,
        root,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert _committed(root)[0] == os.path.join(root, "checkpoint-4")


def test_an_error_raised_by_wait_for_saves_is_not_reported_again_at_exit(tmp_path):
    root = str(tmp_path / "out")
    done = _run_script(
        """
        import sys, txckpt
        from txckpt.errors import StepConflictError
        txckpt.save_checkpoint(sys.argv[1], 3, {"a.bin": b"3"})
        txckpt.async_save(sys.argv[1], 3, {"a.bin": b"again"})
        try:
            txckpt.wait_for_saves()
        except StepConflictError:
            print("handled", flush=True)
    """,
        root,
    )
    assert "handled" in done.stdout, done.stderr
    assert done.returncode == 0 and "StepConflictError" not in done.stderr, done.stderr
