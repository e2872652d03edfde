"""Manifest format /2 (protocol §3a): per-rank parts, the fixed-size record, the Merkle tree, the
whole-table and the narrow readers, and the unchanged-structure fast path.

The multi-rank commits here are rank 0's real code fed with the parts and records W simulated
ranks wrote (``Transaction.begin_external`` + ``rankparts.write_part`` + ``commit_reports``),
as benchmarks/commit_scale.py runs it; tests/test_distributed.py runs the same through real gloo
ranks.
"""

from __future__ import annotations

import json
import os
import random

import pytest

import txckpt
from txckpt import errors
from txckpt._manifest import parts
from txckpt._manifest import rankparts
from txckpt._base.checksum import digest_bytes
from txckpt._cli.verify import run_verify
from txckpt.errors import ManifestError
from txckpt._manifest.manifest import (
    FORMAT,
    FORMAT_V2,
    Manifest,
    decode_part,
    encode_part,
    read_rank_files,
    read_rank_part,
)
from txckpt._base.layout import MANIFEST_NAME


# ----- the tree and the record ----------------------------------------------------------------
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 64, 100])
def test_every_leafs_proof_gives_the_root_and_a_changed_leaf_does_not(count):
    rng = random.Random(count)
    leaves = [rng.randbytes(16) for _ in range(count)]
    tree = parts.build_tree(leaves)
    assert len(tree) == parts.tree_size(count) and tree[: 16 * count] == b"".join(leaves)
    root = parts.tree_root(tree)
    for i in range(count):
        siblings = [tree[off : off + 16] for off, _ in parts.proof_nodes(count, i)]
        assert len(siblings) <= max(1, (count - 1).bit_length())
        assert parts.root_from_proof(leaves[i], count, i, siblings) == root
        assert parts.root_from_proof(bytes(16), count, i, siblings) != root or count == 1 and leaves[i] == bytes(16)
        if siblings:
            bad = [bytes(16)] + siblings[1:]
            assert parts.root_from_proof(leaves[i], count, i, bad) != root


def test_the_record_is_56_bytes_and_round_trips():
    r = parts.Record(part=b"p" * 16, structure=b"s" * 16, files=3, total_bytes=2**40, flags=parts.DIRECTORY)
    data = r.encode()
    assert len(data) == parts.RECORD_SIZE == 56
    assert parts.Record.decode(data, 0) == r and not r.failed
    assert parts.failed_record().failed
    with pytest.raises(ManifestError, match="rank 4's report has 55 bytes.*same txckpt"):
        parts.Record.decode(data[:-1], 4)


def test_the_structure_digest_depends_on_names_and_kinds_only():
    a = parts.structure_digest([("b", "torch"), ("a", "bytes")])
    assert a == parts.structure_digest([("a", "bytes"), ("b", "torch")])
    assert a != parts.structure_digest([("a", "bytes"), ("b", "bytes")])
    assert a != parts.structure_digest([("a", "bytes")])


# ----- a simulated multi-rank save ------------------------------------------------------------
def _ranges_of(rank: int, name: str) -> dict:
    """A DCP-like range table of one rank's file: two items of (distinct) digests."""
    return {name: {"0": [1, digest_bytes(b"a%d" % rank)], "1": [1, digest_bytes(b"b%d" % rank)]}}


def _save(root: txckpt.CheckpointRoot, step: int, world: int, *, names=None, data=b"x", ranges=False) -> str:
    """Rank 0's real commit of ``world`` simulated ranks, each with its file and its part
    (``ranges``: with range digests of its file, as a DCP rank's)."""
    tx = root.transaction(step)
    plan = tx.begin_external(world)
    staging = root.storage.local_path(plan.key)
    records = []
    for rank in range(world):
        name = (names or (lambda r: f"r{r}.bin"))(rank)
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data + bytes([rank]))
        files = {name: {"size": len(data) + 1, "xxh3_128": digest_bytes(data + bytes([rank])), "kind": "bytes"}}
        records.append(
            rankparts.write_part(
                root.storage,
                plan.key,
                rank,
                plan.txid,
                files,
                durable=root.durable,
                directory=False,
                ranges=_ranges_of(rank, name) if ranges else None,
            ).encode()
        )
    return tx.commit_reports([], records)


