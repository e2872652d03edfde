"""Two ranks (torchrun --nproc_per_node 2, gloo, CPU) through TransactionalTrainer.

Rank 1 SIGKILLs itself in the middle of the save of step 4 (its rng_state_1.pth is written into
staging, the commit has not happened). Nothing may be committed for step 4, and the restart with
resume_from_checkpoint=True resumes from checkpoint-2 on both ranks. Every committed manifest
lists both ranks' rng_state files.
"""

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import txckpt  # noqa: E402
from tests.harness.procs import torchrun as run_torchrun  # noqa: E402

HERE = Path(__file__).parent / "children"
pytestmark = [pytest.mark.trainer, pytest.mark.distributed]


def torchrun(*args, expect_ok=True):
    return run_torchrun(str(HERE / "trainer_ddp.py"), *args, expect_ok=expect_ok)


def manifest_files(path):
    return set(txckpt.read_manifest(path).files)  # a 2-rank save's table is in per-rank parts (/2)


def test_rank_killed_mid_save_commits_nothing_and_restart_resumes(tmp_path):
    out = tmp_path / "out"
    p = torchrun(out, 4, "none", 4, expect_ok=False)
    assert "rank 1: killing myself while saving step 4" in p.stdout, f"{p.stdout}\n--- stderr\n{p.stderr[-6000:]}"

    txckpt.forget_roots()
    everything = txckpt.CheckpointRoot(out).checkpoints(lineage="all")
    assert [c.step for c in everything] == [2]
    assert not (out / "checkpoint-4").exists()
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= manifest_files(out / "checkpoint-2")
    txckpt.verify_checkpoint(out / "checkpoint-2")

    p = torchrun(out, 4, "true")
    assert p.stdout.count("training begins at global_step=2") == 2, p.stdout
    assert "rank 0: finished at step 4" in p.stdout and "rank 1: finished at step 4" in p.stdout

    txckpt.forget_roots()
    current = txckpt.CheckpointRoot(out).checkpoints()
    assert [c.step for c in current] == [2, 4]
    for c in current:
        files = manifest_files(c.path)
        assert {
            "rng_state_0.pth",
            "rng_state_1.pth",
            "model.safetensors",
            "optimizer.pt",
            "scheduler.pt",
            "trainer_state.json",
        } <= files, files
        txckpt.verify_checkpoint(c.path)
        # Each rank claimed its own RNG file (rank_files): hashed by it, recorded as its.
        ranks = {n: e.rank for n, e in txckpt.read_manifest(c.path).files.items()}
        assert ranks["rng_state_0.pth"] == 0 and ranks["rng_state_1.pth"] == 1, ranks
