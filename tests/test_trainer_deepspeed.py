"""Trainer + DeepSpeed ZeRO-3 through TransactionalTrainer: 2 ranks (torchrun, gloo, CPU).

One story in four real runs (tests/children/trainer_deepspeed_zero3.py), each rank its own process:

1. run A saves checkpoint-2 and -4; rank 1 SIGKILLs itself in the middle of the save of step 6,
   after DeepSpeed wrote its ZeRO shards into staging: nothing commits, checkpoint-4 stays the
   latest;
2. ``resume_from_checkpoint=True`` resumes it from checkpoint-4 on both ranks and saves 6 and 8
   with ``save_total_limit=2`` (retention leaves 6 and 8);
3. the rollback (the seed report's scenario, shared/seed/000_*): run B resumes from checkpoint-6
   with other data, and rank 1 is killed while it re-saves step 8, which run A's abandoned lineage
   has: run A's checkpoint-8 is untouched, checkpoint-6 is the latest;
4. the restart (``resume_from_checkpoint=True``) continues run B from 6 and commits its own 8.

Between 2 and 3, docs/distributed.md's consolidation recipe runs on the committed checkpoint-8
(tests/children/trainer_zero_consolidate.py): from_pretrained refuses it, DeepSpeed's
get_fp32_state_dict_from_zero_checkpoint rebuilds the weights, and the checkpoint is unchanged.

Every committed manifest records each ``zero_pp_rank_{r}_*`` file (and ``rng_state_{r}.pth``)
as rank r's: each rank hashed its own shards; rank 0 did not read them back.
The DeepSpeed import is checked in a subprocess; without it the test skips with the reason.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import txckpt  # noqa: E402
from tests.harness.procs import torchrun as run_torchrun  # noqa: E402

HERE = Path(__file__).parent / "children"
pytestmark = [pytest.mark.trainer, pytest.mark.distributed, pytest.mark.campaign, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def deepspeed_importable():
    p = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"deepspeed cannot be imported here ({last}); .ci/run installs deepspeed==0.19.8")


def torchrun(out, max_steps, resume, seed=0, kill="-", limit="-", expect_ok=True):
    return run_torchrun(
        str(HERE / "trainer_deepspeed_zero3.py"),
        out,
        max_steps,
        resume,
        seed,
        kill,
        limit,
        timeout=600,
        expect_ok=expect_ok,
    )


def current(out):
    """The current lineage's committed checkpoints by step."""
    txckpt.forget_roots()
    return {c.step: c for c in txckpt.CheckpointRoot(out).checkpoints()}


def by_txid(out, txid):
    txckpt.forget_roots()
    return next(c for c in txckpt.CheckpointRoot(out).checkpoints(lineage="all") if c.txid == txid)


def ranks(path):
    """Each recorded file's writer: read_manifest reads a 2-rank save's per-rank parts too."""
    return {n: e.rank for n, e in txckpt.read_manifest(path).files.items()}


def assert_sharded_and_attributed(path, step):
    """The ZeRO-3 checkpoint: both ranks' shards, each recorded as its writer's; verified."""
    files = ranks(path)
    for r in (0, 1):
        shards = {n for n in files if n.startswith(f"global_step{step}/zero_pp_rank_{r}_mp_rank_00_")}
        assert {s.rsplit("_", 2)[-2] for s in shards} == {"model", "optim"}, files
        assert {files[s] for s in shards} == {r}, files
        assert files[f"rng_state_{r}.pth"] == r
    assert "model.safetensors" not in files  # ZeRO-3 without gathering: no consolidated weights
    assert files["latest"] == files["trainer_state.json"] == 0
    txckpt.verify_checkpoint(path)


