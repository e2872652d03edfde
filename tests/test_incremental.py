"""Incremental saves (issue 30, files): an unchanged file is shared with the committed checkpoint
that holds its bytes, never written again; every checkpoint stays whole and verifiable; nothing a
committed checkpoint holds is lost to retention, gc, a rollback or a crash (test_crash_sweep.py
has the SIGKILL sweep of an incremental save)."""

from __future__ import annotations

import io
import os

import pytest
import torch
import xxhash

import txckpt
from txckpt._base.checksum import HashingWriter, next_boundary, prefix_boundaries
from txckpt.errors import IntegrityError, InvalidArgumentError
from txckpt._save.incremental import Source, _Changed, _Probe
from txckpt._manifest.manifest import FileEntry
from txckpt._base.refs import Ref
from txckpt._maintenance.retention import RetentionPolicy, apply_retention
from txckpt._root.root import CheckpointRoot

MiB = 1 << 20
FROZEN = {"w": torch.arange(3 * MiB // 4, dtype=torch.float32)}  # 3 MiB: past two boundaries


def files(step: int) -> dict:
    return {
        "frozen.safetensors": FROZEN,
        "adapter.safetensors": {"a": torch.full((256,), float(step))},
        "config.json": {"layers": 2},
        "optimizer.pt": {"m": torch.full((128,), float(step))},
    }


def ino(path: str, name: str) -> int:
    return os.stat(os.path.join(path, name)).st_ino


# ----- prefix digests ---------------------------------------------------------------------------
def test_boundaries_are_dense_at_the_start_then_every_64_mib():
    assert [next_boundary(0), next_boundary(MiB - 1), next_boundary(MiB), next_boundary(3 * MiB)] == [
        MiB,
        MiB,
        2 * MiB,
        4 * MiB,
    ]
    assert next_boundary(64 * MiB) == 128 * MiB and next_boundary(100 * MiB) == 128 * MiB
    assert prefix_boundaries(MiB) == [] and prefix_boundaries(MiB + 1) == [MiB]
    assert len(prefix_boundaries(1 << 30)) == 21  # 1, 2, ..., 64 MiB, then 128 ... 960 MiB


@pytest.mark.parametrize("size", [MiB - 1, MiB, 4 * MiB, 4 * MiB + 7])
def test_a_writer_records_the_running_digest_at_each_boundary(size):
    data = os.urandom(size)

    w = HashingWriter(io.BytesIO(), prefixes=True)
    for start in range(0, size, 300_001):  # writes that straddle the boundaries
        w.write(data[start : start + 300_001])
    w.close()
    assert w.digest == xxhash.xxh3_128_hexdigest(data)
    assert w.prefixes == [xxhash.xxh3_128_hexdigest(data[:b]) for b in prefix_boundaries(size)]


def _source(data: bytes) -> Source:
    entry = FileEntry(
        len(data),
        xxhash.xxh3_128_hexdigest(data),
        "bytes",
        0,
        tuple(xxhash.xxh3_128_hexdigest(data[:b]) for b in prefix_boundaries(len(data))),
    )
    return Source(Ref("L", 1, "t1"), "f.bin", entry)


def test_a_changed_file_is_told_at_the_first_boundary_where_it_differs():
    old = os.urandom(16 * MiB)
    probe = _Probe([_source(old)])
    new = bytearray(old)
    new[3 * MiB] ^= 1  # differs in its fourth MiB: the 4 MiB boundary tells
    with pytest.raises(_Changed):
        probe.write(bytes(new))
    assert probe.size == 4 * MiB  # hashed up to that boundary, not the 16 MiB

    probe = _Probe([_source(old)])
    probe.write(old)
    assert probe.equal() is not None
    probe = _Probe([_source(old)])
    probe.write(old[: 8 * MiB])  # a prefix of the old file is not the old file
    assert probe.equal() is None


# ----- saving -----------------------------------------------------------------------------------
def test_unchanged_files_are_shared_and_every_checkpoint_stays_whole(root):
    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    two = txckpt.save_checkpoint(root, 2, files(2), incremental=True)
    # The frozen weights and the config are the same inode as step 1's (a hard link); the
    # adapter and the optimizer changed and were written.
    assert ino(one, "frozen.safetensors") == ino(two, "frozen.safetensors")
    assert ino(one, "config.json") == ino(two, "config.json")
    assert ino(one, "adapter.safetensors") != ino(two, "adapter.safetensors")
    assert ino(one, "optimizer.pt") != ino(two, "optimizer.pt")
    m1, m2 = txckpt.read_manifest(one), txckpt.read_manifest(two)
    assert m2.files["frozen.safetensors"] == m1.files["frozen.safetensors"]
    assert len(m2.files["frozen.safetensors"].prefixes) == 2
    for path, step in ((one, 1), (two, 2)):
        txckpt.verify_checkpoint(path)
        out = txckpt.load_checkpoint(path)
        assert torch.equal(out["frozen.safetensors"]["w"], FROZEN["w"])
        assert torch.equal(out["adapter.safetensors"]["a"], torch.full((256,), float(step)))
    # A stock reader sees plain files.
    from safetensors.torch import load_file

    assert torch.equal(load_file(os.path.join(two, "frozen.safetensors"))["w"], FROZEN["w"])
    # The leases the save took on step 1 went back.
    readers = os.path.join(root, ".txckpt", "readers")
    assert not os.path.isdir(readers) or os.listdir(readers) == []


def test_without_incremental_every_file_is_written(root):
    one = txckpt.save_checkpoint(root, 1, files(1))
    two = txckpt.save_checkpoint(root, 2, files(2))
    assert ino(one, "frozen.safetensors") != ino(two, "frozen.safetensors")
    assert txckpt.read_manifest(two).files["frozen.safetensors"].prefixes == ()


def test_a_checkpoint_root_can_save_incrementally_by_default(root):
    r = CheckpointRoot(root, incremental=True)
    one = r.save(1, files(1))
    two = r.save(2, files(2))
    assert ino(one, "frozen.safetensors") == ino(two, "frozen.safetensors")
    three = r.save(3, files(3), incremental=False)
    assert ino(one, "frozen.safetensors") != ino(three, "frozen.safetensors")


def test_retiring_the_checkpoint_that_first_held_the_bytes_loses_nothing(root):
    paths = [txckpt.save_checkpoint(root, s, files(s), incremental=True) for s in (1, 2, 3)]
    apply_retention(CheckpointRoot(root), RetentionPolicy(keep_last=1))
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    out = txckpt.load_checkpoint(paths[2])  # verified: the shared bytes are still its own
    assert torch.equal(out["frozen.safetensors"]["w"], FROZEN["w"])
    four = txckpt.save_checkpoint(root, 4, files(4), incremental=True)
    assert ino(four, "frozen.safetensors") == ino(paths[2], "frozen.safetensors")


def test_a_fork_shares_with_the_lineage_it_abandons_and_both_stay_whole(root, txlog):
    paths = {s: txckpt.save_checkpoint(root, s, files(s), incremental=True) for s in (1, 2, 3)}
    txid_2 = txckpt.read_manifest(paths[2]).txid  # its path moves: the new step 2 is published there
    txckpt.resume(root, step=1)  # abandons 2 and 3
    again = txckpt.save_checkpoint(root, 2, files(2), incremental=True)
    # The new step 2 has the abandoned step 2's bytes for every file: all shared.
    abandoned = [c for c in CheckpointRoot(root).checkpoints("all") if c.step == 2 and c.path != again]
    assert [c.txid for c in abandoned] == [txid_2]
    for name in files(2):
        assert ino(again, name) == ino(abandoned[0].path, name)
    for c in CheckpointRoot(root).checkpoints("all"):
        txckpt.verify_checkpoint(c.path)
    assert txckpt.get_last_checkpoint(root) == again


def test_a_name_saved_and_written_into_tx_directory_is_refused_and_the_source_is_untouched(root):
    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    with pytest.raises(InvalidArgumentError, match="one way only"):
        with txckpt.transaction(root, 2, incremental=True) as tx:
            tx.save("config.json", {"layers": 2})  # unchanged: shared at the transaction's end
            assert not os.path.exists(os.path.join(tx.directory, "config.json"))
            with open(os.path.join(tx.directory, "config.json"), "w") as f:  # other code, same name
                f.write('{"layers": 3}')
    txckpt.verify_checkpoint(one)  # step 1's config.json was never opened for writing
    assert txckpt.get_last_checkpoint(root) == one


def test_the_source_is_leased_until_the_save_ends(root):
    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    txid = txckpt.read_manifest(one).txid
    readers = os.path.join(root, ".txckpt", "readers")
    with txckpt.transaction(root, 2, incremental=True) as tx:
        tx.save("frozen.safetensors", FROZEN)
        assert [n.split(".")[0] for n in os.listdir(readers)] == [txid]
    assert os.listdir(readers) == []


def test_a_damaged_shared_file_fails_every_checkpoint_that_holds_it(root):
    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    two = txckpt.save_checkpoint(root, 2, files(2), incremental=True)
    with open(os.path.join(one, "frozen.safetensors"), "r+b") as f:  # one inode, two names
        f.seek(MiB)
        b = f.read(1)
        f.seek(MiB)
        f.write(bytes([b[0] ^ 1]))
    for path in (one, two):
        with pytest.raises(IntegrityError):
            txckpt.verify_checkpoint(path)


def test_a_root_that_cannot_link_copies_and_checks_the_bytes(root, monkeypatch):
    from txckpt._storage.local.store import LocalStorage

    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    monkeypatch.setattr(LocalStorage, "share_file", lambda self, src, dst: False)
    two = txckpt.save_checkpoint(root, 2, files(2), incremental=True)
    assert ino(one, "frozen.safetensors") != ino(two, "frozen.safetensors")
    txckpt.verify_checkpoint(two)


def test_an_async_save_shares_too(root):
    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    two = txckpt.async_save(root, 2, files(2), incremental=True).result()
    assert ino(one, "frozen.safetensors") == ino(two, "frozen.safetensors")
    txckpt.verify_checkpoint(two)


def test_an_object_store_copies_on_the_server(memory_root):
    url, so = memory_root
    txckpt.save_checkpoint(url, 1, files(1), storage_options=so, incremental=True)
    two = txckpt.save_checkpoint(url, 2, files(2), storage_options=so, incremental=True)
    out = txckpt.load_checkpoint(two, storage_options=so)
    assert torch.equal(out["frozen.safetensors"]["w"], FROZEN["w"])


@pytest.mark.s3
def test_s3_uploads_only_the_changed_bytes(s3_root, s3_requests):
    url, so = s3_root
    txckpt.save_checkpoint(url, 1, files(1), storage_options=so, incremental=True)
    s3_requests.reset()
    two = txckpt.save_checkpoint(url, 2, files(2), storage_options=so, incremental=True)
    frozen = txckpt.read_manifest(two, storage_options=so).files["frozen.safetensors"].size
    assert s3_requests.ops["CopyObject"] >= 2  # the frozen weights and the config
    assert s3_requests.uploaded_bytes < frozen / 4, s3_requests.ops
    out = txckpt.load_checkpoint(two, storage_options=so)  # verified
    assert torch.equal(out["frozen.safetensors"]["w"], FROZEN["w"])


def _flip(path: str, offset: int = MiB) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def test_txckpt_verify_names_every_checkpoint_that_holds_a_damaged_shared_file(root, capsys):
    from txckpt._cli import app

    paths = [txckpt.save_checkpoint(root, s, files(s), incremental=True) for s in (1, 2, 3)]
    _flip(os.path.join(paths[0], "frozen.safetensors"))
    txckpt.forget_roots()
    assert app.main(["verify", root]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    for p in paths:
        assert os.path.join(os.path.basename(p), "frozen.safetensors") in text, text


def test_a_fallback_resume_skips_every_checkpoint_that_shares_the_damaged_bytes(root, txlog):
    first = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    changed = {**files(2), "frozen.safetensors": {"w": FROZEN["w"] + 1}}  # new bytes from step 2 on
    two = txckpt.save_checkpoint(root, 2, changed, incremental=True)
    three = txckpt.save_checkpoint(
        root, 3, {**changed, "adapter.safetensors": files(3)["adapter.safetensors"]}, incremental=True
    )
    assert ino(two, "frozen.safetensors") == ino(three, "frozen.safetensors") != ino(first, "frozen.safetensors")
    _flip(os.path.join(three, "frozen.safetensors"))  # damages step 2 as well: one inode
    txckpt.forget_roots()
    resumed = txckpt.resume(root, on_damaged="fallback")
    assert resumed is not None and txckpt.read_manifest(resumed).step == 1


def test_txckpt_show_says_how_many_bytes_are_shared(root, capsys):
    import json

    from txckpt._cli import app

    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    two = txckpt.save_checkpoint(root, 2, files(2), incremental=True)
    m = txckpt.read_manifest(two).files
    assert app.main(["show", two, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["shared_bytes"] == m["frozen.safetensors"].size + m["config.json"].size
    assert app.main(["show", two]) == 0
    assert "shared with other checkpoints" in capsys.readouterr().out
    txckpt.save_checkpoint(root, 3, files(3))  # not incremental: owns every byte
    assert app.main(["show", os.path.join(root, "checkpoint-3"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shared_bytes"] == 0
    assert one


def test_a_name_saved_twice_is_refused_and_the_first_share_still_commits(root):
    txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    with txckpt.transaction(root, 2, incremental=True) as tx:
        tx.save("config.json", {"layers": 2})  # shared
        with pytest.raises(InvalidArgumentError, match="already written"):
            tx.save("config.json", {"layers": 2})
        with pytest.raises(InvalidArgumentError):
            tx.save("config.json/inner.json", {"layers": 2})  # under a file's name
        tx.save("other.json", {"x": 1})
    assert set(txckpt.read_manifest(tx.path).files) == {"config.json", "other.json"}
    txckpt.verify_checkpoint(tx.path)


# ----- files other code writes into tx.directory (a Trainer's save_pretrained, tokenizers) -----
def _write_dir(tx, step: int, frozen: bytes) -> None:
    """What a Trainer's save does: files written by path into tx.directory, not through tx.save."""
    os.makedirs(os.path.join(tx.directory, "sub"), exist_ok=True)
    for name, data in (
        ("model-00001-of-00002.safetensors", frozen),
        ("model-00002-of-00002.safetensors", b"trained %d" % step * 1000),
        ("sub/tokenizer.json", b'{"vocab": 3}'),
    ):
        with open(os.path.join(tx.directory, name), "wb") as f:
            f.write(data)


@pytest.mark.parametrize("claimed", [False, True])
def test_files_written_into_the_directory_are_shared_once_hashed(root, claimed):
    frozen = os.urandom(3 * MiB)
    paths = []
    for step in (1, 2, 3):
        with txckpt.transaction(root, step, incremental=True) as tx:
            if claimed:  # hashed by this rank at its end, as DeepSpeed's and rng files are
                tx.claim_files("*.safetensors")
            _write_dir(tx, step, frozen)
        paths.append(tx.path)
    shard, trained = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    # Saves 2 and 3 hold the frozen shard and the tokenizer as links of save 1's files.
    assert ino(paths[0], shard) == ino(paths[1], shard) == ino(paths[2], shard)
    assert ino(paths[0], "sub/tokenizer.json") == ino(paths[2], "sub/tokenizer.json")
    assert len({ino(p, trained) for p in paths}) == 3
    for p in paths:
        txckpt.verify_checkpoint(p)
        with open(os.path.join(p, shard), "rb") as f:
            assert f.read() == frozen
    # Retiring the first checkpoint leaves the others whole: a link is a file of its own.
    apply_retention(CheckpointRoot(root), RetentionPolicy(keep_last=2))
    assert not os.path.exists(paths[0])
    txckpt.verify_checkpoint(paths[1])


@pytest.mark.parametrize("claimed", [False, True])
def test_a_file_found_unchanged_is_never_fsynced_so_its_scratch_copy_never_reaches_the_disk(root, claimed, monkeypatch):
    """On a local root a file written into tx.directory is hashed first and fsynced only if it
    was not replaced by a link: the replaced copy's dirty pages go with its inode (the kernel's
    cancelled_write_bytes) instead of being written to the disk and then unlinked."""
    assert CheckpointRoot(root).durable
    frozen = os.urandom(2 * MiB)
    fsynced: list[tuple[str, int]] = []
    real_fsync = os.fsync

    def spy(fd):
        fsynced.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino))
        return real_fsync(fd)

    paths = []
    for step in (1, 2):
        if step == 2:
            monkeypatch.setattr(os, "fsync", spy)
        with txckpt.transaction(root, step, incremental=True) as tx:
            if claimed:
                tx.claim_files("*.safetensors")
            _write_dir(tx, step, frozen)
        paths.append(tx.path)
    shard, trained = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert ino(paths[0], shard) == ino(paths[1], shard)  # shared
    shard_inodes = {i for p, i in fsynced if p.endswith("/" + shard)}
    assert shard_inodes <= {ino(paths[0], shard)}, "the scratch copy of an unchanged file was fsynced"
    assert ino(paths[1], trained) in {i for p, i in fsynced if p.endswith("/" + trained)}  # a changed one is


def test_without_incremental_files_written_into_the_directory_are_not_shared(root):
    frozen = os.urandom(MiB)
    paths = []
    for step in (1, 2):
        with txckpt.transaction(root, step) as tx:
            _write_dir(tx, step, frozen)
        paths.append(tx.path)
    assert ino(paths[0], "model-00001-of-00002.safetensors") != ino(paths[1], "model-00001-of-00002.safetensors")


@pytest.mark.s3
def test_s3_uploads_only_the_changed_files_written_into_the_directory(s3_root, s3_requests):
    url, so = s3_root
    frozen = os.urandom(4 * MiB)
    with txckpt.transaction(url, 1, storage_options=so, incremental=True) as tx:
        _write_dir(tx, 1, frozen)
    s3_requests.reset()
    with txckpt.transaction(url, 2, storage_options=so, incremental=True) as tx:
        _write_dir(tx, 2, frozen)
    assert s3_requests.ops["CopyObject"] >= 2, s3_requests.ops  # the frozen shard and the tokenizer
    assert s3_requests.uploaded_bytes < MiB, s3_requests.ops  # the trained shard (9 KB) and metadata
    txckpt.verify_checkpoint(tx.path, storage_options=so)  # every byte against the manifest
    m = txckpt.read_manifest(tx.path, storage_options=so).files
    assert m["model-00001-of-00002.safetensors"].size == len(frozen)


def test_a_scratch_file_equal_to_a_streamed_one_is_told_by_its_prefixes(memory_root, monkeypatch):
    """On an object store, a file written into tx.directory (a local scratch) is compared before
    its upload: with the candidate's prefix digests the probe reads only up to the first
    boundary where it differs; equal, it is copied on the server, not uploaded."""
    from txckpt._save import incremental

    url, so = memory_root
    data = os.urandom(40 * MiB)
    with txckpt.transaction(url, 1, storage_options=so, incremental=True) as tx:
        tx.save("blob.bin", data)  # streamed by an incremental tx.save: prefixes recorded
    assert txckpt.read_manifest(tx.path, storage_options=so).files["blob.bin"].prefixes
    read: list[int] = []
    real = incremental._Probe.write
    monkeypatch.setattr(incremental._Probe, "write", lambda self, b: read.append(len(b)) or real(self, b))
    changed = bytearray(data)
    changed[MiB // 2] ^= 1
    with txckpt.transaction(url, 2, storage_options=so, incremental=True) as tx:
        with open(os.path.join(tx.directory, "blob.bin"), "wb") as f:
            f.write(changed)
    assert sum(read) <= 8 * MiB and txckpt.read_manifest(tx.path, storage_options=so).files[
        "blob.bin"
    ].checksum == xxhash.xxh3_128_hexdigest(bytes(changed))
    with txckpt.transaction(url, 3, storage_options=so, incremental=True) as tx:
        with open(os.path.join(tx.directory, "blob.bin"), "wb") as f:
            f.write(data)
    assert txckpt.read_manifest(tx.path, storage_options=so).files["blob.bin"].checksum == xxhash.xxh3_128_hexdigest(
        data
    )
    txckpt.verify_checkpoint(tx.path, storage_options=so)


def test_txckpt_ls_says_how_many_bytes_each_checkpoint_shares(root, capsys):
    import json

    from txckpt._cli import app

    txckpt.save_checkpoint(root, 1, files(1))
    capsys.readouterr()
    assert app.main(["ls", root]) == 0
    assert "SHARED" not in capsys.readouterr().out  # no incremental save: no column
    txckpt.save_checkpoint(root, 2, files(2), incremental=False)
    # Step 3 shares the small config.json with step 2 (compared whole) but writes its 3 MiB frozen
    # file: the plain saves recorded no prefixes to compare it with. Step 4 shares both with 3.
    txckpt.save_checkpoint(root, 3, files(3), incremental=True)
    four = txckpt.save_checkpoint(root, 4, files(4), incremental=True)
    m = txckpt.read_manifest(four).files
    assert app.main(["ls", root, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    shared = m["frozen.safetensors"].size + m["config.json"].size
    assert rows[4]["shared_bytes"] == shared and rows[3]["shared_bytes"] == shared
    assert rows[2]["shared_bytes"] == m["config.json"].size and rows[1]["shared_bytes"] == 0
    assert app.main(["ls", root]) == 0
    assert "SHARED" in capsys.readouterr().out.splitlines()[0]


def test_a_source_moved_during_the_save_is_found_again_and_checked_there(root):
    """The probes find step 1 under its public name; before the save places its shares, step 1
    moves back to its home (what a fork's unpublication does to the checkpoints it abandons).
    The save finds it there, checks it, and shares it: the commit holds step 1's inode."""
    one = txckpt.save_checkpoint(root, 1, files(1), incremental=True)
    ref = Ref(*(lambda m: (m.lineage, m.step, m.txid))(txckpt.read_manifest(one)))
    frozen_ino = ino(one, "frozen.safetensors")
    r = CheckpointRoot(root)
    with txckpt.transaction(root, 2, incremental=True) as tx:
        tx.save("frozen.safetensors", FROZEN)
        assert r.publication.unpublish_refs([ref]) == ["checkpoint-1"]
    assert not os.path.exists(one)
    two = os.path.join(root, "checkpoint-2")
    assert ino(two, "frozen.safetensors") == frozen_ino
    txckpt.verify_checkpoint(two)
    assert torch.equal(txckpt.load_checkpoint(two)["frozen.safetensors"]["w"], FROZEN["w"])
