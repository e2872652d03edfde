"""Streaming xxh3-128 checksums.

xxh3-128 hashes at tens of GB/s on one core, so hashing while writing costs nothing next to the
disk. The algorithm name is recorded in every manifest so that a later format can change it.
"""

from __future__ import annotations

import io
import os
from typing import Any, BinaryIO, Callable

import xxhash

ALGORITHM = "xxh3-128"
_READ_CHUNK = 8 << 20


# The one algorithm's two entry points, bound to xxhash's own C functions rather than wrapped:
# the hashers of a save (the file's, the tensor index's chunks and tensors) call them per piece.
#: A new streaming xxh3-128 hasher (``update``, ``hexdigest``).
new_hasher = xxhash.xxh3_128
#: The xxh3-128 hex digest of a buffer.
digest_bytes = xxhash.xxh3_128_hexdigest


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's): how many
    hashing threads can run at once (xxh3 releases the GIL)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def digest_stream(stream: BinaryIO, chunk: int = _READ_CHUNK) -> tuple[int, str]:
    """Hash a readable stream to its end; returns (size, hex digest)."""
    return copy_hashing(stream, None, chunk=chunk)


def copy_hashing(
    src: BinaryIO,
    sink: Any = None,
    *,
    chunk: int | Callable[[], int] = _READ_CHUNK,
    piece: int | None = None,
    tap: Callable[[memoryview], Any] | None = None,
) -> tuple[int, str]:
    """The one hash-while-copy loop: read ``src`` to its end, hashing every byte and, with a
    ``sink``, writing it there; returns (size, xxh3-128 hex digest). The sink is not closed.

    * Without a sink the stream is read with ``readinto`` into one reused buffer of ``chunk``
      bytes (no allocation per block).
    * With a sink each block is a fresh ``read(chunk)`` (``chunk`` may be a callable giving the
      next block's size, e.g. an S3 writer's next part), so a sink that keeps the ``bytes`` it
      is given (an S3 part) need not copy them. With ``piece`` each block goes to the sink in
      pieces of that many bytes, each hashed right before it is written: the piece is still in
      the CPU cache when the sink copies it (one pass over memory instead of two).
    * ``tap`` is called with every block (or piece) right after it is hashed, in order (a
      tensor index's indexer: the same single read).
    """
    hasher = new_hasher()
    size = 0
    if sink is None:
        n_buf = chunk() if callable(chunk) else chunk
        buf = bytearray(n_buf)
        view = memoryview(buf)
        readinto = getattr(src, "readinto", None)
        while True:
            if readinto is not None:
                n = readinto(buf)
                if not n:
                    break
                hasher.update(view[:n])
                if tap is not None:
                    tap(view[:n])
            else:
                block = src.read(n_buf)
                if not block:
                    break
                n = len(block)
                hasher.update(block)
                if tap is not None:
                    tap(memoryview(block))
            size += n
        return size, hasher.hexdigest()
    while True:
        block = src.read(chunk() if callable(chunk) else chunk)
        if not block:
            break
        if piece is None:
            hasher.update(block)
            if tap is not None:
                tap(memoryview(block))
            sink.write(block)
        else:
            whole = memoryview(block)
            for start in range(0, len(whole), piece):
                part = whole[start : start + piece]
                hasher.update(part)
                if tap is not None:
                    tap(part)
                sink.write(part)
        size += len(block)
    return size, hasher.hexdigest()


class AbortOnError:
    """The ``with`` protocol of a writer that :meth:`txckpt._storage.base.Storage.open_write`
    returns (it sits here, below storage/, because :class:`HashingWriter` is one too).

    Such a writer has ``close()``, which keeps what was written (durably, if asked), and
    ``abort()``, which discards it. A ``with`` block that raises aborts instead of closing, so a
    failed write never leaves a complete-looking file behind. List it before ``io.RawIOBase``
    in a writer's bases: IOBase's own ``__exit__`` would ``close()``.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()  # type: ignore[attr-defined]
        else:
            self.abort()  # type: ignore[attr-defined]


#: How much HashingWriter (and copy_hashing with ``piece``) hashes before writing it on.
PIECE = 1 << 20

#: Where an incremental save records a file's running digest (protocol §3, ``prefixes``): at
#: 1 MiB, doubling up to 64 MiB, then every 64 MiB (a 1 GiB file: 21 digests). Dense at the
#: start, because a changed file usually differs early: the next save tells it from every
#: committed file after hashing the bytes up to the first boundary where they differ.
_FIRST_BOUNDARY, _STRIDE = 1 << 20, 64 << 20


def next_boundary(offset: int) -> int:
    """The first prefix boundary after ``offset`` bytes."""
    if offset < _FIRST_BOUNDARY:
        return _FIRST_BOUNDARY
    if offset < _STRIDE:
        return 1 << offset.bit_length()
    return (offset // _STRIDE + 1) * _STRIDE


def prefix_boundaries(size: int) -> list[int]:
    """Every prefix boundary strictly inside a file of ``size`` bytes."""
    out, b = [], next_boundary(0)
    while b < size:
        out.append(b)
        b = next_boundary(b)
    return out


class ChunkDigests:
    """The xxh3-128 of each ``chunk_size`` chunk of a stream whose bytes are fed in order
    through :meth:`update` (any split); :meth:`finish` gives them (protocol §3b: none for a
    stream of one chunk or less, whose one chunk's digest is the stream's own)."""

    __slots__ = ("chunk_size", "_done", "_hasher", "_left")

    def __init__(self, chunk_size: int, first: str | None = None):
        """``first``: the first chunk's digest, where the caller has it already (a file's own
        running digest taken at ``chunk_size`` bytes); the bytes fed are then the second chunk's on."""
        self.chunk_size = chunk_size
        self._done: list[str] = [] if first is None else [first]
        self._hasher = new_hasher()
        self._left = chunk_size

    def update(self, view: memoryview) -> None:
        n, start = len(view), 0
        while start < n:
            take = min(self._left, n - start)
            self._hasher.update(view[start : start + take])
            start += take
            self._left -= take
            if not self._left:
                self._done.append(self._hasher.hexdigest())
                self._hasher = new_hasher()
                self._left = self.chunk_size

    def finish(self) -> tuple[str, ...]:
        """The digests, once every byte was fed (call once)."""
        if self._left != self.chunk_size:
            self._done.append(self._hasher.hexdigest())
        return tuple(self._done) if len(self._done) > 1 else ()


