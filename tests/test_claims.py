"""Per-rank attribution (issue 17): files other code writes into ``tx.directory`` on rank r and
that rank r claims (``tx.claim_files``) are hashed by rank r and recorded with ``rank: r``;
rank 0 never opens them for reading at commit. Real gloo ranks (tests/harness/launcher.py)."""

from __future__ import annotations

import os

import pytest

import txckpt
from tests.children import claim_workers as cw
from tests.harness import launcher
from txckpt._manifest.claims import claimed_names, matches

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _shard(step: int, r: int) -> str:
    return f"global_step{step}/zero_pp_rank_{r}_mp_rank_00_model_states.pt"


def test_each_rank_hashes_and_records_what_it_claims(tmp_path):
    root = str(tmp_path / "out")
    run = launcher.launch(2, cw.claim_own_files, str(tmp_path / "res"), root=root, step=3)
    for r in run.results:
        assert r.exitcode == 0 and r.ok is not None, run.describe() + "\n" + (r.trace or "")
    path = run[0].ok["path"]
    assert run[1].ok["path"] == path == os.path.join(root, "checkpoint-3")
    manifest = txckpt.verify_checkpoint(path)
    assert {n: e.rank for n, e in manifest.files.items()} == {
        _shard(3, 0): 0,
        "model/__0_0.distcp": 0,
        _shard(3, 1): 1,
        "model/__1_0.distcp": 1,
        "config.json": 0,  # claimed by no one: rank 0 hashes it at commit, as before claims
    }
    assert manifest.files[_shard(3, 1)].size == 4097
    # Each rank read exactly its own claimed files (to hash them); rank 0 read config.json,
    # which nobody claimed, and none of rank 1's bytes.
    assert run[1].ok["read"] == sorted([_shard(3, 1), "model/__1_0.distcp"])
    assert run[0].ok["read"] == sorted([_shard(3, 0), "model/__0_0.distcp", "config.json"])


def test_without_claims_rank0_hashes_everything(tmp_path):
    """The baseline the claims change: rank 0 reads rank 1's files and records them as its own."""
    root = str(tmp_path / "out")
    run = launcher.launch(2, cw.claim_own_files, str(tmp_path / "res"), root=root, step=1, claims="none")
    assert all(r.exitcode == 0 for r in run.results), run.describe()
    manifest = txckpt.read_manifest(run[0].ok["path"])
    assert {e.rank for e in manifest.files.values()} == {0}
    assert _shard(1, 1) in run[0].ok["read"] and run[1].ok["read"] == []


@pytest.mark.parametrize("case", ["claimed twice", "missing name"])
def test_bad_claims_commit_nothing_on_any_rank(tmp_path, case):
    root = str(tmp_path / "out")
    kw = {"claims": "both"} if case == "claimed twice" else {"missing": 1}
    run = launcher.launch(2, cw.claim_own_files, str(tmp_path / "res"), root=root, step=2, **kw)
    for r in run.results:
        assert r.exitcode == 17 and r.error_type == "InvalidArgumentError", run.describe()
        if case == "claimed twice":
            assert f"{_shard(2, 0)!r} was written by rank 0 and rank 1" in r.error
        else:
            assert "rank 1:" in r.error and "never-written.bin" in r.error and "claim only files" in r.error
    assert len({r.error for r in run.results}) == 1, "every rank raises the same error"
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(root) is None
    assert (
        not os.path.exists(os.path.join(root, ".txckpt", "tx")) or os.listdir(os.path.join(root, ".txckpt", "tx")) == []
    )


def test_claim_rules():
    # A glob without "/" matches base names at any depth; with "/", the whole relative path.
    assert matches("global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt", "*zero_pp_rank_1_mp_rank_*")
    assert matches("global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "*zero_pp_rank_1_mp_rank_*")
    assert not matches("global_step4/zero_pp_rank_11_mp_rank_00_optim_states.pt", "*zero_pp_rank_1_mp_rank_*")
    assert matches("pytorch_model_fsdp_0/__1_0.distcp", "__1_*.distcp")
    assert not matches("pytorch_model_fsdp_0/__11_0.distcp", "__1_*.distcp")
    assert not matches("a/b/__1_0.distcp", "a/__1_*.distcp") and matches("a/__1_0.distcp", "a/__1_*.distcp")
    assert matches("rng_state_1.pth", "rng_state_1.pth") and not matches("x/rng_state_1.pth", "rng_state_1.pth")
    # This rank's tx.open files are hashed already: skipped, not claimed twice.
    assert claimed_names(["a.bin", "b.bin"], ["*.bin"], {"a.bin"}) == ["b.bin"]
    with pytest.raises(txckpt.errors.InvalidArgumentError, match="claim only files"):
        claimed_names(["a.bin"], ["b.bin"], set())
    with pytest.raises(txckpt.errors.InvalidArgumentError):
        txckpt._manifest.claims.check_claims(["../up.bin"])


def test_claims_on_a_remote_root(memory_root):
    """On an object store each rank uploads its own scratch directory (recorded as its files
    already); a claim there only has to name files that exist."""
    url, opts = memory_root
    with txckpt.transaction(url, 1, storage_options=opts) as tx:
        with open(os.path.join(tx.directory, "zero_pp_rank_0_mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"x" * 100)
        tx.save("own.json", {"a": 1})  # a tx.save file may be claimed too (it is this rank's already)
        tx.claim_files(["*zero_pp_rank_0_mp_rank_*", "zero_pp_rank_0_mp_rank_00_model_states.pt", "own.json"])
    manifest = txckpt.read_manifest(tx.path, storage_options=opts)
    assert manifest.files["zero_pp_rank_0_mp_rank_00_model_states.pt"].size == 100
    with pytest.raises(txckpt.errors.InvalidArgumentError, match="never.bin"):
        with txckpt.transaction(url, 2, storage_options=opts) as tx:
            tx.claim_files("never.bin")