def test_a_multi_rank_save_writes_format_2_and_every_reader_reads_the_whole_table(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 5)
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        body = json.load(f)
    assert body["format"] == FORMAT_V2 and body["files"] == {} and body["parts"]["count"] == 5
    manifest = txckpt.verify_checkpoint(path)  # every part checked, every file hashed
    assert {n: e.rank for n, e in manifest.files.items()} == {f"r{r}.bin": r for r in range(5)}
    assert manifest.total_bytes == 10 and manifest.world_size == 5
    assert txckpt.load_checkpoint(path)["r3.bin"] == b"x\x03"
    report = run_verify(str(tmp_path / "out"), {})
    assert report["problems"] == [] and report["warnings"] == []  # the parts are not "extra files"


def test_a_loading_rank_reads_only_its_part_and_its_proof(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 7)
    manifest = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read())
    key = root.storage.key_of(path)
    opened = []
    real = root.storage.read_bytes

    def spy(k):
        opened.append(k)
        return real(k)

    root.storage.read_bytes = spy
    for rank in range(7):
        assert {n: e.rank for n, e in read_rank_files(root.storage, key, manifest, rank, path).items()} == {
            f"r{rank}.bin": rank
        }
    assert opened == [f"{key}/{parts.part_name(r)}" for r in range(7)]  # one part each, nobody else's


def test_a_damaged_part_fails_both_readers_naming_its_rank(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 6)
    part = os.path.join(path, parts.part_name(4))
    with open(part) as f:
        body = json.load(f)
    body["files"]["r4.bin"]["size"] = 99
    with open(part, "w") as f:
        json.dump(body, f)
    with pytest.raises(ManifestError, match=r"rank 4's part .* does not match the Merkle root") as e:
        txckpt.read_manifest(path)
    assert "resume from another one" in str(e.value)
    manifest = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read())
    with pytest.raises(ManifestError, match="rank 4's part"):
        read_rank_files(root.storage, root.storage.key_of(path), manifest, 4, path)
    assert read_rank_files(root.storage, root.storage.key_of(path), manifest, 3, path)  # the others still read
    assert any("rank 4's part" in p for p in run_verify(str(tmp_path / "out"), {})["problems"])


def test_a_missing_or_damaged_tree_costs_a_whole_read_not_the_checkpoint(tmp_path):
    """The tree is an index (not fsynced at commit): a narrow read that cannot prove its part
    reads every part instead; only a part that does not fit the root fails."""
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 5)
    manifest = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read())
    key = root.storage.key_of(path)
    tree = os.path.join(path, parts.TREE_NAME)
    with open(tree, "r+b") as f:
        f.write(bytes(16))
    assert {n: e.rank for n, e in read_rank_files(root.storage, key, manifest, 0, path).items()} == {"r0.bin": 0}
    os.remove(tree)
    assert set(read_rank_files(root.storage, key, manifest, 2, path)) == {"r2.bin"}
    txckpt.verify_checkpoint(path)
    with open(os.path.join(path, parts.part_name(1)), "ab") as f:
        f.write(b" ")
    with pytest.raises(ManifestError, match="the parts in .* do not match the Merkle root"):
        read_rank_files(root.storage, key, manifest, 1, path)


def test_the_second_save_of_the_same_structure_reads_no_part(tmp_path, monkeypatch):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    checked = []
    real = rankparts._checked_parts
    monkeypatch.setattr(rankparts, "_checked_parts", lambda *a, **k: checked.append(a[2]) or real(*a, **k))
    _save(root, 1, 4)
    _save(root, 2, 4, data=b"new bytes")  # same names and kinds: the fast path
    _save(root, 3, 4, names=lambda r: f"renamed{r}.bin")  # changed structure: checked again
    _save(root, 4, 5, names=lambda r: f"renamed{r}.bin")  # another world size: checked again
    txids = [txckpt.read_manifest(str(tmp_path / "out" / f"checkpoint-{s}")).txid for s in (1, 3, 4)]
    assert checked == txids
    for step in (1, 2, 3, 4):
        txckpt.verify_checkpoint(str(tmp_path / "out" / f"checkpoint-{step}"))


