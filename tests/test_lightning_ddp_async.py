"""TransactionalCheckpointIO(async_save=True) under DDP (issue 48): Lightning calls its
CheckpointIO on global rank 0 alone, so rank 0 snapshots before save_checkpoint returns and
commits in the background without any collective the other ranks would have to join
(txckpt/_async/asyncsave.py's ``submit(alone=True)``). tests/children/lightning_preempt.py is the
run: two gloo ``ddp`` ranks, each its own process (as torchrun starts them), a checkpoint every 3
steps, ``fit(ckpt_path="last")`` for every start, ExactResume. Rank 0 is SIGKILLed inside the
background save of step 9, right before its commit entry (the child reports the thread that was
saving through a file, written before the kill: no sleep); the job's other rank is then killed
as a scheduler would. The restart resumes step 6 on both ranks, and ends with the uninterrupted
run's losses and weights, bit for bit."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

import txckpt
from tests.harness.zygote import popen_python

pytest.importorskip("lightning")
pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.process, pytest.mark.lightning]

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tests" / "children" / "lightning_preempt.py"
STEPS = 12  # 6 steps an epoch on two ranks: the kill at step 9 is mid-epoch 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(hs: Path, run: Path, *args: str) -> list:
    """Both ranks of one two-rank async run, each its own process."""
    hs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TXCKPT_COORDINATION_TIMEOUT="120")
    base = [str(RUN), "--dir", str(run), "--hs", str(hs), "--every", "3", "--max-steps", str(STEPS)]
    base += ["--async", "--exact", "--world", "2", "--port", str(_free_port()), *args]
    procs = []
    for r in range(2):
        log = open(hs / f"out-rank{r}-{len(list(hs.glob(f'out-rank{r}-*')))}", "w+")
        procs.append((popen_python(base + ["--rank", str(r)], env=env, stdout=log, stderr=log), log))
    return procs


def _finish(procs: list) -> list[tuple[int, str]]:
    results = []
    for p, log in procs:
        code = p.wait(300)
        log.seek(0)
        results.append((code, log.read()))
        log.close()
    return results


def _losses(hs: Path, rank: int) -> dict[int, float]:
    """step -> loss of one rank; a step logged again after the resume must log the same loss."""
    seen: dict[int, float] = {}
    for line in open(hs / f"losses-rank{rank}"):
        step, loss = json.loads(line)
        assert seen.setdefault(step, loss) == loss, f"rank {rank}: step {step} logged {seen[step]} and then {loss}"
    return seen


def _weights(output: str) -> str:
    return next(line.split()[1] for line in output.splitlines() if line.startswith("WEIGHTS "))


def _committed_steps(root: Path) -> list[int]:
    txckpt.forget_roots()
    history = txckpt.open_root(str(root)).history()
    return sorted(c.step for c in history.checkpoints.values() if c.txid not in history.retired)


def test_ddp_async_saves_commit_from_rank_0_and_a_kill_mid_save_resumes_the_previous_step(tmp_path):
    reference = _finish(_start(tmp_path / "reference", tmp_path / "reference-run"))
    assert all(code == 0 for code, _ in reference), [t[-3000:] for _, t in reference]
    assert _committed_steps(tmp_path / "reference-run") == [3, 6, 9, 12]
    for step in (3, 6, 9, 12):  # every async save committed whole, under ModelCheckpoint's name
        (name,) = (tmp_path / "reference-run").glob(f"epoch=*-step={step}.ckpt")
        txckpt.verify_checkpoint(str(tmp_path / "reference-run" / f"checkpoint-{step}"))  # raises if torn
        assert os.path.samefile(name, tmp_path / "reference-run" / f"checkpoint-{step}" / name.name)

    hs, run = tmp_path / "run", tmp_path / "run-dir"
    procs = _start(hs, run, "--die-committing", "9")
    (rank0, _), (rank1, _) = procs
    assert rank0.wait(300) == -9
    rank1.kill()  # its peer is gone: the scheduler ends the job
    _finish(procs)
    # Rank 0 died in its background saver, the training thread going on beside it.
    assert (hs / "died-in").read_text().startswith("txckpt-async-save")
    assert _committed_steps(run) == [3, 6]  # step 9 staged, never committed
    assert sorted(p.name for p in run.glob("*.ckpt")) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]

    again = _finish(_start(hs, run))
    assert all(code == 0 for code, _ in again), [t[-3000:] for _, t in again]
    for r in range(2):  # "last" on every rank: the newest committed step, not the one killed
        assert json.loads((hs / f"start-rank{r}.json").read_text())["step"] == 6
        assert _losses(hs, r) == _losses(tmp_path / "reference", r)
    assert _weights(again[0][1]) == _weights(reference[0][1])
    assert _committed_steps(run) == [3, 6, 9, 12]
