"""Verified loads decode while the hash finishes (txckpt._manifest.verify.load_checkpoint_files): a damaged
file is still refused, naming it, and nothing decoded from it is returned or kept alive; a file
whose decoder is not safe on unchecked bytes (weights_only=False) is decoded only once checked.
Local disk and S3 (moto), safetensors and torch files, a flipped byte at the start, middle and
end, and a truncated file."""

import gc
import weakref

import fsspec
import pytest
import torch

import txckpt
from txckpt._base import fileio
from txckpt._read import reader
from txckpt._manifest import verify
from txckpt.errors import IntegrityError

WEIGHTS, OPTIM = "model.safetensors", "optimizer.pt"


@pytest.fixture(autouse=True)
def overlapped(monkeypatch):
    """Small thresholds, so that files of a few hundred KiB take every overlapped path a
    multi-GiB load takes: two readers, the hash in a thread of its own fed chunk by chunk,
    the hash of a remote file in a thread beside its decode."""
    monkeypatch.setattr(fileio, "READ_CHUNK", 16 << 10)
    monkeypatch.setattr(fileio, "HOT_CHUNK", 16 << 10)
    monkeypatch.setattr(fileio, "_PIPELINE_MIN", 32 << 10)
    monkeypatch.setattr(verify, "_PARALLEL_MIN", 1)
    monkeypatch.setattr(verify, "_OVERLAP_MIN", 1)
    monkeypatch.setattr(verify, "_cpus", lambda: 2)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def where(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out"), {}
    return request.getfixturevalue("s3_root")


@pytest.fixture
def decodes(monkeypatch):
    """Every decode of a load and every check of a file, in the order they happen, with a weak
    reference to each tensor decoded."""
    events: list[tuple[str, str]] = []
    decoded: list[weakref.ref] = []
    real_decode, real_check = reader.read_object, verify.Deferred.check

    def read_object(name, kind, data, **kw):
        events.append(("decode", name))
        out = real_decode(name, kind, data, **kw)
        tensors = out.values() if isinstance(out, dict) else []
        stack = list(tensors)
        while stack:
            v = stack.pop()
            if isinstance(v, torch.Tensor):
                decoded.append(weakref.ref(v))
            elif isinstance(v, dict):
                stack.extend(v.values())
        return out

    def check(self):
        events.append(("check", getattr(self, "_name", "?")))
        return real_check(self)

    real_read_file = verify.read_file

    def read_file(storage, key, entry, **kw):
        got = real_read_file(storage, key, entry, **kw)
        got._name = key.rsplit("/", 1)[-1]  # the key is in the root's storage: the file's name is its last part
        return got

    monkeypatch.setattr(reader, "read_object", read_object)
    monkeypatch.setattr(verify.Deferred, "check", check)
    monkeypatch.setattr(verify, "read_file", read_file)
    return events, decoded


def _state():
    g = torch.Generator().manual_seed(1)
    weights = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(3)}  # 768 KiB
    optim = {
        "state": {i: {"exp_avg": torch.randn(128, 256, generator=g)} for i in range(4)},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}],
    }
    return weights, optim


def _save(url, opts):
    weights, optim = _state()
    path = txckpt.save_checkpoint(url, 1, {WEIGHTS: weights, OPTIM: optim}, storage_options=opts)
    txckpt.forget_roots()
    return path, weights, optim


