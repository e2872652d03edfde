"""Verified S3 reads at the network's pace: one object read by parallel ranged GETs straight into
the buffer its tensors will view, hashed in order as the parts land (``S3Storage.start_read``).

The object is split into parts of ``part`` bytes; at most ``in_flight`` ranged GETs run at once
on s3fs's event loop, each part copied into its place in the buffer as its body arrives. A hash
thread (``fileio.HashWorker``: xxhash releases the GIL) is handed each part once it and every
part before it have landed, so the hash runs beside the downloads and at most the last parts
are left to hash when the last byte lands. The first response's ``Content-Range`` says the
object's size: an object that is not ``size`` bytes is :class:`~txckpt.fileio.SizeMismatch`
before the rest is read. Nothing here decides that the bytes are good: the caller compares the
digest with the manifest before it hands out anything decoded from the buffer (txckpt.verify).

``ranged_copy`` downloads the same way into a bounded window of part buffers and hands the
parts, in order, to a writer (``S3Storage.read_through``: a fetch to local disk), hashing them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Awaitable, Callable

from ..checksum import new_hasher
from ..fileio import BufferRead, SizeMismatch, HashWorker, new_buffer
from .s3_upload import _run


def _total_of(response: dict[str, Any]) -> int | None:
    """The object's size from a ranged GET's ``Content-Range: bytes a-b/TOTAL``."""
    text = response.get("ContentRange") or ""
    _, _, total = text.rpartition("/")
    return int(total) if total.isdigit() else None


async def _get_part(fs: Any, bucket: str, obj: str, size: int, a: int, into: memoryview) -> None:
    """One ranged GET of bytes ``a`` .. ``a + len(into)`` of ``obj`` (``size`` bytes) into ``into``."""
    b = a + len(into)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=obj, Range=f"bytes={a}-{b - 1}")
    try:
        total = _total_of(resp)
        if total is not None and total != size:
            raise SizeMismatch(total)
        # Each chunk as it comes off the connection, copied once into its place: read() would
        # join the chunks into one bytes object first (a second copy of the part).
        body, pos = resp["Body"], 0
        while pos < len(into):
            chunk = await body.read(len(into) - pos)
            if not chunk:  # shorter than the range: the object changed size meanwhile
                raise SizeMismatch(a + pos)
            into[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
    finally:
        resp["Body"].close()


async def _get_all(count: int, get: Callable[[int], Awaitable[None]], in_flight: int,
                   may_start: Callable[[int], Awaitable[None]] | None = None) -> None:
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
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def ranged_read(fs: Any, bucket: str, obj: str, size: int, *, hash: bool, part: int, in_flight: int) -> BufferRead:
    """Read object ``obj`` (``size`` bytes, ``size`` > 0) into a new uint8 tensor; returns once
    the last byte is in it, its hash possibly still finishing (:class:`~txckpt.fileio.BufferRead`)."""
    buf = new_buffer(size)
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
        _run(fs, _get_all(len(parts), get, in_flight))
    except BaseException:
        if worker is not None:
            worker.finish(check=False)  # stop the thread before the buffer it reads goes away
        raise
    return BufferRead(buf, hasher, worker)


def ranged_copy(fs: Any, bucket: str, obj: str, size: int, write: Callable[[memoryview], Any], *,
                part: int, in_flight: int) -> tuple[int, str]:
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
        _run(fs, _get_all(len(parts), get, in_flight, may_start))
    finally:
        ready.put(None)
        thread.join()
    if failed:
        raise failed[0]
    return size, hasher.hexdigest()


__all__ = ["ranged_copy", "ranged_read"]