def consolidate(ckpt, dest):
    """docs/distributed.md's recipe: from_pretrained refuses the sharded checkpoint; DeepSpeed's
    get_fp32_state_dict_from_zero_checkpoint rebuilds the weights from the committed shards."""
    p = subprocess.run(
        [sys.executable, str(HERE / "trainer_zero_consolidate.py"), str(ckpt), str(dest)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(HERE),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert p.returncode == 0, p.stderr[-6000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    assert found["refused"] and "model.safetensors" in found["refused"]
    assert found["keys"] == ["fc.bias", "fc.weight"] and found["round_trip"]
    manifest = txckpt.read_manifest(ckpt)
    on_disk = {os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs}
    # the consolidation wrote nothing into the checkpoint: its files, the manifest, its parts (/2)
    assert on_disk == set(manifest.files) | {txckpt.MANIFEST_NAME} | set(manifest.meta_files())


def file_digests(path):
    return {n: e.checksum for n, e in txckpt.read_manifest(path).files.items()}


def test_zero3_save_kill_resume_rollback_retention(tmp_path):
    out = tmp_path / "out"

    # 1. A rank killed mid-save: nothing commits.
    p = torchrun(out, 8, "none", kill=6, expect_ok=False)
    assert "rank 1: killing myself while saving step 6" in p.stdout and "zero_pp_rank_1_mp_rank_00_optim" in p.stdout, (
        f"{p.stdout}\n--- stderr\n{p.stderr[-6000:]}"
    )
    txckpt.forget_roots()
    assert [c.step for c in txckpt.CheckpointRoot(out).checkpoints(lineage="all")] == [2, 4]
    assert not (out / "checkpoint-6").exists()
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(out) == str(out / "checkpoint-4")
    for step in (2, 4):
        assert_sharded_and_attributed(out / f"checkpoint-{step}", step)

    # 2. Resume, and retention (save_total_limit=2 of the current lineage).
    p = torchrun(out, 8, "true", limit=2)
    assert p.stdout.count("training begins at global_step=4") == 2, p.stdout
    assert "rank 0: finished at step 8" in p.stdout and "rank 1: finished at step 8" in p.stdout
    a = current(out)
    assert sorted(a) == [6, 8], sorted(a)
    assert not (out / "checkpoint-2").exists() and not (out / "checkpoint-4").exists()
    for step in (6, 8):
        assert_sharded_and_attributed(a[step].path, step)
    a8 = file_digests(a[8].path)
    consolidate(a[8].path, tmp_path / "consolidated")

    # 3. Roll back to checkpoint-6 with other data; rank 1 dies while re-saving step 8.
    p = torchrun(out, 8, str(out / "checkpoint-6"), seed=1, kill=8, expect_ok=False)
    assert p.stdout.count("training begins at global_step=6") == 2, p.stdout
    assert "rank 1: killing myself while saving step 8" in p.stdout
    assert "rolling back" in p.stderr and a[8].txid in p.stderr, p.stderr[-6000:]
    abandoned = by_txid(out, a[8].txid)
    assert abandoned.state == "abandoned"
    assert file_digests(abandoned.path) == a8  # run A's checkpoint-8: every file as committed
    txckpt.verify_checkpoint(abandoned.path)
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(out) == str(out / "checkpoint-6")
    assert sorted(current(out)) == [6]

    # 4. The restart continues run B's lineage from 6 and commits its own checkpoint-8.
    p = torchrun(out, 8, "true", seed=1, limit=2)
    assert p.stdout.count("training begins at global_step=6") == 2, p.stdout
    b = current(out)
    assert sorted(b) == [6, 8] and b[6].txid == a[6].txid and b[8].txid != a[8].txid
    txckpt.forget_roots()
    assert os.path.realpath(txckpt.get_last_checkpoint(out)) == os.path.realpath(b[8].path)
    assert_sharded_and_attributed(b[8].path, 8)
    assert file_digests(b[8].path) != a8
    assert file_digests(by_txid(out, a[8].txid).path) == a8  # still intact after the re-save
    txckpt.verify_checkpoint(by_txid(out, a[8].txid).path)
