"""Verified S3 reads at the network's pace: one object read by parallel ranged GETs straight into
the buffer its tensors will view, hashed in order as the parts land (``S3Storage.start_read``).

The object is split into parts of ``part`` bytes; at most ``in_flight`` ranged GETs run at once
on s3fs's event loop, each part copied into its place in the buffer as its body arrives. A hash
thread (``fileio.HashWorker``: xxhash releases the GIL) is handed each part once it and every
part before it have landed, so the hash runs beside the downloads and at most the last parts
are left to hash when the last byte lands. The first response's ``Content-Range`` says the
object's size: an object that is not ``size`` bytes is :class:`~txckpt._base.fileio.SizeMismatch`
before the rest is read. Nothing here decides that the bytes are good: the caller compares the
digest with the manifest before it hands out anything decoded from the buffer (txckpt._manifest.verify).

``ranged_to_file`` downloads the same way into a bounded window of part buffers and writes each
part at its offset of a local file as it lands (``S3Storage.read_to_file``: a fetch to local
disk), from a few threads; ``ranged_copy`` hands the parts, in order, to a writer (a fetch into
another store), hashing them.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from ..._base.checksum import new_hasher
from ..._base.fileio import BufferRead, SizeMismatch, HashWorker, new_buffer
from .upload import run_on_loop


def _total_of(response: dict[str, Any]) -> int | None:
    """The object's size from a ranged GET's ``Content-Range: bytes a-b/TOTAL``."""
    text = response.get("ContentRange") or ""
    _, _, total = text.rpartition("/")
    return int(total) if total.isdigit() else None


class RangeIgnored(Exception):
    """The server answered the first ranged GET of an object with ``200`` and the whole object:
    HTTP lets a server ignore ``Range`` (some proxies and gateways do). Nothing of the object
    was written anywhere yet (the first part is always fetched alone); the caller reads it with
    one plain GET instead (S3Storage does). Not damage: the bytes are fine, only unranged."""


def whole_object(resp: dict[str, Any]) -> bool:
    """Whether a ranged GET's answer is the whole object: status 200, no ``Content-Range``."""
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return not resp.get("ContentRange") and status == 200