def test_a_part_that_differs_from_its_record_aborts_the_first_save(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    tx = root.transaction(1)
    plan = tx.begin_external(2)
    records = []
    for rank in range(2):
        with open(os.path.join(root.storage.local_path(plan.key), f"r{rank}"), "wb") as f:
            f.write(b"x")
        files = {f"r{rank}": {"size": 1, "xxh3_128": digest_bytes(b"x"), "kind": "bytes"}}
        records.append(
            rankparts.write_part(
                root.storage, plan.key, rank, plan.txid, files, durable=False, directory=False
            ).encode()
        )
    os.remove(os.path.join(root.storage.local_path(plan.key), parts.part_name(1)))
    with pytest.raises(errors.TransactionAbortedError, match="rank 1's part of the manifest"):
        tx.commit_reports([], records)
    assert txckpt.get_last_checkpoint(str(tmp_path / "out")) is None


def test_a_fetched_copy_of_a_format_2_checkpoint_reads_like_the_original(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 3, ranges=True)
    copy = txckpt.fetch_checkpoint(path, str(tmp_path / "copy"))
    manifest = txckpt.read_manifest(copy)
    assert manifest.parts is not None and set(manifest.files) == {"r0.bin", "r1.bin", "r2.bin"}
    storage = txckpt.CheckpointRoot(copy).storage
    assert set(read_rank_files(storage, "", manifest, 2, copy)) == {"r2.bin"}
    assert read_rank_part(storage, "", manifest, 2, copy).ranges == _ranges_of(2, "r2.bin")  # the parts' ranges too


def test_a_format_1_manifest_of_many_ranks_still_reads(tmp_path):
    """What txckpt wrote for a group before issue 33 (and DCP's reports without records still
    write): one table, every file with its rank."""
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    tx = root.transaction(1)
    plan = tx.begin_external(3)
    reports = []
    for rank in range(3):
        with open(os.path.join(root.storage.local_path(plan.key), f"r{rank}"), "wb") as f:
            f.write(b"y")
        reports.append(
            {
                "rank": rank,
                "files": {f"r{rank}": {"size": 1, "xxh3_128": digest_bytes(b"y"), "kind": "bytes", "rank": rank}},
            }
        )
    path = tx.commit_reports(reports)
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        assert json.load(f)["format"] == FORMAT
    manifest = txckpt.verify_checkpoint(path)
    assert manifest.parts is None and {n: e.rank for n, e in manifest.files.items()} == {"r0": 0, "r1": 1, "r2": 2}
    assert set(read_rank_files(root.storage, root.storage.key_of(path), manifest, 1, path)) == {"r1"}


def test_a_name_in_the_parts_directory_is_refused(tmp_path):
    with pytest.raises(errors.UnsafePathError, match="reserved for txckpt's manifest parts"):
        txckpt.save_checkpoint(str(tmp_path / "out"), 1, {"txckpt-parts/0.json": b"x"})


def _proof_bytes_fetched(storage, key, manifest, rank, path, monkeypatch) -> tuple[int, int, list]:
    """(bytes of the part, bytes of the tree file, the tree's Range headers) that S3 sent for
    one narrow read, as GetObject answered them."""
    fetched: list[tuple[str, str | None, int]] = []
    real = storage.fs._call_s3

    async def spy(method, *a, **kw):
        out = await real(method, *a, **kw)
        if method == "get_object":
            fetched.append((kw["Key"], kw.get("Range"), int(out["ContentLength"])))
        return out

    monkeypatch.setattr(storage.fs, "_call_s3", spy)
    files = read_rank_files(storage, key, manifest, rank, path)
    monkeypatch.undo()
    assert set(files) == {f"r{rank}.bin"}
    part = sum(n for k, _, n in fetched if k.endswith(parts.part_name(rank)))
    tree = [(r, n) for k, r, n in fetched if k.endswith(parts.TREE_NAME)]
    return part, sum(n for _, n in tree), [r for r, _ in tree]


@pytest.mark.s3
def test_on_s3_a_loading_rank_fetches_its_part_and_its_proof_nodes_not_the_tree(tmp_path, s3_root, monkeypatch):
    """The proof's 16-byte nodes lie all over the tree file: s3fs's read-ahead would fetch from
    the first one to the end of the object (O(W)); ranged GETs fetch exactly the nodes."""
    from txckpt._storage import open_storage

    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    world = 64
    local = _save(root, 1, world)
    url, opts = s3_root
    storage = open_storage(url, opts)
    for top, _, names in os.walk(local):
        for name in names:
            rel = os.path.relpath(os.path.join(top, name), local).replace(os.sep, "/")
            with open(os.path.join(top, name), "rb") as f:
                storage.create_exclusive(f"ck/{rel}", f.read(), durable=True)
    manifest = Manifest.decode(storage.read_bytes(f"ck/{MANIFEST_NAME}"))
    tree_size = os.path.getsize(os.path.join(local, parts.TREE_NAME))
    for rank in (0, world - 1):  # the longest proof path, and the last rank's
        proof = parts.proof_nodes(world, rank)
        part, tree, ranges = _proof_bytes_fetched(storage, "ck", manifest, rank, f"{url}/ck", monkeypatch)
        assert part == os.path.getsize(os.path.join(local, parts.part_name(rank)))
        assert tree == parts.NODE_SIZE * len(proof) < tree_size // 10, (tree, tree_size)
        assert sorted(ranges) == sorted(f"bytes={o}-{o + parts.NODE_SIZE - 1}" for o, _ in proof)
    # A tree that does not fit (here: cut short, so a ranged read past its end fails) costs the
    # whole read, which still finds every part intact.
    storage.replace(f"ck/{parts.TREE_NAME}", b"\0" * 40)
    assert set(read_rank_files(storage, "ck", manifest, 5, f"{url}/ck")) == {"r5.bin"}


def test_a_parts_entries_leave_the_rank_to_the_part_and_readers_record_it(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 12)
    with open(os.path.join(path, parts.part_name(11))) as f:
        body = json.load(f)
    assert body["rank"] == 11 and body["files"]["r11.bin"].keys() == {"size", "xxh3_128", "kind"}
    manifest = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read())
    assert read_rank_files(root.storage, root.storage.key_of(path), manifest, 11, path)["r11.bin"].rank == 11
    assert txckpt.read_manifest(path).files["r11.bin"].rank == 11


