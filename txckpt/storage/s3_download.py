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
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..checksum import new_hasher
from ..fileio import BufferRead, SizeMismatch, HashWorker, new_buffer
from .s3_upload import _run


def _total_of(response: dict[str, Any]) -> int | None:
    """The object's size from a ranged GET's ``Content-Range: bytes a-b/TOTAL``."""
    text = response.get("ContentRange") or ""
    _, _, total = text.rpartition("/")
    return int(total) if total.isdigit() else None


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

    async def fetch(i: int, gate: asyncio.Semaphore) -> None:
        nonlocal next_part
        a, b = parts[i]
        async with gate:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=obj, Range=f"bytes={a}-{b - 1}")
            try:
                total = _total_of(resp)
                if total is not None and total != size:
                    raise SizeMismatch(total)
                # Each chunk as it comes off the connection, copied once into its place: read()
                # would join the chunks into one bytes object first (a second copy of the part).
                body, pos = resp["Body"], a
                while pos < b:
                    chunk = await body.read(b - pos)
                    if not chunk:  # shorter than the range: the object changed size meanwhile
                        raise SizeMismatch(pos)
                    view[pos:pos + len(chunk)] = chunk
                    pos += len(chunk)
            finally:
                resp["Body"].close()
        landed[i] = True
        while next_part < len(parts) and landed[next_part]:
            lo, hi = parts[next_part]
            if worker is not None:
                worker.put(view[lo:hi])
            next_part += 1

    async def fetch_all() -> None:
        gate = asyncio.Semaphore(max(1, in_flight))
        await fetch(0, gate)  # alone first: its Content-Range says whether the size is right
        tasks = [asyncio.ensure_future(fetch(i, gate)) for i in range(1, len(parts))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # none writes into buf after this
            raise

    try:
        _run(fs, fetch_all())
    except BaseException:
        if worker is not None:
            worker.finish(check=False)  # stop the thread before the buffer it reads goes away
        raise
    return BufferRead(buf, hasher, worker)


__all__ = ["ranged_read"]
