"""LocalStorage's WriteBatch: a staged file's fsync moves from its close() to the batch's wait()
(the disk writes one file's tail while the next is serialised), and nothing a save relies on
comes before it: the manifest and the log entry are written only after every data file is
fsynced."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import txckpt
from txckpt._storage.local import store as local
from txckpt._storage.local.store import LocalStorage


@pytest.fixture
def fsyncs(monkeypatch):
    """Every os.fsync of this process, as the path its fd names (fsync on a directory too)."""
    calls: list[str] = []
    real = os.fsync

    def fsync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.fixture
def dontneed(monkeypatch):
    """Every page-cache drop (POSIX_FADV_DONTNEED) the local writer makes, as (path, offset,
    length, the file's size then); the drop itself still happens."""
    calls: list[tuple[str, int, int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, os.fstat(fd).st_size))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(local, "_fadvise", fadvise)
    return calls


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_defers_the_fsync_to_wait(tmp_path, fsyncs):
    st = LocalStorage(str(tmp_path))
    batch = st.write_batch()
    paths = []
    for name in ("a.bin", "b.bin"):
        with batch.open_write(f"tx/{name}", durable=True) as f:
            f.write(b"x" * (5 << 20))  # past the write-behind step: write-back started on the way
        paths.append(str(tmp_path / "tx" / name))
        assert (tmp_path / "tx" / name).stat().st_size == 5 << 20  # the bytes are there at close
    assert not [p for p in fsyncs if p in paths]
    batch.wait()
    assert [p for p in fsyncs if p in paths] == paths  # each once, in order
    batch.wait()  # nothing left to do
    assert [p for p in fsyncs if p in paths] == paths


def test_not_durable_files_complete_at_close(tmp_path, fsyncs):
    st = LocalStorage(str(tmp_path))
    batch = st.write_batch()
    before = _open_fds()
    with batch.open_write("tx/a.bin", durable=False) as f:
        f.write(b"abc")
    assert _open_fds() == before  # closed, nothing pending
    batch.wait()
    assert fsyncs == []


def test_a_failed_fsync_names_the_file_removes_it_and_the_others_still_finish(tmp_path, monkeypatch):
    st = LocalStorage(str(tmp_path))
    batch = st.write_batch()
    for name in ("a.bin", "bad.bin", "c.bin"):
        with batch.open_write(f"tx/{name}", durable=True) as f:
            f.write(name.encode())
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("bad.bin"):
            raise OSError(errno.EIO, "Input/output error")
        synced.append(path)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    before = len(_open_fds())
    with pytest.raises(OSError) as info:
        batch.wait()
    assert info.value.errno == errno.EIO and info.value.filename.endswith("bad.bin")
    assert not (tmp_path / "tx" / "bad.bin").exists()  # a failed file leaves nothing at its key
    assert [os.path.basename(p) for p in synced] == ["a.bin", "c.bin"]
    assert len(_open_fds()) == before - 3  # every pending descriptor is closed


def test_cancel_closes_without_fsync(tmp_path, fsyncs):
    st = LocalStorage(str(tmp_path))
    batch = st.write_batch()
    before = _open_fds()
    with batch.open_write("tx/a.bin", durable=True) as f:
        f.write(b"abc")
    assert len(_open_fds()) == len(before) + 1  # held open until its fsync
    batch.cancel()
    assert _open_fds() == before
    assert not [p for p in fsyncs if p.endswith("a.bin")]


def test_pending_fsyncs_are_bounded(tmp_path, fsyncs, monkeypatch):
    monkeypatch.setattr(local, "_PENDING_FSYNCS", 2)
    st = LocalStorage(str(tmp_path))
    batch = st.write_batch()
    before = _open_fds()
    for i in range(5):
        with batch.open_write(f"tx/{i}.bin", durable=True) as f:
            f.write(b"x")
        assert len(_open_fds()) - len(before) == min(i + 1, 2)
    # Beyond two pending files each close() fsynced the oldest.
    assert [os.path.basename(p) for p in fsyncs if p.endswith(".bin")] == ["0.bin", "1.bin", "2.bin"]
    batch.wait()
    assert [os.path.basename(p) for p in fsyncs if p.endswith(".bin")] == [f"{i}.bin" for i in range(5)]
    assert _open_fds() == before


def test_a_save_fsyncs_every_data_file_before_its_manifest_and_log_entry(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, *a, **k):
        events.append(("link", os.fsdecode(dst)))
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    root = txckpt.CheckpointRoot(str(tmp_path / "root"), durable=True)
    path = root.save(
        1,
        {
            "model.safetensors": {"w": torch.ones(3 << 20)},  # 12 MiB: write-behind runs
            "optimizer.pt": {"s": torch.zeros(8)},
        },
    )
    data = [i for i, (op, p) in enumerate(events) if op == "fsync" and p.endswith((".safetensors", ".pt"))]
    manifest = next(i for i, (op, p) in enumerate(events) if op == "link" and p.endswith(txckpt.MANIFEST_NAME))
    entry = max(i for i, (op, p) in enumerate(events) if op == "link" and "/.txckpt/log/" in p)  # the commit
    assert len(data) == 2 and max(data) < manifest < entry
    assert txckpt.load_checkpoint(path)["model.safetensors"]["w"].shape == (3 << 20,)


def test_past_its_page_cache_budget_a_save_drops_what_is_on_the_disk(tmp_path, monkeypatch, dontneed):
    """Once a batch has put _CACHE_BUDGET bytes into the page cache, each durable file waits for
    the write-back of what lies _DROP_LAG behind its writer and drops it (DONTNEED): only ranges
    already written, never the part still being written, until the save is back under its budget.
    Under the budget nothing is dropped. The bytes are the same either way."""
    monkeypatch.setattr(local, "_WRITE_BEHIND", 64 << 10)
    monkeypatch.setattr(local, "_DROP_LAG", 128 << 10)
    monkeypatch.setattr(local, "_CACHE_BUDGET", 1 << 20)
    drops = dontneed  # (path, offset, length, bytes written so far)
    st = LocalStorage(str(tmp_path))
    chunk = bytes(range(256)) * 256  # 64 KiB
    batch = st.write_batch()
    with batch.open_write("tx/small.bin", durable=True) as f:
        for _ in range(8):  # 512 KiB: under the budget
            f.write(chunk)
    assert drops == []
    with batch.open_write("tx/big.bin", durable=True) as f:
        for _ in range(48):  # 3 MiB: the batch passes its 1 MiB budget on the way
            f.write(chunk)
    big = str(tmp_path / "tx" / "big.bin")
    behind = [d for d in drops if d[0] == big]
    assert behind, drops
    for _path, offset, length, written in behind:
        assert offset + length <= written - local._DROP_LAG  # at least the lag behind the writer
    ranges = sorted((o, o + n) for _p, o, n, _w in behind)
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # no gaps
    n_behind = len(drops)
    batch.wait()
    # What stays cached is what the budget allows: the small file and big.bin's last lag.
    assert drops[n_behind:] == []
    assert batch.cached == (8 + 48) * len(chunk) - ranges[-1][1] <= local._CACHE_BUDGET
    assert (tmp_path / "tx" / "small.bin").read_bytes() == chunk * 8
    assert (tmp_path / "tx" / "big.bin").read_bytes() == chunk * 48


def test_files_too_small_to_drop_behind_leave_the_cache_after_their_fsync(tmp_path, monkeypatch, dontneed):
    """Files shorter than two lags never drop behind their writer; over the budget, each one's
    pages go once it is fsynced, oldest first, until the save is back under its budget."""
    monkeypatch.setattr(local, "_CACHE_BUDGET", 256 << 10)
    batch = LocalStorage(str(tmp_path)).write_batch()
    for i in range(6):
        with batch.open_write(f"tx/{i}.bin", durable=True) as f:
            f.write(bytes([i]) * (96 << 10))
    assert dontneed == []
    batch.wait()
    drops = [(os.path.basename(path), offset, length) for path, offset, length, _size in dontneed]
    # 576 KiB cached, over the budget before each of the first four drops (576, 480, 384, 288);
    # then 192 KiB <= 256 KiB, and the last two files stay.
    assert drops == [("0.bin", 0, 0), ("1.bin", 0, 0), ("2.bin", 0, 0), ("3.bin", 0, 0)]
    assert batch.cached == 2 * (96 << 10)
    assert all((tmp_path / "tx" / f"{i}.bin").read_bytes() == bytes([i]) * (96 << 10) for i in range(6))


def test_files_smaller_than_the_lag_drop_once_the_writer_is_a_lag_past_them(tmp_path, monkeypatch, dontneed):
    """A save of many files each smaller than the lag (an incremental DCP save: one file per
    tensor) keeps its page-cache footprint at the budget while it writes: over the budget, a
    closed file that lies a whole lag behind the writer waits for its write-back and is
    dropped then, not at the batch's fsyncs (before this, 1 GiB in 64 MiB files stayed cached
    until the end and saved 3x slower than in one file)."""
    monkeypatch.setattr(local, "_CACHE_BUDGET", 256 << 10)
    monkeypatch.setattr(local, "_DROP_LAG", 128 << 10)
    batch = LocalStorage(str(tmp_path)).write_batch()
    peak = 0
    for i in range(8):
        with batch.open_write(f"tx/{i}.bin", durable=True) as f:
            f.write(bytes([i]) * (96 << 10))
        peak = max(peak, batch.cached)
    drops = [(os.path.basename(path), offset, length) for path, offset, length, _size in dontneed]
    # After file k closes the writer stands at 96 KiB x (k + 1): over the budget (288 KiB), file
    # k - 2 lies 192 KiB >= the lag behind it and goes; the last two stay for the fsyncs.
    assert drops == [(f"{i}.bin", 0, 96 << 10) for i in range(6)]
    assert peak <= local._CACHE_BUDGET and batch.cached == 2 * (96 << 10)
    batch.wait()
    assert len(dontneed) == 6  # under the budget at the fsyncs: nothing more to drop
    assert all((tmp_path / "tx" / f"{i}.bin").read_bytes() == bytes([i]) * (96 << 10) for i in range(8))


def test_a_large_durable_save_leaves_at_most_its_budget_in_the_page_cache(tmp_path, dontneed):
    """With the shipped limits (no monkeypatching): a durable file of budget + 2 lags drops what
    lies a lag behind its writer as it writes, and leaves at most ``_CACHE_BUDGET`` bytes of
    itself cached once fsynced, so a save's page-cache footprint does not grow with its size.
    (A budget of 2 GiB, as before, leaves all of it cached: on a ballooned VM five such saves in
    a row took 5-10x longer, docs/troubleshooting.md.)"""
    assert local._CACHE_BUDGET <= 256 << 20 and local._DROP_LAG <= local._CACHE_BUDGET

    def dropped() -> int:  # a length of 0 drops the rest of the file
        return sum(length or file_size - offset for _path, offset, length, file_size in dontneed)

    size = local._CACHE_BUDGET + 2 * local._DROP_LAG
    chunk = bytes(range(256)) * (4 << 12)  # 1 MiB
    with LocalStorage(str(tmp_path)).open_write("tx/big.bin", durable=True) as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        during = dropped()
    assert during >= size - local._CACHE_BUDGET - local._DROP_LAG  # behind the writer, as it wrote
    assert size - dropped() <= local._CACHE_BUDGET
    assert os.path.getsize(tmp_path / "tx" / "big.bin") == size
