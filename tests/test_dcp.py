"""txckpt under torch.distributed.checkpoint: FSDP2 (``fully_shard``) state saved by dcp.save
through TransactionalWriter and loaded by dcp.load through TransactionalReader, on real gloo
ranks (tests/dist_workers.py's launcher; nothing of torch.distributed is mocked)."""

from __future__ import annotations


import pytest

import txckpt
from tests import dcp_workers as cw
from tests import dist_workers as dw

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def _ok(run: dw.Run) -> list:
    for r in run.results:
        assert r.exitcode == 0 and r.error_type is None, run.describe() + "\n" + (r.trace or "")
    return [r.ok for r in run.results]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One FSDP2 model + Adam saved through DCP on 2 ranks (step 5), and its full state."""
    tmp = tmp_path_factory.mktemp("dcp")
    root, ref = str(tmp / "root"), str(tmp / "ref.pt")
    out = _ok(dw.launch(2, cw.save, str(tmp / "save"), root=root, step=5, ref_file=ref))
    return {"root": root, "ref": ref, "out": out, "tmp": tmp}


def test_save_commits_one_checkpoint_with_each_shard_attributed_to_its_rank(saved):
    out = saved["out"]
    path = out[0]["path"]
    assert path and txckpt.get_last_checkpoint(saved["root"]) == path
    assert [o["returned"] for o in out] == [path, path]  # dcp.save's Metadata names it on every rank
    m = txckpt.read_manifest(path)
    assert m.step == 5 and m.world_size == 2 and m.metadata == {"by": "dcp"}
    assert {n: e.rank for n, e in m.files.items()} == {
        "__0_0.distcp": 0, "__1_0.distcp": 1, ".metadata": 0, "txckpt-dcp-ranges.json": 0}
    txckpt.verify_checkpoint(path)


@pytest.mark.parametrize("world", [1, 4])
def test_load_reshards_to_equal_tensors(saved, world):
    path = saved["out"][0]["path"]
    got = _ok(dw.launch(world, cw.load, str(saved["tmp"] / f"load{world}"), path=path, ref_file=saved["ref"]))
    for g in got:
        assert g["tensors"] > 8 and g["different"] == [], g
