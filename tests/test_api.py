"""The core API's semantics on a local root (the same behaviours run on memory and S3 roots in
tests/test_backends.py)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import txckpt
from txckpt.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    StaleLineageError,
    StepConflictError,
    UnsafePathError,
)


def state(step, tag="A"):
    return {
        "model.safetensors": {"w": torch.full((4, 4), float(step)), "b": torch.arange(3)},
        "optimizer.pt": {"m": torch.full((2,), float(step)), "tag": tag},
        "trainer_state.json": {"global_step": step, "tag": tag},
    }


def test_save_returns_published_dir_readable_by_plain_tools(root):
    path = txckpt.save_checkpoint(root, 2, state(2))
    assert path == os.path.join(root, "checkpoint-2")
    # Plain tools read the files: the safetensors stream is byte-compatible.
    assert torch.equal(load_file(os.path.join(path, "model.safetensors"))["w"], torch.full((4, 4), 2.0))
    assert json.load(open(os.path.join(path, "trainer_state.json")))["global_step"] == 2
    assert sorted(os.listdir(path)) == [
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
        "txckpt-manifest.json",
    ]


def test_load_round_trip_and_kinds(root):
    files = {
        "a.safetensors": {"x": torch.randn(5, dtype=torch.bfloat16)},
        "b.pt": {"y": [1, 2]},
        "c.json": [1, "two"],
        "d.bin": b"\x00raw",
    }
    path = txckpt.save_checkpoint(root, 1, files, metadata={"note": "hi"})
    out = txckpt.load_checkpoint(path)
    assert torch.equal(out["a.safetensors"]["x"], files["a.safetensors"]["x"])
    assert out["b.pt"] == {"y": [1, 2]}
    assert out["c.json"] == [1, "two"]
    assert out["d.bin"] == b"\x00raw"
    assert txckpt.read_manifest(path).metadata == {"note": "hi"}
    assert txckpt.load_checkpoint(path, files=["c.json"]) == {"c.json": [1, "two"]}
    with pytest.raises(InvalidArgumentError):
        txckpt.load_checkpoint(path, files=["nope"])


def test_manifest_records_sizes_checksums_lineage(root):
    txckpt.save_checkpoint(root, 2, state(2))
    path = txckpt.save_checkpoint(root, 4, state(4))
    m = txckpt.read_manifest(path)
    assert m.step == 4 and m.parent.step == 2 and m.parent.lineage == m.lineage
    for name, entry in m.files.items():
        assert os.path.getsize(os.path.join(path, name)) == entry.size
        assert len(entry.checksum) == 32
    assert m.body()["checksum_algorithm"] == "xxh3-128"


def test_get_last_checkpoint_contract(root, tmp_path):
    # transformers' contract: a missing directory raises FileNotFoundError (tests/test_lookup.py)
    with pytest.raises(FileNotFoundError):
        txckpt.get_last_checkpoint(str(tmp_path / "missing"))
    os.makedirs(root)
    assert txckpt.get_last_checkpoint(root) is None
    for s in (2, 4, 10):
        txckpt.save_checkpoint(root, s, state(s))
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-10")


def test_saving_an_old_step_without_resume_is_refused(root):
    for s in (2, 4):
        txckpt.save_checkpoint(root, s, state(s))
    before = txckpt.read_manifest(os.path.join(root, "checkpoint-4")).digest
    for bad in (4, 3):
        with pytest.raises(StepConflictError, match="resume"):
            txckpt.save_checkpoint(root, bad, state(bad, "B"))
    assert txckpt.read_manifest(os.path.join(root, "checkpoint-4")).digest == before
    # Nothing was left behind by the refused saves.
    assert os.listdir(os.path.join(root, ".txckpt", "tx")) == [
        d
        for d in os.listdir(os.path.join(root, ".txckpt", "tx"))
        if not os.listdir(os.path.join(root, ".txckpt", "tx", d))
    ]


def test_rollback_forks_warns_and_keeps_the_abandoned(root, txlog):
    for s in (2, 4, 6):
        txckpt.save_checkpoint(root, s, state(s, "A"))
    a = {c.step: c for c in txckpt.CheckpointRoot(root).checkpoints()}
    txckpt.forget_roots()
    assert txckpt.resume(root, step=2) == os.path.join(root, "checkpoint-2")
    warning = " ".join(r.getMessage() for r in txlog.records if r.levelname == "WARNING")
    assert "checkpoint-4" in warning and "checkpoint-6" in warning and "abandons 2" in warning
    # The abandoned run is no longer what "resume the latest" continues.
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-2")
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    txckpt.resume(root)
    for s in (4, 6):
        txckpt.save_checkpoint(root, s, state(s, "B"))
    assert txckpt.load_checkpoint(txckpt.get_last_checkpoint(root))["optimizer.pt"]["tag"] == "B"
    everything = txckpt.CheckpointRoot(root).checkpoints("all")
    abandoned = [c for c in everything if c.state == "abandoned"]
    assert sorted(c.txid for c in abandoned) == sorted([a[4].txid, a[6].txid])
    for c in abandoned:
        assert txckpt.load_checkpoint(c.path)["optimizer.pt"]["tag"] == "A"  # intact, verified
        assert (
            txckpt.read_manifest(c.path).digest
            == txckpt.read_manifest(
                a[c.step].path
                if os.path.exists(a[c.step].path) and txckpt.read_manifest(a[c.step].path).txid == c.txid
                else c.path
            ).digest
        )


def test_resume_none_continues_the_current_lineage(root):
    assert txckpt.resume(root) is None
    txckpt.save_checkpoint(root, 1, state(1))
    txckpt.forget_roots()
    assert txckpt.resume(root) == os.path.join(root, "checkpoint-1")
    txckpt.save_checkpoint(root, 2, state(2))
    with pytest.raises(CheckpointNotFoundError):
        txckpt.resume(root, step=7)
    with pytest.raises(InvalidArgumentError):
        txckpt.resume(root, step=-1)


def test_stale_writer_is_refused_after_another_process_rolls_back(root):
    txckpt.save_checkpoint(root, 2, state(2))
    zombie = txckpt.CheckpointRoot(root)
    zombie.resume()
    zombie.save(4, state(4))
    operator = txckpt.CheckpointRoot(root)
    operator.resume(step=2)
    with pytest.raises(StaleLineageError, match="current lineage"):
        zombie.save(6, state(6))
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-2")


def test_transaction_open_save_and_directory(root):
    with txckpt.transaction(root, 3) as tx:
        tx.save("weights.safetensors", {"w": torch.ones(2)})
        with tx.open("blob.bin") as f:
            f.write(b"x" * 100)
        os.makedirs(os.path.join(tx.directory, "sub"))
        with open(os.path.join(tx.directory, "sub", "config.json"), "w") as f:
            json.dump({"a": 1}, f)
        assert os.path.basename(tx.directory) == "checkpoint-3"
        assert tx.output_root == os.path.dirname(tx.directory)
    m = txckpt.read_manifest(tx.path)
    assert sorted(m.files) == ["blob.bin", "sub/config.json", "weights.safetensors"]
    assert txckpt.load_checkpoint(tx.path)["sub/config.json"] == {"a": 1}


def test_transaction_aborts_on_exception_and_leaves_nothing(root):
    txckpt.save_checkpoint(root, 1, state(1))
    with pytest.raises(RuntimeError, match="boom"):
        with txckpt.transaction(root, 2) as tx:
            tx.save("a.pt", {"x": 1})
            raise RuntimeError("boom")
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-1")
    assert not os.path.exists(os.path.join(root, ".txckpt", "tx", tx.txid))
    assert os.listdir(os.path.join(root, ".txckpt", "intents")) == []
    txckpt.save_checkpoint(root, 2, state(2))  # the step is free


@pytest.mark.parametrize("name", ["../x", "/abs", "a/../b", "", "a//b", "txckpt-manifest.json", "a\\b"])
def test_unsafe_file_names_are_refused(root, name):
    with pytest.raises(UnsafePathError):
        txckpt.save_checkpoint(root, 1, {name: b"x"})
    assert txckpt.get_last_checkpoint(root) is None


def test_bad_arguments(root):
    with pytest.raises(InvalidArgumentError):
        txckpt.save_checkpoint(root, -1, {"a": b""})
    with pytest.raises(InvalidArgumentError):
        txckpt.save_checkpoint(root, "3", {"a": b""})
    with pytest.raises(InvalidArgumentError):
        txckpt.save_checkpoint(root, 1, {})
    with pytest.raises(InvalidArgumentError):
        txckpt.save_checkpoint(root, 1, {"x.json": object()})
    with pytest.raises(InvalidArgumentError):
        txckpt.save_checkpoint(root, 1, {"x.safetensors": {"t": "not a tensor"}})
    assert txckpt.get_last_checkpoint(root) is None


def test_new_lineage_starts_from_scratch_with_a_warning(root, txlog):
    txckpt.save_checkpoint(root, 5, state(5))
    txckpt.new_lineage(root)
    assert "abandons 1" in txlog.text
    assert txckpt.get_last_checkpoint(root) is None
    txckpt.save_checkpoint(root, 1, state(1, "C"))
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-1")
    assert len(txckpt.CheckpointRoot(root).checkpoints("all")) == 2


def test_resume_from_a_path_of_an_abandoned_lineage(root):
    for s in (2, 4):
        txckpt.save_checkpoint(root, s, state(s, "A"))
    txckpt.resume(root, step=2)
    txckpt.save_checkpoint(root, 3, state(3, "B"))
    a4 = next(c for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state == "abandoned")
    txckpt.forget_roots()
    assert txckpt.resume(root, path=a4.path) is not None
    assert txckpt.load_checkpoint(txckpt.get_last_checkpoint(root))["optimizer.pt"]["tag"] == "A"
    txckpt.save_checkpoint(root, 5, state(5, "C"))
    with pytest.raises(InvalidArgumentError, match="new_lineage"):
        txckpt.resume(root, path="/somewhere/else/checkpoint-1")


def test_resume_from_a_path_refuses_what_the_log_did_not_commit_or_retired(root):
    """resume(path=...) takes only a checkpoint the log committed with that very manifest: not a
    manifest edited after the commit, not one the retention policy retired."""
    from txckpt._manifest.manifest import Manifest
    from txckpt._maintenance.retention import retire

    for s in (1, 2, 3):
        txckpt.save_checkpoint(root, s, state(s, "A"))
    r = txckpt.CheckpointRoot(root)
    two, one = (next(c for c in r.checkpoints("all") if c.step == k) for k in (2, 1))
    manifest_path = os.path.join(two.path, "txckpt-manifest.json")
    with open(manifest_path, "rb") as f:
        edited = Manifest.decode(f.read())
    edited.metadata = {"edited": "after the commit"}
    with open(manifest_path, "wb") as f:
        f.write(edited.encode())  # self-consistent (re-digested), not the manifest the log committed
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        txckpt.CheckpointRoot(root).resume(path=two.path)
    assert retire(txckpt.CheckpointRoot(root), [one.txid]) == [one.txid]
    with pytest.raises(CheckpointNotFoundError, match="retired"):
        txckpt.CheckpointRoot(root).resume(path=one.path)


def test_durability_can_be_turned_off(root, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    txckpt.CheckpointRoot(root, durable=False).save(1, state(1))
    assert calls == []
    txckpt.CheckpointRoot(root, durable=True).save(2, state(2))
    assert len(calls) >= 5  # 3 files, staging dir, manifest, log entry, log dir, root


def test_a_restart_fences_off_the_job_it_replaces(root):
    """A zombie job beside its restart (or the same command launched twice): the restart resumes
    the lineage, and the zombie can no longer commit into it."""
    zombie = txckpt.CheckpointRoot(root)
    zombie.save(2, state(2, "Z"))
    zombie.save(4, state(4, "Z"))
    restart = txckpt.CheckpointRoot(root)
    assert restart.resume() == os.path.join(root, "checkpoint-4")
    restart.save(6, state(6, "R"))
    with pytest.raises(StaleLineageError, match="stale writer"):
        zombie.save(8, state(8, "Z"))
    restart.save(8, state(8, "R"))
    assert txckpt.load_checkpoint(txckpt.get_last_checkpoint(root))["optimizer.pt"]["tag"] == "R"
    assert [c.step for c in txckpt.CheckpointRoot(root).checkpoints("all")] == [2, 4, 6, 8]


def test_a_damaged_or_lost_log_entry_is_refused(root):
    txckpt.save_checkpoint(root, 2, state(2))
    txckpt.save_checkpoint(root, 4, state(4))
    log_dir = os.path.join(root, ".txckpt", "log")
    entries = sorted(os.listdir(log_dir))
    first = os.path.join(log_dir, entries[1])
    text = open(first).read()
    open(first, "w").write(text.replace('"step": 2', '"step": 3', 1))  # parses, but edited
    from txckpt.errors import LogCorruptError

    with pytest.raises(LogCorruptError, match="digest"):
        txckpt.CheckpointRoot(root).history()
    open(first, "w").write(text)
    os.unlink(os.path.join(log_dir, entries[-1]))  # the newest entry is lost
    with pytest.raises(LogCorruptError, match="lost entries"):
        txckpt.get_last_checkpoint(root)
