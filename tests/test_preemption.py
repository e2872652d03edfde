"""txckpt.preemption, in-process (issue 32): the handler only records the signal; requested()
turns True; uninstall() restores the previous handler; the watchdog's decisions (a second signal
exits at once, the grace running out exits after reporting) with its exit replaced, so the test
process survives; exit() finishes a pending async save and reports it.

The real processes (a SIGTERMed training loop, a second signal, SIGKILL during the save, two
gloo ranks) are tests/test_preemption_procs.py."""

from __future__ import annotations

import logging
import signal
import threading

import pytest
import torch

import txckpt
from txckpt import preemption
from txckpt._async import asyncsave
from txckpt.errors import InvalidArgumentError


@pytest.fixture(autouse=True)
def _uninstalled(no_save_left_behind):
    yield
    preemption.uninstall()


class Exits:
    """preemption._exit replaced: records the status and returns (the watchdog then ends)."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


@pytest.fixture
def exits(monkeypatch) -> Exits:
    e = Exits()
    monkeypatch.setattr(preemption, "_exit", e)
    return e


def test_signal_sets_the_flag_and_nothing_else():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    preemption.install()
    assert signal.getsignal(signal.SIGTERM) is preemption._handler
    assert (preemption.requested(), preemption.received(), preemption.exit_status()) == (False, 0, 0)
    signal.raise_signal(signal.SIGTERM)  # the process is not killed
    assert preemption.received() == signal.SIGTERM
    assert preemption.requested() and preemption.requested(collective=False)
    assert preemption.exit_status() == 128 + signal.SIGTERM == 143
    preemption.uninstall()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    assert (preemption.requested(), preemption.received()) == (False, 0)


def test_sigusr1_and_chosen_signals():
    preemption.install(signals=[signal.SIGUSR2])
    assert signal.getsignal(signal.SIGTERM) is not preemption._handler
    signal.raise_signal(signal.SIGUSR2)
    assert preemption.received() == signal.SIGUSR2 and preemption.exit_status() == 128 + signal.SIGUSR2
    preemption.uninstall()
    preemption.install()
    signal.raise_signal(signal.SIGUSR1)
    assert preemption.requested() and preemption.exit_status() == 128 + signal.SIGUSR1


def test_uninstall_restores_a_previous_python_handler():
    seen = []
    prev = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        preemption.install()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [] and preemption.requested()  # not chained: the loop decides
        preemption.uninstall()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, prev)


def test_install_refuses_bad_calls():
    with pytest.raises(InvalidArgumentError, match="grace_s"):
        preemption.install(grace_s=-1)
    with pytest.raises(InvalidArgumentError, match="empty"):
        preemption.install(signals=())
    preemption.install()
    with pytest.raises(InvalidArgumentError, match="already installed"):
        preemption.install()
    preemption.uninstall()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(InvalidArgumentError, preemption.install)))
    t.start(), t.join()
    assert "main thread" in str(errors[0].value)
    preemption.uninstall()  # twice, or never installed: nothing happens


def test_the_handler_is_plain():
    """No lock, no logging, no file I/O in the handler: it stores and writes one byte to a pipe."""
    names = set(preemption._handler.__code__.co_names)
    assert names <= {
        "_current",
        "signum",
        "t_signal",
        "time",
        "monotonic",
        "count",
        "os",
        "write",
        "wfd",
        "bytes",
        "OSError",
    }, names


def test_decide():
    assert preemption.decide(0, 10.0, None) == "wait"
    assert preemption.decide(1, 10.0, None) == "wait"
    assert preemption.decide(1, 10.0, 11.0) == "wait"
    assert preemption.decide(1, 11.0, 11.0) == "grace"
    assert preemption.decide(2, 10.0, None) == "exit"
    assert preemption.decide(3, 10.0, 99.0) == "exit"


def test_second_signal_exits_at_once(exits, caplog):
    preemption.install()  # no grace: only the second signal ends it
    signal.raise_signal(signal.SIGTERM)
    assert preemption.requested()
    assert not exits.done.wait(0.3)
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        signal.raise_signal(signal.SIGTERM)
        assert exits.done.wait(10)
    assert exits.codes == [143]
    assert "a second signal, SIGTERM" in caplog.text


def test_grace_runs_out_without_a_poll(exits, caplog):
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        preemption.install(grace_s=0.2)
        signal.raise_signal(signal.SIGUSR1)  # nobody polls requested()
        assert exits.done.wait(10)
    assert exits.codes == [128 + signal.SIGUSR1]
    assert "exiting anyway in 0.2 s" in caplog.text and "the grace of 0.2 s ran out" in caplog.text


class _Blocked:
    """CheckpointRoot.save held until released: a save pending for as long as a test wants."""

    def __init__(self, monkeypatch) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        real = txckpt.CheckpointRoot.save

        def save(root, *a, **kw):
            self.started.set()
            assert self.release.wait(30)
            return real(root, *a, **kw)

        monkeypatch.setattr(txckpt.CheckpointRoot, "save", save)


def test_exit_finishes_the_pending_save_and_reports_it(tmp_path, monkeypatch, caplog):
    root = str(tmp_path / "out")
    blocked = _Blocked(monkeypatch)
    preemption.install(grace_s=30)
    txckpt.async_save(root, 1, {"w.pt": torch.ones(4)})
    assert blocked.started.wait(10)
    signal.raise_signal(signal.SIGTERM)
    assert preemption.requested()
    threading.Timer(0.2, blocked.release.set).start()  # the save finishes while exit() waits
    with caplog.at_level(logging.WARNING, logger="txckpt"), pytest.raises(SystemExit) as e:
        preemption.exit()
    assert e.value.code == 143
    assert asyncsave.pending_saves() == 0
    assert f"committed {txckpt.get_last_checkpoint(root)}" in caplog.text
    assert "1 async save(s) pending" in caplog.text
    txckpt.verify_checkpoint(txckpt.get_last_checkpoint(root))


def test_exit_abandons_a_save_past_the_grace(tmp_path, monkeypatch, caplog, exits):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, {"w.pt": torch.zeros(4)})
    blocked = _Blocked(monkeypatch)
    preemption.install(grace_s=0.3)
    future = txckpt.async_save(root, 2, {"w.pt": torch.ones(4)})
    assert blocked.started.wait(10)
    signal.raise_signal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="txckpt"), pytest.raises(SystemExit):
        preemption.exit()  # the replaced _exit raises SystemExit where os._exit would end the process
    assert exits.codes and exits.codes[0] == 143
    assert f"abandoned the async save of {root} step 2" in caplog.text
    blocked.release.set()
    future.result(30)  # in a real process it would be lost; here it commits after all


def test_no_signal_no_collective_outside_a_group():
    preemption.install()
    assert preemption.requested() is False  # single process: no collective, no torch.distributed


def test_the_documented_loop_runs_as_written(tmp_path, monkeypatch, caplog):
    """docs/preemption.md's loop, as written: SIGTERM during step 3; the loop saves step 3 at its
    boundary and exit() raises SystemExit(143) once it is committed."""
    import os
    import re

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(here, "docs", "preemption.md")).read()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []

    def train_step():
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            signal.raise_signal(signal.SIGTERM)  # the scheduler, during step 3

    names = {
        "train_step": train_step,
        "model": model,
        "optimizer": optimizer,
        "start": 1,
        "total_steps": 1000,
        "rank": 0,
    }
    with caplog.at_level(logging.WARNING, logger="txckpt"), pytest.raises(SystemExit) as e:
        exec(compile(block, "docs/preemption.md", "exec"), names)
    assert e.value.code == 143 and steps == [1, 2, 3]
    path = txckpt.get_last_checkpoint("out")
    assert txckpt.verify_checkpoint(path).step == 3
    assert set(txckpt.load_checkpoint(path)) == {"model.safetensors", "optimizer.pt", "rng_state_0.pth"}
    assert f"committed {os.path.abspath(path)}" in caplog.text
