"""TransactionalAccelerator(save_on_preemption=...) in real processes (issue 32):
tests/children/accelerate_preempt.py is an accelerate loop that calls
``save_state_if_preempted`` at every step boundary; this file sends it SIGTERM (os.kill) the way
a scheduler does, at a moment the child's handshake files show, and checks the project
afterwards: the newest committed checkpoint is the step the loop stopped at and verifies, a
restart's ``load_state()`` resumes there; without the option SIGTERM kills and nothing is saved;
a second SIGTERM exits at once leaving the previous checkpoint whole; on two ranks (gloo) a
signal to rank 1 alone makes both save the same step. The parent polls files with a deadline and
never sleeps to synchronise."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

import txckpt
from tests.harness.handshake import HandshakeChild, newest_verified

pytest.importorskip("accelerate")

#: Every test starts the loop through Child (a class: tests/harness/tiers.py's scan sees only
#: module-level functions), so the module says it.
pytestmark = pytest.mark.process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(REPO, "tests", "children", "accelerate_preempt.py")
SIGTERM_STATUS = 128 + signal.SIGTERM  # docs/preemption.md


class Child(HandshakeChild):
    deadline_s = 180.0

    def __init__(self, tmp_path, *args: str, rank: int = 0, name: str = "") -> None:
        self._start(LOOP, tmp_path, args, rank=rank, name=name)


def _loop_step(checkpoint: str, rank: int) -> int:
    """The loop step rank ``rank`` was at when it wrote its part of ``checkpoint``."""
    return json.loads(open(os.path.join(checkpoint, f"loop_step_rank{rank}.json")).read())


def test_sigterm_at_a_random_step_saves_that_boundary_exits_143_and_the_restart_resumes_there(tmp_path):
    project = str(tmp_path / "run")
    at = random.Random().randint(3, 40)
    child = Child(tmp_path, "--project", project, "--every", "10", "--grace", "120")
    child.wait_for("step-rank{r}", at_least=at)
    child.signal(signal.SIGTERM)
    assert child.finish() == SIGTERM_STATUS, child.output()
    result = child.json("result-rank{r}.json")
    stopped = result["stopped_at"]
    assert stopped >= at and result["received"] == signal.SIGTERM and result["status"] == SIGTERM_STATUS
    path, manifest = newest_verified(project)
    assert path == os.path.join(project, f"step_{stopped}") and manifest.step == stopped
    assert _loop_step(path, 0) == stopped
    out = child.output()
    assert "received SIGTERM" in out and f"txckpt: preemption: saved {path}" in out, out
    # The restart (the same script, as a scheduler requeues it) loads that step and goes on.
    restart = Child(
        tmp_path, "--project", project, "--every", "10", "--resume", "--max-steps", str(stopped + 2), name="-restart"
    )
    assert restart.finish() == 0, restart.output()
    resumed = restart.json("resumed-rank{r}.json")
    assert resumed["path"] == path
    assert resumed["model"] == resumed["lr"] == resumed["tag"] == float(stopped) and resumed["uniform"], resumed
    assert resumed["iteration"] == stopped + 1
    assert f"finished at step {stopped + 2}; handlers installed after end_training: False" in restart.output()


@pytest.mark.parametrize("value", [-1, float("inf"), "soon"])
def test_save_on_preemption_takes_true_false_or_a_grace_in_seconds(value):
    from txckpt.errors import InvalidArgumentError
    from txckpt.integrations.accelerate import TransactionalAccelerator

    # Checked before accelerate sets anything up, and nothing is installed.
    with pytest.raises(InvalidArgumentError, match="save_on_preemption must be True, False or a grace"):
        TransactionalAccelerator(cpu=True, save_on_preemption=value)
    assert not txckpt.preemption.installed()


def test_without_the_option_sigterm_kills_the_loop_and_saves_nothing(tmp_path):
    project = str(tmp_path / "run")
    child = Child(tmp_path, "--project", project, "--mode", "stock")
    child.wait_for("step-rank{r}", at_least=random.Random().randint(3, 40))
    child.signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM, child.output()
    assert not os.path.exists(child.path("result-rank{r}.json"))
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(project, missing_ok=True) is None


def test_a_second_sigterm_during_the_preemption_save_exits_at_once_leaving_the_previous_checkpoint(tmp_path):
    project, every = str(tmp_path / "run"), 3
    child = Child(tmp_path, "--project", project, "--every", str(every), "--grace", "600", "--block-preempted-save")
    child.wait_for("step-rank{r}", at_least=random.Random().randint(every, 20))  # step `every` is committed
    child.signal(signal.SIGTERM)
    blocked = int(child.wait_for("blocked-rank{r}"))  # a save after the signal, held inside save_state
    t0 = time.monotonic()
    child.signal(signal.SIGTERM)
    assert child.finish(deadline=60) == SIGTERM_STATUS, child.output()
    assert time.monotonic() - t0 < 60  # not the 600 s grace
    assert "a second signal, SIGTERM" in child.output()
    previous = (blocked - 1) // every * every  # the newest periodic save before the held one
    path, manifest = newest_verified(project)
    assert path == os.path.join(project, f"step_{previous}") and manifest.step == previous, (path, blocked)
    assert _loop_step(path, 0) == previous
    assert not os.path.exists(os.path.join(project, f"step_{blocked}"))


@pytest.mark.distributed
def test_two_ranks_sigterm_on_rank_1_only_both_save_the_same_step(tmp_path):
    project, store = str(tmp_path / "run"), str(tmp_path / "store")
    ranks = [
        Child(
            tmp_path, "--project", project, "--every", "10", "--grace", "120", "--world", "2", "--store", store, rank=r
        )
        for r in range(2)
    ]
    at = random.Random().randint(3, 30)
    ranks[1].wait_for("step-rank{r}", at_least=at)
    ranks[1].signal(signal.SIGTERM)
    codes = [c.finish() for c in ranks]
    assert codes == [SIGTERM_STATUS] * 2, [c.output() for c in ranks]
    results = [c.json("result-rank{r}.json") for c in ranks]
    stopped = results[0]["stopped_at"]
    assert results[1]["stopped_at"] == stopped >= at, results
    assert [r["received"] for r in results] == [0, signal.SIGTERM]  # only rank 1 got it
    path, manifest = newest_verified(project)
    assert path == os.path.join(project, f"step_{stopped}") and manifest.step == stopped
    assert manifest.world_size == 2
    assert [_loop_step(path, r) for r in range(2)] == [stopped, stopped]  # each rank's own part
    assert "another rank received SIGTERM" in ranks[0].output()
