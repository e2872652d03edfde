"""txckpt.preemption in real processes (issue 32): tests/children/preempt_loop.py is a training
loop that async-saves every k steps and polls requested(); this file signals it the way SLURM,
Kubernetes and spot VMs do and checks the root afterwards: what is committed is whole
(verify_checkpoint), the newest checkpoint is the step the loop stopped at (or, after a second
signal or a SIGKILL, the previous committed one), nothing torn. Handshakes are files the child
writes (tests/children/preempt_loop.py lists them); the parent polls them with a deadline and
never sleeps to synchronise."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import txckpt
from tests.harness.handshake import HandshakeChild

#: Every test starts the loop through Child (a class: tests/harness/tiers.py's scan sees only
#: module-level functions), so the module says it: the `test` tier, not `test-fast`.
pytestmark = pytest.mark.process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(REPO, "tests", "children", "preempt_loop.py")
SIGTERM_STATUS = 128 + signal.SIGTERM  # docs/preemption.md


class Child(HandshakeChild):
    def __init__(self, tmp_path, *args: str, rank: int = 0) -> None:
        self._dirs(tmp_path, rank)
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TXCKPT_COORDINATION_TIMEOUT="60")
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, LOOP, "--hs", self.hs, *args, "--rank", str(rank)],
                stdout=err,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def result(self) -> dict:
        return self.json("result-rank{r}.json")


def _newest(root: str) -> tuple[int, dict]:
    """The newest committed checkpoint: verified whole, its step and its files."""
    txckpt.forget_roots()
    path = txckpt.get_last_checkpoint(root)
    manifest = txckpt.verify_checkpoint(path)
    return manifest.step, txckpt.load_checkpoint(path)


def test_sigterm_at_a_random_step_saves_the_next_boundary_and_exits(tmp_path):
    root = str(tmp_path / "out")
    at = random.Random().randint(3, 30)
    child = Child(tmp_path, "--root", root, "--every", "5", "--grace", "60")
    child.wait_for("step-rank{r}", at_least=at)
    child.signal(signal.SIGTERM)
    assert child.finish() == SIGTERM_STATUS, child.output()
    stopped = child.result()["stopped_at"]
    assert stopped >= at and child.result()["received"] == signal.SIGTERM
    step, files = _newest(root)
    assert step == stopped and files["rank0.pt"]["w"].eq(stopped).all() and files["rank0.pt"]["step"] == stopped
    out = child.output()
    assert "received SIGTERM" in out and f"committed {txckpt.get_last_checkpoint(root)}" in out


def test_a_save_pending_at_the_signal_commits_before_exit(tmp_path):
    root = str(tmp_path / "out")
    child = Child(
        tmp_path,
        "--root",
        root,
        "--every",
        "5",
        "--block-step",
        "10",
        "--last-periodic",
        "10",
        "--no-final-save",
        "--grace",
        "60",
    )
    child.wait_for("blocked-rank{r}")  # the save of step 10 is in the background, held
    child.signal(signal.SIGTERM)
    child.wait_for("result-rank{r}.json")  # the loop stopped; exit() waits for the pending save
    assert child.proc.poll() is None
    open(os.path.join(child.hs, "release"), "w").close()
    assert child.finish() == SIGTERM_STATUS, child.output()
    step, files = _newest(root)
    assert step == 10 and files["rank0.pt"]["w"].eq(10).all()
    assert "1 async save(s) pending" in child.output()
    assert f"committed {txckpt.get_last_checkpoint(root)}" in child.output()


def test_a_second_sigterm_exits_at_once_leaving_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "out")
    child = Child(
        tmp_path,
        "--root",
        root,
        "--every",
        "5",
        "--block-step",
        "10",
        "--last-periodic",
        "10",
        "--no-final-save",
        "--grace",
        "600",
    )
    child.wait_for("blocked-rank{r}")
    child.signal(signal.SIGTERM)
    child.wait_for("result-rank{r}.json")  # in exit(), waiting for the held save
    t0 = time.monotonic()
    child.signal(signal.SIGTERM)
    assert child.finish(deadline=30) == SIGTERM_STATUS, child.output()
    assert time.monotonic() - t0 < 30  # not the 600 s grace
    assert f"abandoned the async save of {root} step 10" in child.output()
    assert "a second signal, SIGTERM" in child.output()
    step, files = _newest(root)
    assert step == 5 and files["rank0.pt"]["w"].eq(5).all()


@pytest.mark.parametrize(
    "kill_at", ["final-rank{r}", "inside-{step}-rank{r}"], ids=["before-the-final-save", "in-the-background-save"]
)
def test_sigkill_during_the_final_save_never_tears(tmp_path, kill_at):
    root = str(tmp_path / "out")
    at = random.Random().randint(11, 25)  # step 5 is committed by then: step 10's save waited for it
    child = Child(tmp_path, "--root", root, "--every", "5", "--grace", "1")
    child.wait_for("step-rank{r}", at_least=at)
    child.signal(signal.SIGTERM)
    final = int(child.wait_for("final-rank{r}"))  # the loop began its final save
    child.wait_for(kill_at.replace("{step}", str(final)))
    child.signal(signal.SIGKILL)  # the scheduler's, after a grace of 0-1 s
    assert child.finish() == -signal.SIGKILL
    step, files = _newest(root)  # committed and verifying: the final save's or an earlier one
    assert step == final or (step % 5 == 0 and step < final), (step, final)
    assert files["rank0.pt"]["w"].eq(step).all()


def test_two_ranks_sigterm_on_rank_1_only_both_save_the_same_step(tmp_path):
    root = str(tmp_path / "out")
    store = str(tmp_path / "store")
    ranks = [
        Child(tmp_path, "--root", root, "--every", "4", "--grace", "60", "--world", "2", "--store", store, rank=r)
        for r in range(2)
    ]
    at = random.Random().randint(3, 20)
    ranks[1].wait_for("step-rank{r}", at_least=at)
    ranks[1].signal(signal.SIGTERM)
    codes = [c.finish() for c in ranks]
    assert codes == [SIGTERM_STATUS] * 2, [c.output() for c in ranks]
    results = [c.result() for c in ranks]
    assert results[0]["stopped_at"] == results[1]["stopped_at"] >= at
    assert [r["received"] for r in results] == [0, signal.SIGTERM]  # only rank 1 got it
    step, files = _newest(root)
    assert step == results[0]["stopped_at"]
    assert txckpt.read_manifest(txckpt.get_last_checkpoint(root)).world_size == 2
    assert files["rank0.pt"]["w"].eq(step).all() and files["rank1.pt"]["w"].eq(step).all()
    assert "another rank received SIGTERM" in ranks[0].output()
