"""DCP items in the tensor index (issue 47, protocol §3b "DCP items"): a checkpoint written through
``TransactionalWriter`` lists each tensor item (name, dtype, shape, file, byte range, digest,
``encoding: "torch_save"``), so ``inspect`` lists them, ``diff`` compares two DCP checkpoints from
digests alone and ``load_tensors`` returns one item verified; the 2-rank sharded case (chunk
names and offsets) is in tests/test_dcp.py. One process, ``no_dist=True``."""

from __future__ import annotations

import os

import pytest
import torch

import txckpt
from txckpt.errors import IntegrityError, InvalidArgumentError, TensorIntegrityError
from txckpt._manifest.tensor_index import TORCH_SAVE_ENCODING, FileIndex, TensorRecord
from txckpt._tensors.inspect import TensorInfo
from txckpt._tensors.load import _to_tensor

dcp = pytest.importorskip("torch.distributed.checkpoint")
from txckpt.integrations.dcp import TransactionalWriter  # noqa: E402

SHARD = "__0_0.distcp"


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16)},
        "step": 3,  # a byte item: not a tensor, not listed
        "extra": {"ids": torch.arange(5)},
    }


def _save(root: str, step: int, state: dict, **kw) -> str:
    writer = TransactionalWriter(root, step, **kw)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.path is not None
    return writer.path


def test_inspect_lists_each_tensor_item_of_a_dcp_checkpoint(tmp_path):
    path = _save(str(tmp_path / "root"), 1, _state())
    info = txckpt.inspect_checkpoint(path)
    by_name = {t.name: t for t in info.tensors}
    assert set(by_name) == {"model.w", "model.b", "extra.ids"}
    assert {n: (t.dtype, t.shape, t.file, t.encoding) for n, t in by_name.items()} == {
        "model.w": ("F32", (64, 32), SHARD, TORCH_SAVE_ENCODING),
        "model.b": ("BF16", (32,), SHARD, TORCH_SAVE_ENCODING),
        "extra.ids": ("I64", (5,), SHARD, TORCH_SAVE_ENCODING),
    }
    # Each record's bytes are the item's torch.save stream, at the range the index gives.
    with open(os.path.join(path, SHARD), "rb") as f:
        data = f.read()
    state = _state()
    saved = {"model.w": state["model"]["w"], "model.b": state["model"]["b"], "extra.ids": state["extra"]["ids"]}
    for name, t in by_name.items():
        stream = data[t.offset : t.offset + t.nbytes]
        assert stream[:2] == b"PK"  # a zip archive: torch.save's, not the raw tensor
        got = txckpt.load_tensors(path, [name])[name]
        assert torch.equal(got, saved[name]), name
    entry = txckpt.read_manifest(path).files[SHARD]
    assert entry.index is not None and {r.fqn for r in entry.index.tensors} == set(by_name)
    assert all(r.chunk_offsets is None for r in entry.index.tensors)  # whole tensors: no chunk offsets
    txckpt.verify_checkpoint(path)


def test_diff_of_two_dcp_checkpoints_from_digests(tmp_path):
    root = str(tmp_path / "root")
    state = _state()
    a = _save(root, 1, state)
    state["model"]["w"][3, 4] += 1
    state["extra"]["ids"] = state["extra"]["ids"].to(torch.int32)
    state["extra"]["new"] = torch.ones(2)
    b = _save(root, 2, state)
    d = txckpt.diff_checkpoints(a, b)
    status = {c.key: c.status for c in d.changes}
    assert status == {"model.w": "changed", "model.b": "same", "extra.ids": "changed", "extra.new": "added"}
    assert [c.key for c in d.changes if c.dtype_changed] == ["extra.ids"]


def test_an_incremental_dcp_save_lists_the_items_of_shared_files(tmp_path):
    root = str(tmp_path / "root")
    state = {"base": torch.randn(512, 1024), "head": torch.randn(8)}  # base: 2 MiB, a file of its own
    a = _save(root, 1, state, incremental=True)
    state["head"] += 1
    b = _save(root, 2, state, incremental=True)
    ta = {t.name: t for t in txckpt.inspect_checkpoint(a).tensors}
    tb = {t.name: t for t in txckpt.inspect_checkpoint(b).tensors}
    assert set(ta) == set(tb) == {"base", "head"}
    base_b = os.path.join(b, tb["base"].file)
    assert os.stat(base_b).st_ino == os.stat(os.path.join(a, ta["base"].file)).st_ino  # shared, not written
    assert {c.key: c.status for c in txckpt.diff_checkpoints(a, b).changes} == {"base": "same", "head": "changed"}
    assert torch.equal(txckpt.load_tensors(b, ["base"])["base"], state["base"])


def test_a_damaged_item_is_named_and_the_others_still_load(tmp_path):
    path = _save(str(tmp_path / "root"), 1, _state())
    w = {t.name: t for t in txckpt.inspect_checkpoint(path).tensors}["model.w"]
    shard = os.path.join(path, SHARD)
    os.chmod(shard, 0o644)
    with open(shard, "r+b") as f:
        f.seek(w.offset + w.nbytes - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(TensorIntegrityError) as e:
        txckpt.load_tensors(path, ["model.w"])
    assert e.value.tensor == "model.w"
    assert torch.equal(txckpt.load_tensors(path, ["model.b"])["model.b"], _state()["model"]["b"])
    with pytest.raises(IntegrityError, match=r"1 of its 3 tensors changed: 'model.w'"):
        txckpt.verify_checkpoint(path)


def test_records_round_trip_and_older_records_read_as_raw():
    item = TensorRecord("w[4:8,0:16]", "F32", (4, 16), 100, 900, "ab" * 16, TORCH_SAVE_ENCODING, "w", (4, 0))
    raw = {"chunk_size": 1 << 24, "chunks": [], "tensors": {item.name: item.to_json()}}
    assert FileIndex.from_json("__0_0.distcp", raw, 2000).tensors == (item,)
    older = {"dtype": "F32", "shape": [2], "offset": 8, "length": 8, "xxh3_128": "cd" * 16}
    (rec,) = FileIndex.from_json(
        "m.safetensors", {"chunk_size": 1 << 24, "chunks": [], "tensors": {"x": older}}, 16
    ).tensors
    assert (rec.encoding, rec.fqn, rec.chunk_offsets) == (None, None, None)
    assert rec.to_json() == older  # written back as it was: no new keys on a safetensors record


def test_bytes_of_an_unknown_encoding_are_never_read_as_raw():
    t = TensorInfo("w", "f.bin", "F32", (2,), 8, "00" * 16, 0, "zstd")
    with pytest.raises(InvalidArgumentError, match="zstd"):
        _to_tensor(t, b"\0" * 8, "cpu")
    # A torch_save record whose stream holds another shape than recorded is refused after all.
    import io

    buf = io.BytesIO()
    torch.save(torch.zeros(3), buf)
    wrong = TensorInfo("w", "f.distcp", "F32", (2,), len(buf.getvalue()), "00" * 16, 0, TORCH_SAVE_ENCODING)
    with pytest.raises(IntegrityError, match="shape"):
        _to_tensor(wrong, buf.getvalue(), "cpu")
