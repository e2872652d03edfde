"""Resume equivalence for an accelerate loop (issue 32): tests/children/accelerate_equivalence.py
is the loop accelerate's documentation shows (``prepare(model, optimizer, dataloader)``, a
shuffled DataLoader, a model with dropout, ``save_state`` every 2 steps, ``load_state()`` and
``skip_first_batches`` on the restart). A run stopped mid-epoch in its second epoch (SIGKILL on
every process, or SIGTERM to the last process with ``save_on_preemption=True``: every process
saves that step at the boundary and exits 143) and restarted logs, on every process, the loss
the uninterrupted run logged at every step, bit for bit, and ends with the same weights.

Cells: 1 and 2 processes (gloo, CPU) x DataLoader workers 0 and 2 x SIGKILL and SIGTERM;
synchronous saves only: ``TransactionalAccelerator.save_state`` has no asynchronous form. Two
cells run in `make test`, the rest in the campaign, where each is also run with stock
``accelerate.Accelerator`` (resuming from its newest ``step_<n>`` directory; SIGTERM kills it):
stock diverges in every cell (it restores the RNGs before the epoch's iterator draws its order
and seeds: txckpt/integrations/_accelerate/epoch.py), txckpt is exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.equivalence import final_weights, logged_losses

from tests.harness import sampling

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "tests" / "children" / "accelerate_equivalence.py"
STOP = {1: 15, 2: 9}  # mid-way through the second epoch: 12 steps an epoch on one process, 6 on two
_REFERENCE: dict[tuple[int, int, tuple[str, ...]], tuple[list[dict[int, float]], str]] = {}


def _run(out: Path, ranks: int, workers: int, stop: str, *extra: str) -> list[tuple[int, str]]:
    """Run every process of the loop; (exit status, output) per process. A process that SIGTERM
    killed (stock has no preemption save) leaves its peers blocked in a collective: they are
    SIGKILLed then, as a launcher ends the rest of a failed group."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TXCKPT_COORDINATION_TIMEOUT="120")
    base = [sys.executable, str(CHILD), str(out), str(workers), stop, *extra]
    if ranks > 1:
        store = f"{out}.store.{len(list(out.parent.glob(out.name + '.store.*')))}"
        base += ["--world", str(ranks), "--store", store]
    procs = [
        subprocess.Popen(
            base + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )
        for r in range(ranks)
    ]
    results: dict[int, tuple[int, str]] = {}
    for r in reversed(range(ranks)):  # the last process is the one SIGTERM reaches
        text, _ = procs[r].communicate(timeout=300)
        results[r] = (procs[r].returncode, text)
        if procs[r].returncode == -15:
            for p in procs[:r]:
                p.kill()
    return [results[r] for r in range(ranks)]


def _losses(out: Path, rank: int, *, strict: bool = True) -> dict[int, float]:
    return logged_losses(f"{out}.losses.r{rank}", rank=rank, strict=strict)


def _reference(
    tmp_path: Path, ranks: int, workers: int, flags: tuple[str, ...] = ()
) -> tuple[list[dict[int, float]], str]:
    key = (ranks, workers, flags)
    if key not in _REFERENCE:
        out = tmp_path / "reference"
        done = _run(out, ranks, workers, "0", *flags)
        assert all(code == 0 for code, _ in done), [(c, t[-2000:]) for c, t in done]
        weights = {final_weights(text) for _, text in done}
        assert len(weights) == 1, weights
        _REFERENCE[key] = ([_losses(out, r) for r in range(ranks)], weights.pop())
    return _REFERENCE[key]


