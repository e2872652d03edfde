"""Resume equivalence (issue 32): a Trainer run stopped at a step (SIGKILL, or SIGTERM with
txckpt_save_on_preemption) and resumed with resume_from_checkpoint=True logs, at every step, the
loss the uninterrupted run logged, bit for bit, and ends with the same weights. The model has
dropout and the data is shuffled, so every RNG the Trainer restores matters; the stop is
mid-epoch. Cells: DataLoader workers 0 and 2, synchronous and asynchronous saves; one rank
(the 2-rank cells are not in this file yet). tests/children/trainer_equivalence.py is the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.harness.zygote import run_python

pytestmark = pytest.mark.trainer

CHILD = Path(__file__).parent / "children" / "trainer_equivalence.py"
_REFERENCE: dict[tuple[int, int], tuple[dict[int, float], str]] = {}


def _run(out: Path, workers: int, use_async: int, stop: str, *extra: str):
    return run_python([str(CHILD), str(out), str(workers), str(use_async), stop, *extra], timeout=300,
                      cwd=str(CHILD.parent))


def _losses(out: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (re-run after a resume from before it) must agree."""
    seen: dict[int, float] = {}
    for line in open(f"{out}.losses"):
        step, loss = json.loads(line)
        assert seen.setdefault(step, loss) == loss, f"step {step} logged {seen[step]} and then {loss}"
    return seen


def _weights(stdout: str) -> str:
    return next(line.split()[1] for line in stdout.splitlines() if line.startswith("WEIGHTS "))


def _reference(tmp_path: Path, workers: int, use_async: int) -> tuple[dict[int, float], str]:
    key = (workers, use_async)
    if key not in _REFERENCE:
        out = tmp_path / "reference"
        p = _run(out, workers, use_async, "0")
        assert p.returncode == 0, p.stderr[-3000:]
        _REFERENCE[key] = (_losses(out), _weights(p.stdout))
    return _REFERENCE[key]


@pytest.mark.parametrize("stop,workers,use_async", [
    ("kill:5", 0, 0), ("kill:5", 0, 1), ("kill:5", 2, 0), ("kill:5", 2, 1),
    ("term:5", 0, 0), ("term:5", 2, 1),
])
def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path, stop, workers, use_async):
    losses, weights = _reference(tmp_path, workers, use_async)
    assert sorted(losses) == list(range(1, 13))
    out = tmp_path / "run"
    first = _run(out, workers, use_async, stop)
    assert first.returncode == (-9 if stop.startswith("kill") else 143), first.stderr[-3000:]
    again = _run(out, workers, use_async, "0", "resume")
    assert again.returncode == 0, again.stderr[-3000:]
    got = _losses(out)
    assert got == losses, {s: (losses.get(s), got.get(s)) for s in set(losses) | set(got) if losses.get(s) != got.get(s)}
    assert _weights(again.stdout) == weights
    if stop.startswith("term"):  # the preemption saved step 5 itself: the restart re-ran nothing
        assert sum(1 for _ in open(f"{out}.losses")) == 12
