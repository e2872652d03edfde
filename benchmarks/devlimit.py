"""The device's limits, measured in the same run as what is compared with them.

One sequential ``os.write`` stream + one fsync is not the limit of a disk: the kernel only starts
write-back when the dirty pages age or pass a threshold, so the fsync at the end waits for
nearly all of it, and txckpt (which starts write-back every few MiB) beat it by up to 2.5x. The
limits here are the best this process can get the device to do with the same bytes:

* write, O_DIRECT: the bytes from one page-aligned buffer (an anonymous mmap), written with
  O_DIRECT in writes of 1, 4, 16 or 64 MiB (the best of them), then one fsync (the file's size
  and blocks: O_DIRECT leaves the metadata to it);
* write, buffered with write-back behind: chunks of 4, 16 or 64 MiB written through the page
  cache, each chunk's write-back started as soon as it is written (``sync_file_range(WRITE)``)
  and the one before it waited for (``WAIT_BEFORE|WRITE|WAIT_AFTER``) and dropped from the
  cache (``posix_fadvise(DONTNEED)``), so that the disk writes all the time the writer copies and
  dirty memory stays bounded; or, where sync_file_range is missing, a writer thread that
  fdatasyncs behind the writer;
* read: an O_DIRECT sequential read of the same files into one aligned buffer (16 or 64 MiB
  reads), and a cold-cache buffered read (``posix_fadvise(DONTNEED)`` untimed before it,
  ``readinto`` of 8 MiB chunks into one preallocated buffer).

A calibration pass (:func:`calibrate`) tries each variant a few times, interleaved, and keeps the
fastest of each kind; the comparison then runs that variant side by side with txckpt.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Callable

from . import harness as h

#: O_DIRECT needs buffers, offsets and lengths aligned to the logical block size; 4 KiB covers
#: every disk this runs on (512 B and 4 KiB sectors).
ALIGN = 4096
DIRECT_WRITE_SIZES = (1, 4, 16, 64)
BUFFERED_CHUNKS = (4, 16, 64)
DIRECT_READ_SIZES = (16, 64)

_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


def _sync_file_range() -> Any:
    from txckpt._base.fileio import sync_file_range  # libc's, loaded once by txckpt

    return sync_file_range


def aligned_copy(tensors: list[Any], nbytes: int) -> mmap.mmap:
    """The tensors' bytes, zero-padded (or cut) to ``nbytes`` and then to a multiple of
    :data:`ALIGN`, in one anonymous (page-aligned) mapping: the source of every write limit."""
    import torch

    padded = -(-max(nbytes, 1) // ALIGN) * ALIGN
    m = mmap.mmap(-1, padded)
    off = 0
    for t in tensors:
        if off >= nbytes:
            break
        raw = t.reshape(-1).view(torch.uint8).numpy().data
        n = min(len(raw), nbytes - off)
        m[off : off + n] = raw[:n]
        off += n
    return m  # the rest is zero: a fresh anonymous mapping


def odirect_supported(directory: str) -> bool:
    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    try:
        m = mmap.mmap(-1, ALIGN)
        os.write(fd, memoryview(m))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def write_odirect(path: str, buf: mmap.mmap, nbytes: int, write_size: int) -> None:
    """``nbytes`` of ``buf`` to a new file with O_DIRECT writes of ``write_size``, then fsync."""
    view = memoryview(buf)
    padded = len(view)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        off = 0
        while off < padded:
            off += os.write(fd, view[off : min(padded, off + write_size)])
        if padded != nbytes:
            os.ftruncate(fd, nbytes)  # the last block was written whole; the file is nbytes long
        os.fsync(fd)
    finally:
        view.release()
        os.close(fd)


def write_behind(path: str, buf: mmap.mmap, nbytes: int, chunk: int) -> None:
    """``nbytes`` of ``buf`` through the page cache in ``chunk``s, write-back of each started at
    once and the one before waited for and dropped; then fsync."""
    sfr = _sync_file_range()
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = prev = 0
        while off < nbytes:
            end = min(nbytes, off + chunk)
            done = off
            while done < end:
                done += os.write(fd, view[done:end])
            if sfr is not None:
                sfr(fd, off, end - off, _SFR_WRITE)
                if off > prev:
                    sfr(fd, prev, off - prev, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
                    os.posix_fadvise(fd, prev, off - prev, os.POSIX_FADV_DONTNEED)
            prev, off = off, end
        os.fsync(fd)
    finally:
        view.release()
        os.close(fd)


def write_thread_behind(path: str, buf: mmap.mmap, nbytes: int, chunk: int) -> None:
    """``nbytes`` of ``buf`` through the page cache in ``chunk``s while a second thread
    fdatasyncs the file behind the writer (fdatasync releases the GIL); then fsync."""
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = threading.Event()
    done = threading.Event()

    def syncer() -> None:
        while not done.is_set():
            written.wait()
            written.clear()
            os.fdatasync(fd)

    t = threading.Thread(target=syncer, daemon=True)
    t.start()
    try:
        off = 0
        while off < nbytes:
            end = min(nbytes, off + chunk)
            while off < end:
                off += os.write(fd, view[off:end])
            written.set()
        done.set()
        written.set()
        t.join()
        os.fsync(fd)
    finally:
        done.set()
        written.set()
        t.join()
        view.release()
        os.close(fd)


def write_variants(buf: mmap.mmap, nbytes: int, directory: str) -> dict[str, Callable[[str], None]]:
    """name -> fn(path): every write limit variant for this machine."""
    out: dict[str, Callable[[str], None]] = {}
    if odirect_supported(directory):
        for ws in DIRECT_WRITE_SIZES:
            out[f"O_DIRECT, {ws} MiB writes"] = lambda p, ws=ws: write_odirect(p, buf, nbytes, ws * h.MiB)
    for c in BUFFERED_CHUNKS:
        if _sync_file_range() is not None:
            out[f"buffered, sync_file_range behind, {c} MiB chunks"] = lambda p, c=c: write_behind(
                p, buf, nbytes, c * h.MiB
            )
        out[f"buffered, fdatasync thread behind, {c} MiB chunks"] = lambda p, c=c: write_thread_behind(
            p, buf, nbytes, c * h.MiB
        )
    return out


def _files_under(path: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _s, names in os.walk(path) for n in names)


def read_odirect(files: list[str], buf: mmap.mmap, read_size: int) -> int:
    """Every file, in order, into ``buf`` (large enough for each, rounded up to :data:`ALIGN`)
    with O_DIRECT reads of ``read_size``; returns the bytes read."""
    view = memoryview(buf)
    total = 0
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
            try:
                size = os.fstat(fd).st_size
                padded = -(-size // ALIGN) * ALIGN
                off = 0
                while off < padded:
                    n = os.readv(fd, [view[off : min(padded, off + read_size)]])
                    if n <= 0:
                        break
                    off += n
                total += min(off, size)
            finally:
                os.close(fd)
    finally:
        view.release()
    return total


def read_buffered(files: list[str], buf: mmap.mmap, chunk: int = 8 * h.MiB) -> int:
    view = memoryview(buf)
    total = 0
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                size = os.fstat(fd).st_size
                off = 0
                while off < size:
                    n = os.readv(fd, [view[off : min(size, off + chunk)]])
                    if n <= 0:
                        break
                    off += n
                total += off
            finally:
                os.close(fd)
    finally:
        view.release()
    return total


def read_variants(path: str) -> tuple[dict[str, Callable[[], int]], mmap.mmap]:
    """name -> fn(): every read limit variant over the files under ``path`` (the caller evicts
    them before each call), and the buffer they read into (keep it alive)."""
    files = _files_under(path)
    largest = max((os.path.getsize(f) for f in files), default=0)
    buf = mmap.mmap(-1, -(-max(largest, 1) // ALIGN) * ALIGN)
    buf[:: mmap.PAGESIZE] = bytes(len(range(0, len(buf), mmap.PAGESIZE)))  # fault it in, untimed
    out: dict[str, Callable[[], int]] = {}
    if files and odirect_supported(path):
        for rs in DIRECT_READ_SIZES:
            out[f"O_DIRECT read, {rs} MiB reads"] = lambda rs=rs: read_odirect(files, buf, rs * h.MiB)
    out["cold-cache buffered read, 8 MiB readinto"] = lambda: read_buffered(files, buf)
    return out, buf


def calibrate(methods: list[h.Method], reps: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each method ``reps`` times, interleaved; returns (median per name, all times)."""
    times = h.interleave(methods, reps, warmup=0)
    return {k: h.median(v) for k, v in times.items()}, times


def best_of(medians: dict[str, float], prefix: str) -> str | None:
    cands = {k: v for k, v in medians.items() if k.startswith(prefix)}
    return min(cands, key=cands.__getitem__) if cands else None


def elementwise_min(*series: list[float]) -> list[float]:
    """Per round, the faster of the limits measured in that round (the limit is the better)."""
    return [min(xs) for xs in zip(*series)]


def sweep_note(medians: dict[str, float], nbytes: int) -> str:
    """The calibration's medians as one line: name MiB/s."""
    parts = [f"{k}: {nbytes / h.MiB / v:.0f} MiB/s" for k, v in sorted(medians.items(), key=lambda kv: kv[1])]
    return "; ".join(parts)