async def _get_part(fs: Any, bucket: str, obj: str, size: int, a: int, into: memoryview | _FileRange) -> None:
    """One ranged GET of bytes ``a`` .. ``a + len(into)`` of ``obj`` (``size`` bytes) into ``into``
    (a buffer, or a :class:`_FileRange`: the chunks written at their offsets of a file).

    A ``200`` with the whole object instead of a ``206`` (the server ignored the range): for the
    first part, :class:`RangeIgnored` (the caller reads the object in one GET: the other parts
    would each bring the whole object again); for a later part (a server that honoured the first
    range, then not this one) the part is taken from the body, after skipping ``a`` bytes."""
    b = a + len(into)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=obj, Range=f"bytes={a}-{b - 1}")
    try:
        whole = whole_object(resp)
        total = resp.get("ContentLength") if whole else _total_of(resp)
        if total is not None and total != size:
            raise SizeMismatch(total)
        if whole and a == 0:
            raise RangeIgnored(f"{bucket}/{obj}: a ranged GET was answered 200 with the whole object")
        # Each chunk as it comes off the connection, copied once into its place: read() would
        # join the chunks into one bytes object first (a second copy of the part).
        body, pos = resp["Body"], 0
        skip = a if whole else 0
        while skip:
            chunk = await body.read(min(skip, 1 << 20))
            if not chunk:  # shorter than the range: the object changed size meanwhile
                raise SizeMismatch(a - skip)
            skip -= len(chunk)
        while pos < len(into):
            chunk = await body.read(len(into) - pos)
            if not chunk:  # shorter than the range: the object changed size meanwhile
                raise SizeMismatch(a + pos)
            into[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    finally:
        resp["Body"].close()


async def _get_all(
    count: int,
    get: Callable[[int], Awaitable[None]],
    in_flight: int,
    may_start: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """``get(i)`` for each part ``i``, at most ``in_flight`` at once, part 0 alone first (its
    ``Content-Range`` says whether the size is right); ``may_start(i)`` is awaited before part
    ``i`` starts (a bound on the parts held in memory). On an error every other part is
    cancelled and awaited, so that none lands after this returns."""
    gate = asyncio.Semaphore(max(1, in_flight))

    async def one(i: int) -> None:
        if may_start is not None:
            await may_start(i)
        async with gate:
            await get(i)

    await one(0)
    tasks = [asyncio.ensure_future(one(i)) for i in range(1, count)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await _cancel_all(tasks)
        raise


async def _cancel_all(tasks: list[Any]) -> None:
    """Cancel ``tasks`` and wait until every one has ended (a failed download's siblings)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): fault a range's pages in, writable, in one call.
_MADV_POPULATE_WRITE = 23
PREFAULT = os.environ.get("TXCKPT_S3_READ_PREFAULT", "1") == "1"
_madvise: list[Any] = []  # libc's madvise, once looked up; [None]: not available here


def _libc_madvise() -> Any:
    if not _madvise:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _madvise.append(fn)
    return _madvise[0]


def _prefault(buffer: Any, size: int, part: int) -> None:
    """Fault in the pages of a new buffer, part by part, ahead of the downloads (a thread of its
    own: ctypes releases the GIL). One call per part costs about half the CPU of the 4 KiB page
    faults the download loop would otherwise take one by one while it copies the parts in
    (256 MiB: ~55 ms against ~95 ms, measured here), and takes them off the loop's thread. The
    contents are not touched, so a part that lands first loses nothing; on a kernel without it
    the first call fails and the loop faults the pages in as before."""
    madvise = _libc_madvise()
    address = buffer.data_ptr()  # the tensor is held till the end: never advise freed memory
    end = address + size
    # From the page holding the first byte: advising a page shared with other memory leaves its
    # bytes as they are, as it does this buffer's.
    for a in range(address & ~4095, end, part):
        if madvise(a, min(part, end - a), _MADV_POPULATE_WRITE) != 0:
            return


def ranged_read(fs: Any, bucket: str, obj: str, size: int, *, hash: bool, part: int, in_flight: int) -> BufferRead:
    """Read object ``obj`` (``size`` bytes, ``size`` > 0) into a new uint8 tensor; returns once
    the last byte is in it, its hash possibly still finishing (:class:`~txckpt._base.fileio.BufferRead`)."""
    buf = new_buffer(size)
    if PREFAULT and _libc_madvise() is not None:
        threading.Thread(target=_prefault, args=(buf, size, part), name="txckpt-prefault", daemon=True).start()
    view = memoryview(buf.numpy())
    hasher = new_hasher() if hash else None
    worker = HashWorker(hasher) if hasher is not None else None
    parts = [(a, min(a + part, size)) for a in range(0, size, part)]
    landed = [False] * len(parts)
    next_part = 0  # the first part not handed to the hash yet

    async def get(i: int) -> None:
        nonlocal next_part
        a, b = parts[i]
        await _get_part(fs, bucket, obj, size, a, view[a:b])
        landed[i] = True
        while next_part < len(parts) and landed[next_part]:
            lo, hi = parts[next_part]
            if worker is not None:
                worker.put(view[lo:hi])
            next_part += 1

    try:
        run_on_loop(fs, _get_all(len(parts), get, in_flight))
    except BaseException:
        if worker is not None:
            worker.finish(check=False)  # stop the thread before the buffer it reads goes away
        raise
    return BufferRead(buf, hasher, worker)


def ranged_copy(
    fs: Any, bucket: str, obj: str, size: int, write: Callable[[memoryview], Any], *, part: int, in_flight: int
) -> tuple[int, str]:
    """Copy object ``obj`` (``size`` bytes, ``size`` > 0) to ``write``, which is given its bytes
    in order (a file being written: a fetch), hashing them; returns ``(size, xxh3-128)``.

    Parts download as for :func:`ranged_read`, each into a buffer of its own; one thread hands
    the parts, in order, to the hash and to ``write`` (both release the GIL: the copy goes on
    beside the downloads). A part starts only once the part ``window`` places before it has
    been written, so at most ``window`` parts are held at once (``in_flight`` + 4: 192 MiB at
    the defaults) whatever the object's size and however the parts arrive."""
    hasher = new_hasher()
    parts = [(a, min(a + part, size)) for a in range(0, size, part)]
    window = in_flight + 4
    landed: dict[int, memoryview] = {}
    ready: "queue.SimpleQueue[memoryview | None]" = queue.SimpleQueue()
    next_part = 0  # the first part not handed to the writer yet
    written = 0  # parts written; read by the loop, set by the writer thread through the loop
    failed: list[BaseException] = []
    loop = fs.loop
    room = asyncio.Event()  # created here, used on fs's loop only

    def writer() -> None:
        while True:
            chunk = ready.get()
            if chunk is None:
                return
            if failed:
                continue  # drain: the downloads are being cancelled
            try:
                hasher.update(chunk)
                write(chunk)
            except BaseException as e:  # raised in the caller's thread once the downloads stop
                failed.append(e)
            loop.call_soon_threadsafe(_one_more)

    def _one_more() -> None:
        nonlocal written
        written += 1
        room.set()

    async def may_start(i: int) -> None:
        while i >= written + window:
            if failed:
                raise failed[0]
            room.clear()
            await room.wait()

    async def get(i: int) -> None:
        nonlocal next_part
        if failed:
            raise failed[0]
        a, b = parts[i]
        into = memoryview(bytearray(b - a))
        await _get_part(fs, bucket, obj, size, a, into)
        landed[i] = into
        while next_part in landed:
            ready.put(landed.pop(next_part))
            next_part += 1

    thread = threading.Thread(target=writer, name="txckpt-ranged-copy", daemon=True)
    thread.start()
    try:
        run_on_loop(fs, _get_all(len(parts), get, in_flight, may_start))
    finally:
        ready.put(None)
        thread.join()
    if failed:
        raise failed[0]
    return size, hasher.hexdigest()


#: Threads writing a fetch's parts at their offsets (``os.pwrite`` releases the GIL: the page
#: cache copy of one part runs beside the downloads and the other parts' copies).
FILE_WRITERS = 4
#: How a fetch to a local file writes and hashes it: "loop" (the default, _to_file_on_loop: the
#: download loop writes every chunk and hashes the file behind the writes, nothing handed to a
#: thread), or parts written from threads out of a window of buffers and hashed by
#: "follow" (a thread re-reads the file, still in the
#: page cache, in order behind the parts written so far: a part's buffer is free once written);
#: "inline" (the same thread hashes the part buffers in order, a buffer held until hashed as
#: well: one part that lands late holds up the whole window); "after" (the file is re-read once
#: the last part is written). benchmarks/s3load.py measures "loop" against "after" (docs/remote.md).
HASH_MODE = os.environ.get("TXCKPT_S3_FETCH_HASH", "loop")
_pwrite = os.pwrite  # one name, so the tests can see which part is written when
_HASH_BLOCK = 8 << 20  # the block the "after" hash re-reads the file in


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while len(data):  # pwrite may write less than asked (a signal, a full pipe of a FUSE disk)
        n = _pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _FileRange:
    """Bytes ``offset`` .. ``offset + length`` of the file at ``fd``, written like a buffer:
    ``r[a:b] = chunk`` is a ``pwrite`` at ``offset + a`` (``_get_part`` writes each chunk as it
    comes off the connection straight into the page cache: no part buffer, no second copy)."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.offset, self.length = fd, offset, length

    def __len__(self) -> int:
        return self.length

    def __setitem__(self, where: slice, chunk: bytes) -> None:
        _write_at(self.fd, memoryview(chunk), self.offset + where.start)


def _hash_file(fd: int, size: int, hasher: Any, pos: int = 0, view: memoryview | None = None) -> None:
    """Hash bytes ``pos`` .. ``size`` of the file at ``fd``, read back in blocks (into ``view``)."""
    if view is None:
        view = memoryview(bytearray(min(size - pos, _HASH_BLOCK)))
    while pos < size:
        n = os.preadv(fd, [view[: min(len(view), size - pos)]], pos)
        if n <= 0:
            raise SizeMismatch(pos)  # the file is shorter than written: truncated meanwhile
        hasher.update(view[:n])
        pos += n


def ranged_to_file(
    fs: Any,
    bucket: str,
    obj: str,
    size: int,
    fd: int,
    *,
    part: int,
    in_flight: int,
    progress: Callable[[int], Any] | None = None,
    hash_mode: str | None = None,
    writers: int | None = None,
) -> tuple[int, str]:
    """Copy object ``obj`` (``size`` bytes, ``size`` > 0) into the local file open for writing
    at ``fd`` (written at offsets 0 .. ``size``), hashing it; returns ``(size, xxh3-128)``.

    Parts download as for :func:`ranged_read`, each into a buffer of the window; as each lands
    it is written at its offset by one of ``writers`` threads, whatever the order they land
    in. A part starts only once a buffer of the window is free (``in_flight`` + 4 buffers, 192
    MiB at the defaults, reused part after part), so the bytes held are bounded whatever the
    object's size and however the parts arrive. The hash (``hash_mode``, default
    :data:`HASH_MODE`) runs on a thread of its own: "follow" re-reads the file in order behind
    the parts written so far, "inline" hashes the part buffers in order (a buffer is freed
    once written and hashed), "after" re-reads the file once the last part is written.
    ``progress`` is called (on the download
    loop) with each part's size once it is written. Returns only after every write has ended:
    nothing writes to ``fd`` after this returns or raises. The caller compares the digest
    with the manifest before it publishes the file."""
    mode = hash_mode or HASH_MODE
    if mode == "loop":
        return _to_file_on_loop(fs, bucket, obj, size, fd, part=part, in_flight=in_flight, progress=progress)
    inline, follow = mode == "inline", mode == "follow"
    hasher = new_hasher()
    parts = [(a, min(a + part, size)) for a in range(0, size, part)]
    window = min(len(parts), in_flight + 4)
    pool = ThreadPoolExecutor(max(1, writers or FILE_WRITERS), thread_name_prefix="txckpt-pwrite")
    loop = fs.loop
    free: list[memoryview] = []  # part buffers of the window not in use, reused
    owed: dict[int, int] = {}  # part -> how many of (written, hashed) it still waits for
    landed: dict[int, tuple[memoryview, memoryview]] = {}  # landed, not yet hashed (out of order)
    next_hash = 0
    to_hash: "queue.SimpleQueue[tuple[int, memoryview, memoryview] | None]" = queue.SimpleQueue()
    written: set[int] = set()  # "follow": parts written beyond the contiguous prefix
    prefix = [0]  # "follow": parts 0 .. prefix[0] - 1 are all written
    frontier: "queue.SimpleQueue[int | None]" = queue.SimpleQueue()  # "follow": bytes written in order
    failed: list[BaseException] = []
    sems: dict[str, Any] = {}  # made on the loop (run_all)

    def done(i: int, buffer: memoryview) -> None:  # on the loop: part i's step finished
        owed[i] -= 1
        if owed[i] == 0:
            del owed[i]
            free.append(buffer)
            sems["room"].release()

    def hash_in_order() -> None:  # a thread: xxhash releases the GIL for large buffers
        while (item := to_hash.get()) is not None:
            i, data, buffer = item
            if not failed:
                try:
                    hasher.update(data)
                except BaseException as e:  # raised in the caller's thread at the end
                    failed.append(e)
            loop.call_soon_threadsafe(done, i, buffer)

    def follow_file() -> None:  # a thread: preadv and xxhash release the GIL
        pos = 0
        while (end := frontier.get()) is not None:
            if not failed:
                try:
                    _hash_file(fd, end, hasher, pos)
                    pos = end
                except BaseException as e:  # raised in the caller's thread at the end
                    failed.append(e)

    async def one(i: int) -> None:
        nonlocal next_hash
        a, b = parts[i]
        buffer = free.pop() if free else memoryview(bytearray(part))
        data = buffer[: b - a]
        try:
            try:
                await _get_part(fs, bucket, obj, size, a, data)
            finally:
                sems["gate"].release()
        except BaseException:
            free.append(buffer)
            sems["room"].release()
            raise
        if i == 0:
            sems["first"].set_result(None)
        owed[i] = 2 if inline else 1
        if inline:
            landed[i] = (data, buffer)
            while next_hash in landed:
                to_hash.put((next_hash, *landed.pop(next_hash)))
                next_hash += 1
        await loop.run_in_executor(pool, _write_at, fd, data, a)
        if progress is not None:
            progress(b - a)
        if follow:
            written.add(i)
            while prefix[0] in written:
                written.discard(prefix[0])
                prefix[0] += 1
            if prefix[0] > i:  # this part extended the prefix: the thread may hash up to its end
                frontier.put(parts[prefix[0] - 1][1])
        done(i, buffer)

    async def run_all() -> None:
        sems["room"], sems["gate"] = asyncio.Semaphore(window), asyncio.Semaphore(max(1, in_flight))
        sems["first"] = first = loop.create_future()  # part 0 has landed
        tasks: list[asyncio.Future] = []
        try:
            for i in range(len(parts)):
                await sems["room"].acquire()  # a free buffer: the bound on bytes held
                await sems["gate"].acquire()  # a free connection slot
                tasks.append(asyncio.ensure_future(one(i)))
                if i == 0:  # alone until it lands: its Content-Range says whether the size is right
                    await asyncio.wait([first, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
                if failed or any(t.done() and not t.cancelled() and t.exception() for t in tasks[-in_flight:]):
                    break
            await asyncio.gather(*tasks)
        except BaseException:
            await _cancel_all(tasks)
            raise
        if failed:
            raise failed[0]

    target = hash_in_order if inline else follow_file if follow else None
    thread = threading.Thread(target=target, name="txckpt-fetch-hash", daemon=True) if target else None
    if thread is not None:
        thread.start()
    try:
        run_on_loop(fs, run_all())
    finally:
        pool.shutdown(wait=True)  # no write lands after the caller closes or deletes the file
        if thread is not None:
            (to_hash if inline else frontier).put(None)
            thread.join()
    if failed:
        raise failed[0]
    if mode == "after":
        _hash_file(fd, size, hasher)
    return size, hasher.hexdigest()


def _to_file_on_loop(
    fs: Any,
    bucket: str,
    obj: str,
    size: int,
    fd: int,
    *,
    part: int,
    in_flight: int,
    progress: Callable[[int], Any] | None,
) -> tuple[int, str]:
    """:func:`ranged_to_file` ("loop", the default): every chunk of every part is written at its
    offset by the download loop itself as it comes off the connection (no part buffers: the
    bytes held are what the ``in_flight`` connections have buffered), and each time the parts
    written so far grow a longer prefix of the file, the loop hashes that stretch back from the
    page cache. Nothing is handed between threads: on a machine whose cores are all busy every
    such hand-over waited for the other thread to be scheduled (the GIL is handed over, not
    just released), and the threaded modes took 1.4-3.7x the time of this one's one-stream
    predecessor (docs/remote.md)."""
    hasher = new_hasher()
    parts = [(a, min(a + part, size)) for a in range(0, size, part)]
    block = memoryview(bytearray(min(size, _HASH_BLOCK)))  # one re-read buffer, reused
    written: set[int] = set()
    state = {"prefix": 0, "hashed": 0}  # parts 0 .. prefix - 1 all written; bytes hashed

    async def get(i: int) -> None:
        a, b = parts[i]
        await _get_part(fs, bucket, obj, size, a, _FileRange(fd, a, b - a))
        if progress is not None:
            progress(b - a)
        written.add(i)
        while state["prefix"] in written:
            written.discard(state["prefix"])
            state["prefix"] += 1
        end = parts[state["prefix"] - 1][1] if state["prefix"] else 0
        if end > state["hashed"]:
            _hash_file(fd, end, hasher, state["hashed"], block)
            state["hashed"] = end

    run_on_loop(fs, _get_all(len(parts), get, in_flight))
    if state["hashed"] != size:  # cannot happen: every part was written, so the prefix is whole
        raise SizeMismatch(state["hashed"])
    return size, hasher.hexdigest()


__all__ = ["RangeIgnored", "ranged_copy", "ranged_read", "ranged_to_file", "whole_object"]
