"""SaveOnPreemption (issue 48): a SIGTERM (or SLURM's SIGUSR1) makes a real Lightning ``fit``
process save through TransactionalCheckpointIO at its next step boundary, every rank the same
step, and exit with 128 + the signal's number; the requeued run's ``fit(ckpt_path="last")``
resumes that step. tests/children/lightning_preempt.py is the run; this file signals it as a
scheduler does (os.kill, at a step its handshake file shows: polled with a deadline, never a
sleep) and reads the root afterwards. Without the callback the same SIGTERM stops Lightning with
nothing saved."""

from __future__ import annotations

import os
import random
import signal
import socket
import stat

import pytest

import txckpt
from tests.harness.handshake import HandshakeChild, newest_verified

pytest.importorskip("lightning")

#: Every test starts the run through Child (a class: tests/harness/tiers.py's scan sees only
#: module-level functions), so the module says it.
pytestmark = [pytest.mark.process, pytest.mark.lightning]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "tests", "children", "lightning_preempt.py")
SIGTERM_STATUS = 128 + signal.SIGTERM  # docs/preemption.md


class Child(HandshakeChild):
    deadline_s = 180.0

    def __init__(self, tmp_path, *args: str, rank: int = 0, name: str = "", env: dict | None = None) -> None:
        self._start(RUN, tmp_path, args, rank=rank, name=name, env=env)


def _saved(checkpoint: str) -> dict:
    """The Lightning checkpoint dict the committed file holds."""
    (name,) = txckpt.read_manifest(checkpoint).files
    return txckpt.load_checkpoint(checkpoint, files=[name], weights_only=False)[name]


def _saved_step(checkpoint: str) -> int:
    return int(_saved(checkpoint)["global_step"])


def test_sigterm_at_a_random_step_saves_that_boundary_exits_143_and_last_resumes_there(tmp_path):
    root = str(tmp_path / "run")
    at = random.Random().randint(2, 20)
    print("SIGTERM after step", at)
    child = Child(tmp_path, "--dir", root, "--every", "4")
    child.wait_for("step-rank{r}", at_least=at)
    child.signal(signal.SIGTERM)
    assert child.finish() == SIGTERM_STATUS, child.output()
    result = child.json("result-rank{r}.json")
    stopped = result["stopped_at"]
    assert stopped >= at and result["received"] == signal.SIGTERM and result["status"] == SIGTERM_STATUS, result
    path, manifest = newest_verified(root)
    assert manifest.step == stopped and _saved_step(path) == stopped
    name = f"epoch={_saved(path)['epoch']}-step={stopped}.ckpt"  # ModelCheckpoint's name for it
    assert os.path.samefile(os.path.join(root, name), os.path.join(path, name))
    assert f"txckpt: preemption: saved step {stopped} as {os.path.join(root, name)}" in child.output()
    # The requeued run (the same command, plus ckpt_path="last") starts from that step.
    restart = Child(tmp_path, "--dir", root, "--every", "4", "--max-steps", str(stopped + 2), name="-2")
    assert restart.finish() == 0, restart.output()
    start = restart.json("start-rank{r}.json")
    assert start["step"] == stopped and start["ckpt_path"] == os.path.join(path, name)
    assert f"finished at step {stopped + 2}; handlers installed after fit: False" in restart.output()


@pytest.mark.slow
def test_without_the_callback_sigterm_stops_lightning_with_nothing_saved_and_status_0(tmp_path):
    """Stock Lightning 2.6: its SIGTERM handler raises SIGTERMException (a SystemExit without a
    code) at the step's end: the process exits 0, as if the run had finished, and saves nothing."""
    root = str(tmp_path / "run")
    child = Child(tmp_path, "--dir", root, "--mode", "stock")
    child.wait_for("step-rank{r}", at_least=random.Random().randint(2, 20))
    child.signal(signal.SIGTERM)
    assert child.finish() == 0, child.output()
    assert child.json("result-rank{r}.json")["status"] is None
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(root, missing_ok=True) is None


def _fake_scontrol(tmp_path) -> tuple[str, str]:
    """A ``scontrol`` on PATH that records its arguments: what SLURM's requeue would get."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir), str(calls)


@pytest.mark.slow
def test_slurm_sigusr1_saves_at_the_boundary_exits_138_and_requeues_the_job(tmp_path):
    """Under SLURM (SLURMEnvironment, auto_requeue) Lightning's own handler saves hpc_ckpt from
    inside the signal handler; SaveOnPreemption takes the signal instead, saves at the step
    boundary (an async save here), and once it committed runs ``scontrol requeue`` as Lightning
    would."""
    root = str(tmp_path / "run")
    bin_dir, calls = _fake_scontrol(tmp_path)
    slurm = {
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }
    child = Child(tmp_path, "--dir", root, "--every", "4", "--async", env=slurm)  # async: requeued once committed
    at = random.Random().randint(2, 20)
    child.wait_for("step-rank{r}", at_least=at)
    child.signal(signal.SIGUSR1)
    assert child.finish() == 128 + signal.SIGUSR1, child.output()
    stopped = child.json("result-rank{r}.json")["stopped_at"]
    path, manifest = newest_verified(root)
    assert manifest.step == stopped >= at and _saved_step(path) == stopped
    assert open(calls).read().split() == ["requeue", "4242"]
    out = child.output()
    assert out.index(f"txckpt: preemption (exit): committed {path}") < out.index("requeued SLURM job 4242"), out
    assert "txckpt: preemption: requeued SLURM job 4242" in child.output()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ddp_ranks_sigterm_on_rank_1_only_both_save_the_same_step(tmp_path):
    root, port = str(tmp_path / "run"), str(_free_port())
    ranks = [Child(tmp_path, "--dir", root, "--every", "4", "--world", "2", "--port", port, rank=r) for r in range(2)]
    at = random.Random().randint(2, 10)
    ranks[1].wait_for("step-rank{r}", at_least=at)
    ranks[1].signal(signal.SIGTERM)
    codes = [c.finish() for c in ranks]
    assert codes == [SIGTERM_STATUS] * 2, [c.output()[-3000:] for c in ranks]
    results = [c.json("result-rank{r}.json") for c in ranks]
    stopped = results[0]["stopped_at"]
    assert results[1]["stopped_at"] == stopped >= at, results
    assert [r["received"] for r in results] == [0, signal.SIGTERM]  # only rank 1 got it
    path, manifest = newest_verified(root)
    assert manifest.step == stopped and _saved_step(path) == stopped
    assert "another rank received SIGTERM" in ranks[0].output()