# ----- range digests in the parts (DCP, issue 33) -------------------------------------------
def test_a_part_carries_its_ranges_and_refuses_ranges_of_a_file_it_does_not_hold():
    files = {"__3_0.distcp": {"size": 2, "xxh3_128": digest_bytes(b"ab"), "kind": "bytes", "rank": 3}}
    ranges = _ranges_of(3, "__3_0.distcp")
    data = encode_part(3, "t", files, ranges)
    part = decode_part(data, 3, "t", "p")
    assert part.ranges == ranges and set(part.files) == {"__3_0.distcp"} and part.files["__3_0.distcp"].rank == 3
    assert decode_part(encode_part(3, "t", files), 3, "t", "p").ranges == {}
    assert b'"ranges"' not in encode_part(3, "t", files)  # a part without ranges leaves the key out
    with pytest.raises(errors.InvalidArgumentError, match=r"'__0_0.distcp', which is not one of the part's files"):
        encode_part(3, "t", files, {**ranges, **_ranges_of(0, "__0_0.distcp")})
    # A part that names another file in its ranges, or holds a malformed range, is damaged.
    body = json.loads(data)
    for bad in (
        {"__0_0.distcp": {"0": [1, "00"]}},
        {"__3_0.distcp": {"0": ["1", "00"]}},
        {"__3_0.distcp": {"x": [1, "00"]}},
        {"__3_0.distcp": [1, "00"]},
        ["__3_0.distcp"],
    ):
        with pytest.raises(ManifestError, match=r"p's range digests .* the checkpoint is damaged"):
            decode_part(json.dumps({**body, "ranges": bad}).encode(), 3, "t", "p")


def test_a_loading_rank_gets_its_ranges_from_its_part_through_the_proof_or_the_whole_read(tmp_path):
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 5, ranges=True)
    manifest = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read())
    key = root.storage.key_of(path)
    for rank in range(5):
        part = read_rank_part(root.storage, key, manifest, rank, path)
        assert set(part.files) == {f"r{rank}.bin"} and part.ranges == _ranges_of(rank, f"r{rank}.bin")
    txckpt.verify_checkpoint(path)  # the whole-table readers read parts with ranges too
    os.remove(os.path.join(path, parts.TREE_NAME))  # no proof: every part read and checked, then decoded
    assert read_rank_part(root.storage, key, manifest, 2, path).ranges == _ranges_of(2, "r2.bin")


def test_a_part_whose_range_digest_was_rewritten_no_longer_fits_the_root(tmp_path):
    """The leaf covers the ranges: a rewritten range digest (the part still well-formed) is a
    ManifestError naming the rank's part, through the proof and through the whole read."""
    root = txckpt.CheckpointRoot(str(tmp_path / "out"))
    path = _save(root, 1, 4, ranges=True)
    part = os.path.join(path, parts.part_name(2))
    with open(part) as f:
        body = json.load(f)
    body["ranges"]["r2.bin"]["1"][1] = digest_bytes(b"other bytes")
    with open(part, "w") as f:
        json.dump(body, f, sort_keys=True, separators=(",", ":"))
    manifest = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read())
    with pytest.raises(ManifestError, match=r"rank 2's part .* does not match the Merkle root") as e:
        read_rank_part(root.storage, root.storage.key_of(path), manifest, 2, path)
    assert e.value.path == f"{path}/{parts.part_name(2)}"
    with pytest.raises(ManifestError, match=r"rank 2's part .* does not match the Merkle root"):
        txckpt.read_manifest(path)
    assert read_rank_part(root.storage, root.storage.key_of(path), manifest, 1, path).ranges  # the others read
