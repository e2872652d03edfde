"""examples/preemption/: the SLURM batch script and the Kubernetes Job run the same training
command, and that command saves on the scheduler's signal, and resumes when started again (issue
45 item 11). The batch script runs here under plain bash (no SLURM: the #SBATCH lines are
comments; a fake `scontrol` records the requeue); the pod's command runs as its PID 1 would,
receiving SIGTERM itself. The run waits at an exact step for the signal
(TXCKPT_EXAMPLE_PAUSE_AT, through the interpreter's wakeup fd): no sleeps."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

import txckpt

pytestmark = pytest.mark.process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples", "preemption")


def sbatch_command() -> list[str]:
    text = open(os.path.join(EXAMPLES, "sbatch.sh")).read()
    (line,) = re.findall(r"^TRAIN=\((.*)\)$", text, re.M)
    return shlex.split(line)


def pod_command() -> list[str]:
    text = open(os.path.join(EXAMPLES, "pod.yaml")).read()
    (line,) = re.findall(r"^\s+command: (\[.*\])$", text, re.M)
    return json.loads(line)


def test_the_batch_script_and_the_pod_run_the_same_command():
    import yaml

    command = sbatch_command()
    assert command == pod_command() and command[:2] == ["python", "train.py"]
    pod = yaml.safe_load(open(os.path.join(EXAMPLES, "pod.yaml")))["spec"]
    (container,) = pod["template"]["spec"]["containers"]
    assert container["command"] == command  # what the regex read is what Kubernetes reads
    grace = float(command[command.index("--grace") + 1])
    assert pod["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    script = open(os.path.join(EXAMPLES, "sbatch.sh")).read()
    assert "#SBATCH --requeue" in script and re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", script, re.M)
    assert int(re.search(r"--signal=B:USR1@(\d+)", script).group(1)) > grace


@pytest.fixture
def workdir(tmp_path):
    """The job's working directory (train.py beside it, as in the image and the submit directory),
    and a PATH where `python` is this interpreter and `scontrol` a fake that records its arguments."""
    shutil.copy(os.path.join(EXAMPLES, "train.py"), tmp_path / "train.py")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')  # the venv's
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        SLURM_JOB_ID="4242",
        TXCKPT_DURABLE="0",
    )
    return tmp_path, env


def _start(cmd: list[str], cwd, env, pause_at: int | None) -> subprocess.Popen:
    env = dict(env, **({"TXCKPT_EXAMPLE_PAUSE_AT": str(pause_at)} if pause_at else {}))
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _until_paused(proc: subprocess.Popen) -> str:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("paused at step"):
            return "".join(seen)
    proc.wait()
    raise AssertionError("the run ended before it paused:\n" + "".join(seen))


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def _newest_step(root: str) -> int:
    txckpt.forget_roots()
    return txckpt.verify_checkpoint(txckpt.get_last_checkpoint(root)).step


@pytest.mark.parametrize("how", ["time-limit", "job-wide"])
def test_the_batch_script_saves_requeues_and_the_requeued_job_resumes(workdir, how):
    """time-limit: `--signal=B:USR1@120`, the batch shell alone, which forwards SIGTERM once.
    job-wide: scancel / SLURM's preemption, SIGTERM to every process of the job."""
    cwd, env = workdir
    script = os.path.join(EXAMPLES, "sbatch.sh")
    job = _start(["bash", script], cwd, env, pause_at=7)
    before = _until_paused(job)
    if how == "time-limit":
        job.send_signal(signal.SIGUSR1)
    else:
        os.killpg(job.pid, signal.SIGTERM)
    status, out = _finish(job)
    out = before + out
    assert status == 0, out
    assert "preempted at step 7: saved, exiting with 143" in out
    assert "training exited with status 143 (preempted: 1)" in out
    assert open(cwd / "scontrol.log").read().split() == ["requeue", "4242"]
    assert _newest_step(str(cwd / "checkpoints" / "run")) == 7
    # The requeued job: the same script, from the top.
    status, out = _finish(_start(["bash", script], cwd, env, pause_at=None))
    assert status == 0, out
    assert "resumed from step 7" in out and "finished at step 200" in out
    assert open(cwd / "scontrol.log").read().split() == ["requeue", "4242"]  # not requeued again
    assert _newest_step(str(cwd / "checkpoints" / "run")) == 200


def test_the_pod_command_saves_on_sigterm_and_the_next_pod_resumes(workdir):
    cwd, env = workdir
    pod = _start(pod_command(), cwd, env, pause_at=120)
    _until_paused(pod)
    pod.send_signal(signal.SIGTERM)  # what the kubelet sends PID 1
    status, out = _finish(pod)
    assert status == 128 + signal.SIGTERM, out  # podFailurePolicy's onExitCodes: [143]
    assert _newest_step(str(cwd / "checkpoints" / "run")) == 120
    status, out = _finish(_start(pod_command(), cwd, env, pause_at=None))
    assert status == 0 and "resumed from step 120" in out and "finished at step 200" in out, out