def _damage(path, opts, name, how):
    fs, base = fsspec.core.url_to_fs(path, **opts)
    data = bytearray(fs.cat_file(f"{base}/{name}"))
    if how == "truncated":
        data = data[:-7]
    else:
        data[{"start": 3, "middle": len(data) // 2, "end": len(data) - 3}[how]] ^= 0x10
    fs.pipe_file(f"{base}/{name}", bytes(data))


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_intact_checkpoint_loads_the_same_through_the_overlapped_path(where, decodes, mmap):
    url, opts = where
    path, weights, optim = _save(url, opts)
    out = txckpt.load_checkpoint(path, storage_options=opts, mmap=mmap)  # S3: read either way
    assert out[WEIGHTS].keys() == weights.keys()
    assert all(torch.equal(out[WEIGHTS][k], weights[k]) for k in weights)
    assert all(torch.equal(out[OPTIM]["state"][i]["exp_avg"], optim["state"][i]["exp_avg"]) for i in range(4))
    events, _ = decodes
    # Both files were decoded before their check had returned: the decode overlapped the hash.
    for name in (WEIGHTS, OPTIM):
        assert events.index(("decode", name)) < events.index(("check", name))


DAMAGE = [(name, how) for name in (WEIGHTS, OPTIM) for how in ("start", "middle", "end", "truncated")]


def _refused(path, opts, decodes, name, how, mmap=False):
    events, decoded = decodes
    events.clear()
    decoded.clear()
    with pytest.raises(IntegrityError) as e:
        txckpt.load_checkpoint(path, storage_options=opts, mmap=mmap)
    err = e.value
    assert err.path == f"{path}/{name}" and name in str(err)
    assert ("truncated" if how == "truncated" else "checksum") in str(err)
    if how != "truncated":
        # The damaged file was read and decoded on the overlapped path (sizes are checked
        # before: a truncated file never reaches a decoder), and still refused.
        assert ("decode", name) in events and ("check", name) in events
    # Nothing decoded is kept alive by the error (its traceback, its context), nor anywhere else.
    gc.collect()
    assert decoded and all(ref() is None for ref in decoded), "a decoded tensor outlived the refused load"


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("name,how", DAMAGE)
def test_damaged_local_file_is_refused_naming_it_and_nothing_decoded_survives(tmp_path, decodes, name, how, mmap):
    path, _, _ = _save(str(tmp_path / "out"), {})
    _damage(path, {}, name, how)
    _refused(path, {}, decodes, name, how, mmap)


def _mapped_files() -> dict[str, list[tuple[int, int]]]:
    """path -> address ranges of this process's file mappings (/proc/self/maps)."""
    out: dict[str, list[tuple[int, int]]] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.setdefault(parts[5].strip(), []).append((lo, hi))
    return out


@pytest.mark.parametrize("pipeline", [False, True], ids=["hash-inline", "hash-thread"])
def test_mmap_load_maps_each_file_copy_on_write(tmp_path, monkeypatch, pipeline):
    """mmap=True: every tensor is a view of its own file's mapping (no copy), and a write into a
    tensor changes the process's page, never the committed file."""
    if not pipeline:
        monkeypatch.setattr(fileio, "_PIPELINE_MIN", 1 << 40)
    path, weights, optim = _save(str(tmp_path / "out"), {})
    out = txckpt.load_checkpoint(path, mmap=True)
    maps = _mapped_files()

    def inside(t: torch.Tensor, name: str) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in maps.get(f"{path}/{name}", []))

    assert all(inside(t, WEIGHTS) for t in out[WEIGHTS].values())
    assert all(inside(s["exp_avg"], OPTIM) for s in out[OPTIM]["state"].values())
    assert all(torch.equal(out[WEIGHTS][k], weights[k]) for k in weights)
    out[WEIGHTS]["w0"].add_(1.0)
    out[OPTIM]["state"][0]["exp_avg"].zero_()
    txckpt.verify_checkpoint(path)  # the files still hold what was committed
    again = txckpt.load_checkpoint(path, mmap=True)
    assert torch.equal(again[WEIGHTS]["w0"], weights["w0"]) and not torch.equal(out[WEIGHTS]["w0"], weights["w0"])
    assert torch.equal(again[OPTIM]["state"][0]["exp_avg"], optim["state"][0]["exp_avg"])


def test_damaged_s3_file_is_refused_naming_it_and_nothing_decoded_survives(s3_root, decodes):
    """The same damage on S3 (moto), one checkpoint damaged and restored in turn (a save per
    case would make this the slowest test here)."""
    url, opts = s3_root
    path, _, _ = _save(url, opts)
    fs, base = fsspec.core.url_to_fs(path, **opts)
    intact = {name: fs.cat_file(f"{base}/{name}") for name in (WEIGHTS, OPTIM)}
    for name, how in DAMAGE:
        _damage(path, opts, name, how)
        _refused(path, opts, decodes, name, how)
        fs.pipe_file(f"{base}/{name}", intact[name])
    assert txckpt.load_checkpoint(path, storage_options=opts).keys() == {WEIGHTS, OPTIM}


@pytest.mark.parametrize("where_", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_pickle_that_may_run_code_is_decoded_only_once_checked(request, tmp_path, decodes, where_):
    url, opts = (str(tmp_path / "out"), {}) if where_ == "local" else request.getfixturevalue("s3_root")
    path, _, optim = _save(url, opts)
    events, _ = decodes
    out = txckpt.load_checkpoint(path, storage_options=opts, weights_only=False)
    assert torch.equal(out[OPTIM]["state"][0]["exp_avg"], optim["state"][0]["exp_avg"])
    assert events.index(("check", OPTIM)) < events.index(("decode", OPTIM))
    assert events.index(("decode", WEIGHTS)) < events.index(("check", WEIGHTS))  # safetensors: safe, early

    events.clear()
    _damage(path, opts, OPTIM, "middle")
    with pytest.raises(IntegrityError, match="checksum") as e:
        txckpt.load_checkpoint(path, storage_options=opts, weights_only=False)
    assert e.value.path == f"{path}/{OPTIM}"
    assert ("decode", OPTIM) not in events  # never unpickled unchecked


def test_a_damaged_pickle_is_reported_as_damaged_not_as_a_forbidden_global(tmp_path, decodes):
    """A flipped byte inside the pickle makes the weights_only unpickler fail; the load says the
    file is damaged (its checksum), not that it holds something weights_only refuses."""
    path, _, _ = _save(str(tmp_path / "out"), {})
    p = f"{path}/{OPTIM}"
    data = bytearray(open(p, "rb").read())
    at = data.index(b"_rebuild_tensor_v2")  # inside data.pkl: a global the pickle names
    data[at + 1] ^= 0x20  # "_Rebuild_tensor_v2": a global weights_only refuses
    open(p, "wb").write(bytes(data))
    with pytest.raises(IntegrityError, match="checksum") as e:
        txckpt.load_checkpoint(path)
    assert e.value.path == p
    events, _ = decodes
    assert ("decode", OPTIM) in events


def test_the_hash_of_a_buffer_read_runs_behind_the_reader_and_is_checked_after(tmp_path, monkeypatch):
    """start_read_into_buffer returns once the bytes are in the buffer; the digest it promises is
    the file's (the hash thread got every chunk, in order)."""
    monkeypatch.setattr(fileio, "READ_CHUNK", 4096)
    monkeypatch.setattr(fileio, "_PIPELINE_MIN", 8192)
    import os

    from txckpt._base import checksum

    data = os.urandom(100_003)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    pending = fileio.start_read_into_buffer(str(p), len(data), hash=True, pipeline=True)
    assert bytes(pending.buffer.numpy()) == data
    assert pending.digest() == checksum.digest_bytes(data)
    assert pending.digest() == checksum.digest_bytes(data)  # asking again waits for nothing
    assert fileio.start_read_into_buffer(str(p), len(data), hash=False).digest() is None


def test_mmap_load_reads_where_the_filesystem_cannot_map(tmp_path, monkeypatch):
    """A filesystem that refuses mmap (ENODEV, as some FUSE mounts do): mmap=True reads instead,
    and the load is the same; damage is still refused."""
    import errno

    real = fileio.mmap.mmap

    def refuse(*a, **k):
        raise OSError(errno.ENODEV, "No such device")

    path, weights, _optim = _save(str(tmp_path / "out"), {})
    monkeypatch.setattr(fileio.mmap, "mmap", refuse)
    out = txckpt.load_checkpoint(path, mmap=True)
    assert all(torch.equal(out[WEIGHTS][k], weights[k]) for k in weights)
    _damage(path, {}, OPTIM, "middle")
    with pytest.raises(IntegrityError, match=OPTIM):
        txckpt.load_checkpoint(path, mmap=True)
    monkeypatch.setattr(fileio.mmap, "mmap", real)