class HashingWriter(AbortOnError, io.RawIOBase):
    """A write-only stream that hashes and counts every byte on its way to ``sink``.

    ``close()`` closes the sink (which, for txckpt's storage writers, is where durability happens).

    ``sink_error`` is the first OSError the sink raised (a full disk, say), kept because a
    serializer writing through this stream may replace it with its own error (torch.save's zip
    writer raises RuntimeError "unexpected pos" after a failed write).
    """

    def __init__(
        self,
        sink: BinaryIO,
        *,
        prefixes: bool = False,
        chunk_size: int = 0,
        tap: Callable[[memoryview], Any] | None = None,
    ):
        super().__init__()
        self._sink = sink
        self._hasher = new_hasher()
        self.size = 0
        #: The xxh3-128 hex digest of every byte written, set when the writer closes ("" before,
        #: and after an abort).
        self.digest = ""
        #: With ``prefixes=True``: the running digest at each of ``prefix_boundaries(size)``,
        #: complete once the writer closes.
        self.prefixes: list[str] = []
        self._boundary = next_boundary(0) if prefixes else None
        self.sink_error: OSError | None = None
        #: A second hasher a subclass may set for the span of one write: it gets each piece
        #: while the piece is in the CPU cache (a second digest of those bytes at almost no cost
        #: in memory traffic).
        self._also: Any = None
        #: With ``chunk_size``: the digest of each chunk (protocol §3b), complete (:attr:`chunks`)
        #: once the writer closes. The first chunk's is the file's running digest at
        #: ``chunk_size`` bytes, so a file of one chunk (most files) is hashed once, not twice;
        #: the chunker starts there and hashes the rest a second time.
        self._chunk_size = chunk_size
        self._chunker: ChunkDigests | None = None
        self.chunks: tuple[str, ...] = ()
        #: Called with each piece right after it is hashed, in order (a tensor index's
        #: indexer: it hashes tensors while the piece is in the CPU cache).
        self._tap = tap

    def _failed(self, e: OSError) -> None:
        if self.sink_error is None:
            self.sink_error = e

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        n, start = len(view), 0
        # Hash and write piece by piece, so each piece goes to the sink while it is still in the
        # CPU cache the hash just pulled it into (one pass over memory instead of two for the
        # large writes serializers make). Recording prefixes, a piece also ends at each prefix
        # boundary, so the running digest is taken exactly there.
        while start < n:
            end = min(start + PIECE, n)
            if self._boundary is not None:
                end = min(end, start + self._boundary - self.size)
            chunker = self._chunker
            if chunker is None and self.size < self._chunk_size:  # a piece ends at the first chunk's end
                end = min(end, start + self._chunk_size - self.size)
            piece = view[start:end]
            self._hasher.update(piece)
            if self._also is not None:
                self._also.update(piece)
            if chunker is not None:
                chunker.update(piece)
            if self._tap is not None:
                self._tap(piece)
            try:
                self._sink.write(piece)
            except OSError as e:
                self._failed(e)
                raise
            self.size += end - start
            start = end
            if chunker is None and self.size == self._chunk_size:
                self._chunker = ChunkDigests(self._chunk_size, first=self._hasher.hexdigest())
            if self.size == self._boundary:
                self.prefixes.append(self._hasher.hexdigest())
                self._boundary = next_boundary(self.size)
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
            self.digest = self._hasher.hexdigest()
            if self._chunker is not None:
                self.chunks = self._chunker.finish()
            # A file that ends on a boundary: that digest is the file's own, not a prefix.
            del self.prefixes[len(prefix_boundaries(self.size)) :]
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
