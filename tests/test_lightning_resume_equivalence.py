"""Resume equivalence for Lightning (issue 48): tests/children/lightning_preempt.py (a model with
dropout on shuffled data, Adam, saves every 3 steps through TransactionalCheckpointIO, 12 steps
an epoch on one process, 6 on two) is stopped mid-epoch, by a real SIGKILL the child sends itself
right after step K (nothing pending is finished), or by SIGTERM with SaveOnPreemption (rank 0
signals itself after step K: every rank saves step K and exits 143), and restarted with the
same command (``fit(ckpt_path="last")``). With ExactResume every rank logs the loss the
uninterrupted run logged at every step, bit for bit, and the run ends with the same weights.
Without it (stock Lightning's resume) the losses differ from the resume point on: the control.
Cells: 1 and 2 processes (gloo ``ddp``) x DataLoader workers 0 and 2 x SIGKILL and SIGTERM; one
runs in ``make test``, two more in the campaign, all of them with ``TXCKPT_FULL_SWEEP=1``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.harness.equivalence import final_weights, logged_losses

from tests.harness.sampling import FULL
from tests.harness.zygote import popen_python

pytest.importorskip("lightning")

pytestmark = [pytest.mark.process, pytest.mark.lightning]

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tests" / "children" / "lightning_preempt.py"
STEPS = 30
_REFERENCE: dict[tuple[int, int, tuple[str, ...]], tuple[list[dict[int, float]], str]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(hs: Path, ranks: int, workers: int, *args: str) -> list[tuple[int, str]]:
    """Every rank of one run (the same command, each its own process); (status, output) per rank."""
    hs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TXCKPT_COORDINATION_TIMEOUT="120")
    base = [str(RUN), "--dir", str(hs / "run"), "--hs", str(hs), "--every", "3", "--max-steps", str(STEPS)]
    base += ["--workers", str(workers), *args]
    if ranks > 1:
        base += ["--world", str(ranks), "--port", str(_free_port())]
    procs = []
    for r in range(ranks):
        log = open(hs / f"out-rank{r}-{len(list(hs.glob(f'out-rank{r}-*')))}", "w+")
        procs.append((popen_python(base + ["--rank", str(r)], env=env, stdout=log, stderr=log), log))
    results = []
    for p, log in procs:
        code = p.wait(300)
        log.seek(0)
        results.append((code, log.read()))
    return results


def _losses(hs: Path, rank: int, *, strict: bool = True) -> dict[int, float]:
    return logged_losses(hs / f"losses-rank{rank}", rank=rank, strict=strict)


def _reference(tmp_path: Path, ranks: int, workers: int, *extra: str) -> tuple[list[dict[int, float]], str]:
    """The uninterrupted run (the callbacks change nothing in it: one reference per shape)."""
    key = (ranks, workers, extra)
    if key not in _REFERENCE:
        hs = tmp_path / "reference"
        done = _run(hs, ranks, workers, "--exact", *extra)
        assert all(code == 0 for code, _ in done), [t[-3000:] for _, t in done]
        _REFERENCE[key] = ([_losses(hs, r) for r in range(ranks)], final_weights(done[0][1]))
        assert len(_REFERENCE[key][0][0]) == STEPS
    return _REFERENCE[key]


def _stop(stop: str) -> tuple[list[str], int]:
    kind, _, at = stop.partition(":")
    if kind == "kill":
        return ["--kill-at", at], -9
    return ["--term-at", at], 143


def _cell(tmp_path: Path, ranks: int, workers: int, stop: str, *extra: str) -> None:
    losses, weights = _reference(tmp_path, ranks, workers, *extra)
    hs = tmp_path / "run"
    args, expected = _stop(stop)
    first = _run(hs, ranks, workers, "--exact", *extra, *args)
    assert all(code == expected for code, _ in first), [(c, t[-3000:]) for c, t in first]
    again = _run(hs, ranks, workers, "--exact", *extra)
    assert all(code == 0 for code, _ in again), [(c, t[-3000:]) for c, t in again]
    for r in range(ranks):
        got = _losses(hs, r)
        assert got == losses[r], {
            s: (losses[r].get(s), got.get(s)) for s in set(losses[r]) | set(got) if losses[r].get(s) != got.get(s)
        }
    assert final_weights(again[0][1]) == weights
    if stop.startswith("term"):  # the preemption saved the step itself: the restart re-ran nothing
        assert sum(1 for _ in open(hs / "losses-rank0")) == STEPS


# kill:7 resumes step 6 (mid-epoch 0 on one process; the end of epoch 0 on two, 6 steps an
# epoch); term:8 saves step 8 (mid-epoch 0; on two, mid-epoch 1); kill:17 resumes step 15
# (mid-epoch 1 on one process: the epoch-start generators of a later epoch).
CELLS = [(ranks, workers, stop) for ranks in (1, 2) for workers in (0, 2) for stop in ("kill:7", "term:8")]
CELLS.append((1, 0, "kill:17"))
IN_MAKE_TEST = {(1, 0, "kill:7")}
#: The campaign's budget (60 s for all of issue 48's second landing) runs these two besides; the
#: whole matrix (all exact on 2026-12-06, docs/lightning.md) runs with TXCKPT_FULL_SWEEP=1.
IN_CAMPAIGN = {(2, 2, "kill:7"), (2, 0, "term:8")}
if not FULL:
    CELLS = [c for c in CELLS if c in IN_MAKE_TEST | IN_CAMPAIGN]


@pytest.mark.parametrize(
    "ranks,workers,stop",
    [c if c in IN_MAKE_TEST else pytest.param(*c, marks=pytest.mark.slow) for c in CELLS],
)
def test_a_stopped_and_resumed_lightning_run_equals_the_uninterrupted_one(tmp_path, ranks, workers, stop):
    if ranks > 1:
        pytest.importorskip("torch.distributed")
    _cell(tmp_path, ranks, workers, stop)


# An IterableDataset (no len(): Lightning fetches one batch ahead), one process, 12 steps an
# epoch: kill:7 resumes step 6 (mid-epoch 0), kill:13 step 12 (the end of epoch 0, which the
# loader's length cannot tell), kill:17 step 15 (mid-epoch 1); term:8 with 2 workers.
ITERABLE = [(0, "kill:7"), (0, "kill:13"), (0, "kill:17"), (2, "term:8")]
ITERABLE_IN_MAKE_TEST = {(0, "kill:7")}


@pytest.mark.parametrize(
    "workers,stop",
    [c if c in ITERABLE_IN_MAKE_TEST else pytest.param(*c, marks=pytest.mark.slow) for c in ITERABLE],
)
def test_a_resumed_run_over_an_iterable_dataset_equals_the_uninterrupted_one(tmp_path, workers, stop):
    _cell(tmp_path, 1, workers, stop, "--iterable")


@pytest.mark.slow
def test_the_control_stock_lightning_resumed_mid_epoch_diverges(tmp_path):
    """What the cells would catch, and what stock Lightning does: the same SIGKILL and
    ``ckpt_path="last"`` without ExactResume restarts the epoch's iterator (its first batches
    again) with other generators: the losses differ from the resume point on."""
    losses, _ = _reference(tmp_path, 1, 0)
    hs = tmp_path / "run"
    assert _run(hs, 1, 0, "--kill-at", "7")[0][0] == -9
    assert _run(hs, 1, 0)[0][0] == 0
    got = _losses(hs, 0, strict=False)
    assert all(got[s] == losses[0][s] for s in range(1, 7))  # before the resume point: the same run
    assert all(got[s] != losses[0][s] for s in range(7, 13))  # the rest of the epoch: other batches
