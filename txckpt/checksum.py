"""Streaming xxh3-128 checksums.

xxh3-128 hashes at tens of GB/s on one core, so hashing while writing costs nothing next to the
disk. The algorithm name is recorded in every manifest so that a later format can change it.
"""

from __future__ import annotations

import io
from typing import BinaryIO

import xxhash

from .storage.base import AbortOnError

ALGORITHM = "xxh3-128"
_READ_CHUNK = 8 << 20


def new_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def digest_stream(stream: BinaryIO, chunk: int = _READ_CHUNK) -> tuple[int, str]:
    """Hash a readable stream to its end; returns (size, hex digest)."""
    hasher = new_hasher()
    size = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    readinto = getattr(stream, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
        else:
            block = stream.read(chunk)
            if not block:
                break
            n = len(block)
            hasher.update(block)
        size += n
    return size, hasher.hexdigest()


#: How much HashingWriter hashes before writing it on (see HashingWriter.write).
_PIECE = 1 << 20


class HashingWriter(AbortOnError, io.RawIOBase):
    """A write-only stream that hashes and counts every byte on its way to ``sink``.

    ``close()`` closes the sink (which, for txckpt's storage writers, is where durability happens).

    ``sink_error`` is the first OSError the sink raised (a full disk, say), kept because a
    serializer writing through this stream may replace it with its own error (torch.save's zip
    writer raises RuntimeError "unexpected pos" after a failed write).
    """

    def __init__(self, sink: BinaryIO):
        super().__init__()
        self._sink = sink
        self._hasher = new_hasher()
        self.size = 0
        self.sink_error: OSError | None = None

    def _failed(self, e: OSError) -> None:
        if self.sink_error is None:
            self.sink_error = e

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        n = len(view)
        # Hash and write piece by piece, so each piece goes to the sink while it is still in the
        # CPU cache the hash just pulled it into (one pass over memory instead of two for the
        # large writes serializers make).
        for start in range(0, n, _PIECE):
            piece = view[start:start + _PIECE]
            self._hasher.update(piece)
            try:
                self._sink.write(piece)
            except OSError as e:
                self._failed(e)
                raise
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        if not getattr(self._sink, "closed", False):
            try:
                self._sink.flush()
            except OSError as e:
                self._failed(e)
                raise

    def close(self) -> None:
        if not self.closed:
            try:
                self._sink.close()
            except OSError as e:
                self._failed(e)
                raise
            finally:
                super().close()

    def abort(self) -> None:
        """Close without completing: storage writers discard what they can."""
        abort = getattr(self._sink, "abort", None)
        if abort is not None:
            abort()
        elif not self._sink.closed:
            self._sink.close()
        super().close()

    def __del__(self) -> None:
        # io.IOBase.__del__ would close() a writer that was dropped unfinished, which completes
        # a half-written upload; a dropped writer is abandoned instead.
        if not self.closed:
            try:
                self.abort()
            except Exception:
                pass

    @property
    def digest(self) -> str:
        return self._hasher.hexdigest()