def stopped_and_resumed(
    tmp_path: Path, ranks: int, workers: int, stop: str, *, stock: bool = False, flags: tuple[str, ...] = ()
):
    """(each process's losses, the final weights) of the run stopped at ``stop`` and restarted."""
    out = tmp_path / ("stock" if stock else "run")
    flag = [*flags, "--stock"] if stock else [*flags]
    first = _run(out, ranks, workers, stop, *flag)
    killed = stop.startswith("kill")
    expected = {-9} if killed else ({-15, -9} if stock else {143})
    assert {code for code, _ in first} <= expected, [(c, t[-2000:]) for c, t in first]
    again = _run(out, ranks, workers, "0", "resume", *flag)
    assert all(code == 0 for code, _ in again), [(c, t[-2000:]) for c, t in again]
    return [_losses(out, r, strict=not stock) for r in range(ranks)], final_weights(again[0][1]), out


def _cell(tmp_path: Path, ranks: int, workers: int, stop: str, flags: tuple[str, ...] = ()) -> None:
    losses, weights = _reference(tmp_path, ranks, workers, flags)
    assert len(losses[0]) == 36 // ranks
    got, got_weights, out = stopped_and_resumed(tmp_path, ranks, workers, stop, flags=flags)
    for r in range(ranks):
        assert got[r] == losses[r], (
            r,
            {
                s: (losses[r].get(s), got[r].get(s))
                for s in set(losses[r]) | set(got[r])
                if losses[r].get(s) != got[r].get(s)
            },
        )
    assert got_weights == weights
    if stop.startswith("term"):  # the preemption saved the step on every process: the restart re-ran nothing
        for r in range(ranks):
            assert sum(1 for _ in open(f"{out}.losses.r{r}")) == len(losses[r])


def _stock_diverges(tmp_path: Path, ranks: int, workers: int, stop: str, flags: tuple[str, ...] = ()) -> None:
    losses, weights = _reference(tmp_path, ranks, workers, flags)
    got, got_weights, _ = stopped_and_resumed(tmp_path, ranks, workers, stop, stock=True, flags=flags)
    at = int(stop.partition(":")[2])
    for r in range(ranks):  # the same run up to the last save before the stop, another one after it
        assert all(got[r][s] == losses[r][s] for s in range(1, at - at % 2 + 1))
        assert any(got[r][s] != losses[r][s] for s in range(at, len(losses[r]) + 1))
    assert got_weights != weights


CELLS = [(ranks, workers, f"{how}:{STOP[ranks]}") for ranks in (1, 2) for workers in (0, 2) for how in ("kill", "term")]
IN_MAKE_TEST = {(1, 0, "kill:15"), (2, 2, "term:9")}


@pytest.mark.parametrize("ranks,workers,stop", [c for c in CELLS if c in IN_MAKE_TEST])
def test_a_stopped_and_resumed_accelerate_loop_equals_the_uninterrupted_one(tmp_path, ranks, workers, stop):
    _cell(tmp_path, ranks, workers, stop)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,workers,stop", CELLS)
def test_stock_accelerate_diverges_where_transactional_is_exact(tmp_path, ranks, workers, stop):
    """Each cell with stock accelerate.Accelerator (diverges after the resume point) and, for the
    cells `make test` does not run, with TransactionalAccelerator (exact). A campaign run tries
    half the cells, drawn by its sweep seed (each costs two to four runs of the loop)."""
    sampling.skip_unless_drawn("accelerate stock-vs-exact", CELLS, (ranks, workers, stop), k=len(CELLS) // 2)
    _stock_diverges(tmp_path, ranks, workers, stop)
    if (ranks, workers, stop) not in IN_MAKE_TEST:
        _cell(tmp_path, ranks, workers, stop)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,workers,stop", [(1, 0, "kill:15"), (2, 2, "term:9")])
def test_seedable_sampler_stock_diverges_where_transactional_is_exact(tmp_path, ranks, workers, stop):
    """DataLoaderConfiguration(use_seedable_sampler=True): the sampler reseeds from its epoch
    number (set_epoch). Stock diverges after the resume point; with txckpt the skip copy's epoch
    count also carries over to the prepared loader, whose next epoch would otherwise replay
    epoch 0's order (measured: without that, the third epoch diverges), and the cell is exact."""
    _stock_diverges(tmp_path, ranks, workers, stop, ("--seedable",))
    _cell(tmp_path, ranks, workers, stop, ("--seedable",))
