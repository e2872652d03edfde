"""txckpt._base.fileio (one-buffer reads, pipelined hashing, hash + fsync) and the load path built on
it: verification reads each decoded file once, into the buffer its tensors live in."""

import io
import os

import pytest
import torch

import txckpt
from txckpt._base import checksum
from txckpt._base import fileio
from txckpt.errors import IntegrityError
from txckpt._save.serialization import read_object


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few KiB, so that small files go through the multi-chunk, pipelined path."""
    monkeypatch.setattr(fileio, "READ_CHUNK", 4096)
    monkeypatch.setattr(fileio, "_PIPELINE_MIN", 8192)
    monkeypatch.setattr(fileio, "HASH_CHUNK", 4096)
    monkeypatch.setattr(fileio, "HOT_CHUNK", 4096)


def _file(tmp_path, data: bytes, name="f.bin"):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 8192, 100_000])
@pytest.mark.parametrize("pipelined", [False, True])
def test_read_into_buffer_content_and_digest(tmp_path, monkeypatch, size, pipelined):
    monkeypatch.setattr(fileio, "READ_CHUNK", 4096)
    monkeypatch.setattr(fileio, "HOT_CHUNK", 3000)
    monkeypatch.setattr(fileio, "_PIPELINE_MIN", 8192)
    data = os.urandom(size)
    path = _file(tmp_path, data)
    buf, digest = fileio.read_into_buffer(path, size, hash=True, pipeline=pipelined)
    assert buf.dtype == torch.uint8 and buf.numel() == size
    assert bytes(buf.numpy()) == data
    assert digest == checksum.digest_bytes(data)
    buf2, none = fileio.read_into_buffer(path, size, hash=False)
    assert none is None and bytes(buf2.numpy()) == data


@pytest.mark.parametrize("delta", [-1, 1])
def test_read_into_buffer_wrong_size(tmp_path, small_chunks, delta):
    path = _file(tmp_path, b"x" * 20_000)
    with pytest.raises(fileio.SizeMismatch) as e:
        fileio.read_into_buffer(path, 20_000 + delta, hash=True)
    assert e.value.actual == 20_000


def test_read_into_buffer_missing_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        fileio.read_into_buffer(str(tmp_path / "nope"), 1, hash=True)
    with pytest.raises(IsADirectoryError):
        fileio.read_into_buffer(str(tmp_path), 1, hash=True)
    with pytest.raises(IsADirectoryError):
        fileio.hash_file(str(tmp_path))


@pytest.mark.parametrize("size", [0, 5, 4096, 50_000])
def test_hash_file_and_fsync(tmp_path, small_chunks, size):
    data = os.urandom(size)
    path = _file(tmp_path, data)
    assert fileio.hash_file(path) == (size, checksum.digest_bytes(data))
    assert fileio.hash_and_fsync(path) == (size, checksum.digest_bytes(data))


@pytest.mark.parametrize("fsync", [False, True])
def test_hash_file_tap_on_its_own_thread_gives_the_same_digests_and_index(tmp_path, monkeypatch, fsync):
    """Issue 47: a large file's tap (the tensor index: chunk and tensor digests) runs on a second
    thread, one block behind the file's digest; the file's digest, its chunk digests and its
    tensor index are byte for byte those of the one-thread pass, and a tap's error is raised."""
    import threading

    from safetensors.torch import save_file

    from txckpt._manifest.tensor_index import Indexer

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(12)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    size = os.path.getsize(path)
    monkeypatch.setattr(fileio, "HASH_CHUNK", 4096)
    monkeypatch.setattr(fileio, "TAP_THREAD_BLOCK", 4096)  # ~15 blocks: every hand-over path
    monkeypatch.setattr(fileio, "usable_cores", lambda: 2)

    def hashed(thread_from: int) -> tuple:
        monkeypatch.setattr(fileio, "TAP_THREAD_FROM", thread_from)
        indexer, threads = Indexer("m.safetensors", chunk_size=8192), set()

        def tap(view):
            threads.add(threading.get_ident())
            indexer.update(view)

        got, digest = fileio.hash_file(path, fsync=fsync, tap=tap)
        return (got, digest, indexer.finish(got)), threads

    one, one_threads = hashed(size + 1)
    two, two_threads = hashed(size)
    assert one_threads == {threading.get_ident()} and threading.get_ident() not in two_threads
    assert one == two
    assert one[:2] == (size, checksum.digest_bytes(open(path, "rb").read()))
    assert len(one[2].chunks) == -(-size // 8192) and len(one[2].tensors) == 12

    def failing(view):
        raise ValueError("tap failed")

    with pytest.raises(ValueError, match="tap failed"):
        fileio.hash_file(path, tap=failing)


# ----- the load path --------------------------------------------------------------------------


def _state():
    g = torch.Generator().manual_seed(0)
    weights = {
        "w": torch.randn(300, 17, generator=g),
        "b": torch.randn(17, generator=g),
        "i": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(3, generator=g).half(),
        "e": torch.zeros(0, 4),
        "s": torch.tensor(2.5),
        "m": torch.tensor([True, False, True]),
    }
    optim = {
        "state": {0: {"exp_avg": torch.randn(4000, generator=g), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    return weights, optim


def _save(root, weights, optim):
    return txckpt.save_checkpoint(
        root, 1, {"model.safetensors": weights, "optimizer.pt": optim, "meta.json": {"a": 1}, "raw.bin": b"raw bytes"}
    )


@pytest.mark.parametrize("verify", [True, False])
def test_load_roundtrip(root, small_chunks, verify):
    weights, optim = _state()
    out = txckpt.load_checkpoint(_save(root, weights, optim), verify=verify)
    for k, v in weights.items():
        got = out["model.safetensors"][k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    assert torch.equal(out["optimizer.pt"]["state"][0]["exp_avg"], optim["state"][0]["exp_avg"])
    assert out["optimizer.pt"]["param_groups"] == optim["param_groups"]
    assert out["meta.json"] == {"a": 1}
    assert out["raw.bin"] == b"raw bytes" and isinstance(out["raw.bin"], bytes)


def test_loaded_safetensors_are_independent_views(root):
    """Views of the read buffer, each on a storage of its own: saving one tensor saves its bytes
    only, writing into one leaves the others alone, and they outlive every other reference."""
    weights, optim = _state()
    tensors = txckpt.load_checkpoint(_save(root, weights, optim))["model.safetensors"]
    w = tensors["w"]
    assert w.untyped_storage().nbytes() == w.numel() * w.element_size()
    f = io.BytesIO()
    torch.save(tensors["b"], f)
    assert len(f.getvalue()) < 4096
    tensors["b"].add_(1)
    assert torch.equal(tensors["w"], weights["w"]) and torch.equal(tensors["b"], weights["b"] + 1)
    del tensors
    junk = [torch.randn(1 << 16) for _ in range(8)]  # reuse freed memory, if any was freed
    assert torch.equal(w, weights["w"]) and junk


def test_foreign_safetensors_file_decodes_from_buffer(tmp_path):
    from safetensors.torch import save_file

    weights, _ = _state()
    weights.pop("e")
    path = str(tmp_path / "x.safetensors")
    save_file(weights, path)
    buf, _ = fileio.read_into_buffer(path, os.path.getsize(path), hash=False)
    out = read_object("x.safetensors", "safetensors", buf)
    assert all(torch.equal(out[k], v) for k, v in weights.items())


def test_malformed_safetensors_is_an_integrity_error():
    bad = torch.frombuffer(bytearray(b"\x10\x00\x00\x00\x00\x00\x00\x00{}garbage"), dtype=torch.uint8)
    with pytest.raises(IntegrityError):
        read_object("m.safetensors", "safetensors", bad)
    # Offsets past the end of the data: refused by the view decoder, then by safetensors.
    hdr = b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    hdr += b" " * (-len(hdr) % 8)
    raw = len(hdr).to_bytes(8, "little") + hdr + b"\x00" * 8
    with pytest.raises(IntegrityError):
        read_object("m.safetensors", "safetensors", torch.frombuffer(bytearray(raw), dtype=torch.uint8))


class _Custom:
    def __init__(self, v):
        self.v = v


def _torch_bytes(obj, **kw):
    f = io.BytesIO()
    torch.save(obj, f, **kw)
    return torch.frombuffer(bytearray(f.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("zero_copy", ["1", "0"])
def test_torch_files_decode_from_the_buffer(monkeypatch, zero_copy):
    monkeypatch.setenv("TXCKPT_ZERO_COPY_LOAD", zero_copy)
    a = torch.randn(1000)
    obj = {"a": a, "same": a, "view": a[10:20], "n": 3, "s": "x"}
    buf = _torch_bytes(obj)
    out = read_object("o.pt", "torch", buf)
    assert torch.equal(out["a"], a) and torch.equal(out["view"], a[10:20]) and out["n"] == 3
    assert out["same"].data_ptr() == out["a"].data_ptr()  # shared storages stay shared
    inside = buf.data_ptr() <= out["a"].data_ptr() < buf.data_ptr() + buf.numel()
    assert inside == (zero_copy == "1")
    # A storage of its own: saving one tensor does not save the whole file.
    assert out["a"].untyped_storage().nbytes() == a.numel() * a.element_size()


def test_torch_weights_only_is_enforced_on_the_buffer():
    import pickle

    buf = _torch_bytes({"c": _Custom(5)})
    with pytest.raises(pickle.UnpicklingError):
        read_object("o.pt", "torch", buf)
    assert read_object("o.pt", "torch", buf, weights_only=False)["c"].v == 5


def test_torch_legacy_format_falls_back():
    t = torch.arange(10.0)
    buf = _torch_bytes({"t": t}, _use_new_zipfile_serialization=False)
    assert torch.equal(read_object("o.pt", "torch", buf)["t"], t)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "missing"])
def test_damage_raises_integrity_error(root, small_chunks, name, damage):
    weights, optim = _state()
    path = _save(root, weights, optim)
    f = os.path.join(path, name)
    data = bytearray(open(f, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        open(f, "wb").write(data)
    elif damage == "truncate":
        open(f, "wb").write(data[:-1])
    elif damage == "extend":
        open(f, "wb").write(data + b"\x00")
    else:
        os.unlink(f)
    with pytest.raises(IntegrityError, match=name):
        txckpt.load_checkpoint(path)
    with pytest.raises(IntegrityError, match=name):
        txckpt.verify_checkpoint(path)
    if damage != "flip":  # sizes are checked even without verification
        with pytest.raises(IntegrityError, match=name):
            txckpt.load_checkpoint(path, verify=False)


# ----- the Trainer mixin's streamed optimizer --------------------------------------------------


@pytest.mark.trainer
def test_trainer_optimizer_is_streamed_not_rehashed(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args

    from txckpt._manifest import rankparts
    from txckpt.integrations.transformers import TransactionalTrainer

    rehashed = []
    real = rankparts.hash_staged

    def spy(storage, key, names, durable, rank=0, relink=None):  # the committer's pass over unclaimed files
        rehashed.extend(names)
        return real(storage, key, names, durable, rank, relink)

    monkeypatch.setattr(rankparts, "hash_staged", spy)
    torch.manual_seed(0)
    out = str(tmp_path / "out")
    TransactionalTrainer(model=TinyModel(TinyConfig()), args=make_args(out, 2), train_dataset=Data(0)).train()
    assert "model.safetensors" in rehashed
    assert "optimizer.pt" not in rehashed and "scheduler.pt" not in rehashed
    ckpt = txckpt.get_last_checkpoint(out)
    manifest = txckpt.verify_checkpoint(ckpt)
    assert manifest.files["optimizer.pt"].kind == "torch" and manifest.files["scheduler.pt"].kind == "torch"
    loaded = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    assert set(loaded) == {"state", "param_groups"}
    assert torch.is_grad_enabled() and torch.save.__module__.startswith("torch")  # the patch is gone


@pytest.mark.trainer
def test_trainer_refuses_a_streamed_file_rewritten_afterwards(tmp_path):
    pytest.importorskip("transformers")
    from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args

    from txckpt.integrations.transformers import TransactionalTrainer

    class Rewriter(TransactionalTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            super()._save_optimizer_and_scheduler(output_dir)
            torch.save({"other": torch.zeros(3)}, os.path.join(output_dir, "optimizer.pt"))

    class Opted(Rewriter):
        txckpt_stream_optimizer = False

    torch.manual_seed(0)
    with pytest.raises(txckpt.errors.InvalidArgumentError, match="txckpt_stream_optimizer"):
        Rewriter(model=TinyModel(TinyConfig()), args=make_args(str(tmp_path / "a"), 2), train_dataset=Data(0)).train()
    assert txckpt.get_last_checkpoint(str(tmp_path / "a")) is None
    torch.manual_seed(0)
    Opted(model=TinyModel(TinyConfig()), args=make_args(str(tmp_path / "b"), 2), train_dataset=Data(0)).train()
    ckpt = txckpt.get_last_checkpoint(str(tmp_path / "b"))
    txckpt.verify_checkpoint(ckpt)
    assert set(torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)) == {"other"}


# ----- local writes ----------------------------------------------------------------------------


@pytest.mark.parametrize("durable", [True, False])
def test_durable_file_keeps_the_order_of_small_and_large_writes(tmp_path, monkeypatch, durable):
    """Small writes are buffered, large ones go straight to the file: the bytes still land in
    the order written, across buffer drains and write-behind points."""
    from txckpt._storage.local import store as local

    monkeypatch.setattr(local, "_WRITE_BUFFER", 4096)
    monkeypatch.setattr(local, "_DIRECT_WRITE", 1024)
    monkeypatch.setattr(local, "_WRITE_BEHIND", 8192)
    path = str(tmp_path / "f")
    f = local._DurableFile(path, durable)
    expected = bytearray()
    for i, n in enumerate([10, 1023, 1024, 5, 5000, 3, 4095, 4096, 20_000, 1, 0, 700, 700, 700, 700, 700, 700]):
        chunk = bytes([i % 251]) * n
        data = memoryview(chunk) if i % 2 else chunk
        assert f.write(data) == n
        expected += chunk
    f.write(torch.arange(1000, dtype=torch.float32).numpy())  # a non-byte memoryview
    expected += torch.arange(1000, dtype=torch.float32).numpy().tobytes()
    f.close()
    assert open(path, "rb").read() == bytes(expected)
    g = local._DurableFile(str(tmp_path / "g"), durable)
    g.write(b"x" * 5000)
    g.abort()
    assert not os.path.exists(str(tmp_path / "g"))
