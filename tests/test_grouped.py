"""Grouped safetensors (issue 47, "frozen tensors are never rewritten"): an incremental save of a
dict of tensors puts the tensors unchanged since the last commit into a file of their own, in the
stock sharded layout, which the next save shares (one inode) instead of writing it again; loads
return the one dict a non-grouped save returns."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import txckpt
from txckpt.errors import ManifestError
from txckpt._manifest.tensor_index import HEAD_BYTES, index_bytes
from txckpt._save.grouped import plan_groups
from txckpt._save.serialization import tensor_bytes, write_safetensors
from txckpt._base.checksum import digest_bytes, new_hasher

import io

SHARD1, SHARD2, INDEX = (
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
)


def model(step: int, *, trained: tuple[str, ...] = ("head.w", "head.b")) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "emb": torch.randn(512, 64, generator=g),
        "block.w": torch.randn(64, 64, generator=g),
        "block.h": torch.randn(64, generator=g).to(torch.bfloat16),
        "head.w": torch.randn(64, 64, generator=g),
        "head.b": torch.randn(64, generator=g),
    }
    for name in trained:
        out[name] = out[name] + step  # "trained": new bytes every step
    return out


def stat(path: str, name: str) -> os.stat_result:
    return os.stat(os.path.join(path, name))


def weight_map(path: str) -> dict[str, str]:
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)["weight_map"]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_tensor_digest_equals_the_index_digest_of_its_bytes_in_the_file():
    tensors = {**model(3), "empty": torch.empty(0, 4), "strided": torch.randn(8, 6).t(), "flag": torch.ones(3) > 0}
    buf = io.BytesIO()
    write_safetensors(tensors, buf)
    records = {r.name: r for r in (index_bytes("m.safetensors", buf.getvalue()).tensors or ())}
    assert records.keys() == tensors.keys()
    for name, t in tensors.items():
        assert records[name].checksum == digest_bytes(tensor_bytes(t)), name


def test_frozen_tensors_get_a_file_of_their_own_shared_by_every_later_save(tmp_path):
    root = str(tmp_path)
    first = txckpt.save_checkpoint(root, 1, {"model.safetensors": model(1)}, incremental=True)
    assert sorted(os.listdir(first)) == ["model.safetensors", "txckpt-manifest.json"]  # a first save: one file
    second = txckpt.save_checkpoint(root, 2, {"model.safetensors": model(2)}, incremental=True)
    assert not os.path.exists(os.path.join(second, "model.safetensors"))
    assert weight_map(second) == {
        "emb": SHARD1,
        "block.w": SHARD1,
        "block.h": SHARD1,
        "head.w": SHARD2,
        "head.b": SHARD2,
    }
    third = txckpt.save_checkpoint(root, 3, {"model.safetensors": model(3)}, incremental=True)
    # The frozen file is the second save's inode: never written again; the trained one is new.
    assert stat(third, SHARD1).st_ino == stat(second, SHARD1).st_ino
    assert stat(third, SHARD1).st_nlink == 2
    assert stat(third, SHARD2).st_ino != stat(second, SHARD2).st_ino
    assert weight_map(third) == weight_map(second)  # a stable layout: same names, same bytes
    # Stock readers read it: safetensors' own reader, shard by shard, gives the model.
    stock = {}
    for shard in (SHARD1, SHARD2):
        with safe_open(os.path.join(third, shard), framework="pt") as f:
            stock.update({k: f.get_tensor(k) for k in f.keys()})
    assert same(stock, model(3))
    # load_checkpoint returns what a non-grouped save returns: one file, one dict.
    for kwargs in ({}, {"files": ["model.safetensors"]}):
        loaded = txckpt.load_checkpoint(third, **kwargs)
        assert list(loaded) == ["model.safetensors"] and same(loaded["model.safetensors"], model(3))
    plain = txckpt.save_checkpoint(str(tmp_path / "plain"), 3, {"model.safetensors": model(3)})
    assert same(txckpt.load_checkpoint(plain)["model.safetensors"], txckpt.load_checkpoint(third)["model.safetensors"])
    txckpt.verify_checkpoint(third)


def test_a_tensor_that_unfreezes_or_changes_dtype_or_shape_moves_out_of_the_frozen_file(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        path = txckpt.save_checkpoint(root, step, {"model.safetensors": model(step)}, incremental=True)
    frozen_ino = stat(path, SHARD1).st_ino
    # block.w starts training: the frozen file is no longer whole, the rest of it is regrouped.
    sd = model(4, trained=("head.w", "head.b", "block.w"))
    path = txckpt.save_checkpoint(root, 4, {"model.safetensors": sd}, incremental=True)
    assert weight_map(path) == {"emb": SHARD1, "block.h": SHARD1, "block.w": SHARD2, "head.w": SHARD2, "head.b": SHARD2}
    assert stat(path, SHARD1).st_ino != frozen_ino
    assert same(txckpt.load_checkpoint(path)["model.safetensors"], sd)
    # Same bytes, other dtype or shape: changed (its digest alone would call it equal).
    sd = model(5, trained=("head.w", "head.b", "block.w"))
    sd["emb"] = sd["emb"].view(torch.int32)
    sd["block.h"] = sd["block.h"].reshape(8, 8)
    path = txckpt.save_checkpoint(root, 5, {"model.safetensors": sd}, incremental=True)
    assert sorted(os.listdir(path)) == ["model.safetensors", "txckpt-manifest.json"]  # nothing unchanged
    assert same(txckpt.load_checkpoint(path)["model.safetensors"], sd)


def test_plan_keeps_tied_tensors_in_one_file_and_hashes_nothing_assumed_changed():
    sd = model(1)
    sd["tied"] = sd["head.w"]  # one storage, as GPT-2's lm_head and wte
    buf = io.BytesIO()
    write_safetensors(sd, buf)
    previous = [list(index_bytes("m.safetensors", buf.getvalue()).tensors or ())]
    sd["head.b"] = sd["head.b"] + 1
    groups = plan_groups(sd, previous)
    assert groups == [["block.h", "block.w", "emb", "head.w", "tied"], ["head.b"]]
    sd["head.w"].add_(1)  # both names change at once
    assert plan_groups(sd, previous) == [["block.h", "block.w", "emb"], ["head.b", "head.w", "tied"]]
    # A layout hint: tensors named frozen form the frozen file on a first save, and a tensor
    # assumed changed is never compared (nor hashed) even when its bytes are the same.
    assert plan_groups(sd, [], frozen={"emb", "block.w"}) == [
        ["block.w", "emb"],
        ["block.h", "head.b", "head.w", "tied"],
    ]
    assert plan_groups(sd, previous, assume_changed={"emb"}) == [
        ["block.h", "block.w"],
        ["emb", "head.b", "head.w", "tied"],
    ]


def test_grouped_file_in_a_folder_and_loads_that_name_its_shards(tmp_path):
    root, name = str(tmp_path), "sub/model.safetensors"
    for step in (1, 2):
        path = txckpt.save_checkpoint(
            root, step, {name: model(step), "other.safetensors.index.json": {"weight_map": {}}}, incremental=True
        )
    shards = ["sub/model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors"]
    assert sorted(txckpt.read_manifest(path).files) == [
        "other.safetensors.index.json",
        *shards,
        "sub/model.safetensors.index.json",
    ]
    loaded = txckpt.load_checkpoint(path)
    # The grouped file comes back as saved; an index without txckpt's mark stays a JSON file.
    assert sorted(loaded) == ["other.safetensors.index.json", name] and same(loaded[name], model(2))
    # Named shards (or the index) are returned as the files they are.
    direct = txckpt.load_checkpoint(path, files=[shards[1], "sub/model.safetensors.index.json"])
    assert sorted(direct) == [shards[1], "sub/model.safetensors.index.json"]
    assert sorted(direct[shards[1]]) == ["head.b", "head.w"]


def big(step: int) -> dict[str, torch.Tensor]:
    """model(step) with a 2 MiB frozen embedding: the frozen file passes its first prefix
    boundary (1 MiB), as a real base does."""
    out = model(step)
    out["emb"] = torch.randn(2048, 256, generator=torch.Generator().manual_seed(1))
    return out


class HashCount:
    """Counts what a grouped save hashes: the bytes each hasher function of txckpt._save.grouped
    is given, and the files the incremental probe (Sharing.unchanged) serializes."""

    def __init__(self, monkeypatch):
        self.digests: list[int] = []  # tensor digests (plan_groups; on threads): the one pass over the frozen bytes
        self.header_check = 0  # same_as_committed's hash of the header and what follows it
        self.probed: list[str] = []
        import txckpt._save.grouped as grouped
        from txckpt._save.incremental import Sharing

        real_digest, real_hasher, real_unchanged = grouped.digest_bytes, new_hasher, Sharing.unchanged
        count = self

        def digest(data):
            count.digests.append(len(data))
            return real_digest(data)

        class Hasher:
            def __init__(self):
                self.h = real_hasher()

            def update(self, data):
                count.header_check += len(data)
                self.h.update(data)

            def hexdigest(self):
                return self.h.hexdigest()

        def unchanged(sharing, name, obj):
            count.probed.append(name)
            return real_unchanged(sharing, name, obj)

        monkeypatch.setattr(grouped, "digest_bytes", digest)
        monkeypatch.setattr(grouped, "new_hasher", Hasher, raising=False)  # (absent before the check)
        monkeypatch.setattr(Sharing, "unchanged", unchanged)


def test_frozen_file_is_shared_from_its_tensor_digests_in_one_pass(tmp_path, monkeypatch):
    root = str(tmp_path)
    for step in (1, 2):
        second = txckpt.save_checkpoint(root, step, {"model.safetensors": big(step)}, incremental=True)
    count = HashCount(monkeypatch)
    monkeypatch.setattr("txckpt._save.grouped.PARALLEL_FROM", 0, raising=False)  # the threads too
    third = txckpt.save_checkpoint(root, 3, {"model.safetensors": big(3)}, incremental=True)
    assert stat(third, SHARD1).st_ino == stat(second, SHARD1).st_ino  # shared: one inode
    frozen = stat(third, SHARD1).st_size
    assert frozen > 2 << 20
    # The frozen file was not probed: its tensors were hashed once, to compare their digests,
    # and its header checked with the bytes up to the first prefix boundary (1 MiB). The 2 MiB
    # embedding's first 64 KiB were hashed once more: its head (protocol §3b), checked first.
    assert count.probed == [SHARD2, INDEX]
    assert sorted(count.digests) == sorted([t.nbytes for t in big(3).values()] + [HEAD_BYTES])
    assert count.header_check == 1 << 20
    assert txckpt.read_manifest(third).files[SHARD1] == txckpt.read_manifest(second).files[SHARD1]
    assert same(txckpt.load_checkpoint(third)["model.safetensors"], big(3))
    txckpt.verify_checkpoint(third)


def test_a_damaged_frozen_file_is_written_again_not_shared(tmp_path, caplog):
    root = str(tmp_path)
    for step in (1, 2):
        second = txckpt.save_checkpoint(root, step, {"model.safetensors": big(step)}, incremental=True)
    damaged = os.path.join(second, SHARD1)
    os.chmod(damaged, 0o644)
    with open(damaged, "r+b") as f:  # bit rot in the embedding: size and header unchanged
        f.seek(stat(second, SHARD1).st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with caplog.at_level("WARNING", logger="txckpt"):
        third = txckpt.save_checkpoint(root, 3, {"model.safetensors": big(3)}, incremental=True)
    assert stat(third, SHARD1).st_ino != stat(second, SHARD1).st_ino  # written, not shared
    assert "does not match its manifest entry" in caplog.text and SHARD1 in caplog.text
    assert same(txckpt.load_checkpoint(third)["model.safetensors"], big(3))
    txckpt.verify_checkpoint(third)


def test_other_header_metadata_of_the_same_length_is_written_again(tmp_path):
    from txckpt._save.grouped import same_as_committed, save_grouped
    from txckpt._save.serialization import SafetensorsFile

    root = str(tmp_path)
    paths = {}
    for step, fmt in ((1, "pt"), (2, "pt"), (3, "tf"), (4, "tf")):
        with txckpt.transaction(root, step, incremental=True) as tx:
            save_grouped(tx, "model.safetensors", big(step), metadata={"format": fmt})
        paths[step] = txckpt.get_last_checkpoint(root)
    # Same tensors, same sizes and offsets; only the metadata differs: not the committed file.
    entry = txckpt.read_manifest(paths[2]).files[SHARD1]
    frozen = {k: v for k, v in big(3).items() if k in weight_map(paths[2]) and weight_map(paths[2])[k] == SHARD1}
    assert same_as_committed(SafetensorsFile(frozen, {"format": "pt"}), entry)
    assert not same_as_committed(SafetensorsFile(frozen, {"format": "tf"}), entry)
    assert stat(paths[3], SHARD1).st_size == stat(paths[2], SHARD1).st_size
    assert stat(paths[3], SHARD1).st_ino != stat(paths[2], SHARD1).st_ino  # written with its own header
    assert stat(paths[4], SHARD1).st_ino == stat(paths[3], SHARD1).st_ino  # then shared again
    with safe_open(os.path.join(paths[4], SHARD1), framework="pt") as f:
        assert f.metadata() == {"format": "tf"}


def test_tensor_digests_on_threads_equal_one_at_a_time(monkeypatch):
    import txckpt._save.grouped as grouped

    tensors = {**big(1), "strided": torch.randn(64, 48).t(), "empty": torch.empty(0, 3)}
    names = sorted(tensors)
    serial = {n: digest_bytes(tensor_bytes(tensors[n])) for n in names}
    monkeypatch.setattr(grouped, "PARALLEL_FROM", 0)  # contiguous ones on threads, the strided one copied
    assert grouped._digests(tensors, names) == serial


def test_tensors_longer_than_a_mib_record_the_digest_of_their_first_64_kib():
    tensors = {"big": torch.randn(1 << 18 | 3), "mib": torch.randn(1 << 18), "small": torch.randn(100)}
    data = io.BytesIO()
    write_safetensors(tensors, data)
    raw = data.getvalue()
    records = {r.name: r for r in (index_bytes("m.safetensors", raw).tensors or ())}
    big = records["big"]
    assert big.head == (HEAD_BYTES, digest_bytes(raw[big.offset : big.offset + HEAD_BYTES]))
    assert records["mib"].head is None and records["small"].head is None  # 1 MiB exactly: none
    for split in (1, 7, HEAD_BYTES, 1 << 20):  # the same head however the bytes are fed
        from txckpt._manifest.tensor_index import index_pieces

        pieces = [raw[i : i + split] for i in range(0, len(raw), split)]
        assert index_pieces("m.safetensors", pieces) == index_bytes("m.safetensors", raw)


def test_a_full_fine_tune_hashes_only_the_heads_of_its_changed_tensors(tmp_path, monkeypatch):
    def weights(step):  # two 2 MiB tensors and a small one, all of them changing every step
        g = torch.Generator().manual_seed(0)
        return {n: torch.randn(2048, 256, generator=g) + step for n in ("a", "b")} | {
            "c": torch.randn(8, generator=g) + step
        }

    root = str(tmp_path)
    for step in (1, 2):
        txckpt.save_checkpoint(root, step, {"model.safetensors": weights(step)}, incremental=True)
    count = HashCount(monkeypatch)
    third = txckpt.save_checkpoint(root, 3, {"model.safetensors": weights(3)}, incremental=True)
    # Each large tensor's first 64 KiB told it changed: its other 1.94 MiB were not hashed to
    # decide it (the small one, with no head, was hashed whole).
    assert sorted(count.digests) == [32, HEAD_BYTES, HEAD_BYTES]
    assert os.listdir(third).count("model.safetensors") == 1  # one group: the one file, as a full save
    assert same(txckpt.load_checkpoint(third)["model.safetensors"], weights(3))


def test_a_change_past_the_head_is_still_found_and_a_strided_tensor_is_compared_by_its_rows(tmp_path):
    def weights(step):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(2048, 256, generator=g)
        w[-1, -1] += step  # the last element only: the head (first 64 KiB) stays the same
        t = torch.randn(256, 2048, generator=g).t()  # not contiguous: the head from its leading rows
        return {"late": w, "strided": t, "frozen": torch.randn(2048, 256, generator=g)}

    root = str(tmp_path)
    for step in (1, 2, 3):
        path = txckpt.save_checkpoint(root, step, {"model.safetensors": weights(step)}, incremental=True)
        assert same(txckpt.load_checkpoint(path)["model.safetensors"], weights(step))
    groups = weight_map(path)
    assert groups["late"] != groups["frozen"] == groups["strided"]  # changed past its head: not shared
    records = {r.name: r for f in txckpt.read_manifest(path).files.values() if f.index for r in f.index.tensors or ()}
    assert records["strided"].head is not None and records["late"].head is not None


def test_a_record_whose_head_leaves_the_tensor_is_refused(tmp_path):
    from txckpt._manifest.tensor_index import FileIndex

    record = {"dtype": "F32", "shape": [1 << 19], "offset": 64, "length": 1 << 21, "xxh3_128": "0" * 32}
    for bad in ({"length": 1 << 21, "xxh3_128": "0" * 32}, {"length": 0, "xxh3_128": "0"}, {"xxh3_128": "0"}):
        with pytest.raises(ManifestError):
            FileIndex.from_json(
                "m.safetensors",
                {"chunk_size": 1 << 24, "chunks": [], "tensors": {"w": record | {"head": bad}}},
                64 + (1 << 21),
            )
    ok = FileIndex.from_json(
        "m.safetensors", {"chunk_size": 1 << 24, "chunks": [], "tensors": {"w": record}}, 64 + (1 << 21)
    )
    assert ok.tensors is not None and ok.tensors[0].head is None  # written before heads: none, compared whole
