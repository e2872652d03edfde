"""The tensor index of one file (protocol §3b): its chunk digests and, for a safetensors file,
each tensor's dtype, shape, byte range and digest, built while the file's bytes are hashed.

:class:`Indexer` is fed every byte of a file once, in order, by whatever hashes it (the hashing
writer of ``tx.open``/``tx.save``, the commit's pass over files other code wrote): it reads the
safetensors header from the bytes going by (never a second read of the file) and hashes each
chunk and each tensor while the bytes are in the CPU cache. :class:`FileIndex` is what the
manifest records, and its JSON form (never pickled).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from .._base.checksum import ChunkDigests, digest_bytes, new_hasher
from ..errors import ManifestError

#: The size of a chunk: every file's bytes are digested in chunks of this many bytes (the last
#: one shorter), the part size of a ranged read of an object store.
CHUNK_SIZE = 16 << 20

#: The largest safetensors header the indexer reads (safetensors' own limit is 100 MB); a file
#: whose header claims more gets chunk digests but no tensor index.
MAX_HEADER = 100_000_000


#: ``encoding`` of a DCP item (protocol §3b): its bytes are one ``torch.save`` stream of the
#: tensor (a zip archive), not the tensor's raw data.
TORCH_SAVE_ENCODING = "torch_save"

#: A tensor's *head*: the digest of its first this many bytes (protocol §3b, ``head``), taken
#: from its running digest on the way (no second pass). An incremental save tells a changed
#: tensor by it without hashing the rest (protocol §3c): a full fine-tune's tensors then cost a
#: 64 KiB hash each, not a pass over every byte.
HEAD_BYTES = 64 << 10
#: Tensors longer than this record a head; hashing a shorter one whole costs little more.
HEAD_FROM = 1 << 20


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a file: ``name``, safetensors ``dtype`` string (``"F32"``, ``"BF16"``,
    ...), ``shape``, the byte ``offset`` of its bytes from the start of the file, their
    ``length``, and the xxh3-128 ``checksum`` of those bytes.

    ``encoding``: None for a safetensors tensor (the bytes are its raw data);
    :data:`TORCH_SAVE_ENCODING` for a DCP item (the bytes are a ``torch.save`` stream of it).
    A DCP item also records its ``fqn`` (DCP's name of the whole tensor) and, for one chunk of
    a sharded tensor, ``chunk_offsets`` (where the chunk, of shape ``shape``, starts in it).

    ``head``: (n, the xxh3-128 of the first n bytes), for a safetensors tensor longer than
    :data:`HEAD_FROM` written by a txckpt that records it; None otherwise."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    checksum: str
    encoding: str | None = None
    fqn: str | None = None
    chunk_offsets: tuple[int, ...] | None = None
    head: tuple[int, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "length": self.length,
            "xxh3_128": self.checksum,
        }
        if self.encoding is not None:
            out["encoding"] = self.encoding
        if self.fqn is not None:
            out["fqn"] = self.fqn
        if self.chunk_offsets is not None:
            out["chunk_offsets"] = list(self.chunk_offsets)
        if self.head is not None:
            out["head"] = {"length": self.head[0], "xxh3_128": self.head[1]}
        return out

    @classmethod
    def from_json(cls, name: str, t: Any) -> "TensorRecord":
        """The record of tensor ``name`` from its JSON; KeyError, TypeError or ValueError where
        malformed. Keys a record written before ``encoding`` lacks read as a safetensors one's."""
        offsets = t.get("chunk_offsets")
        head = t.get("head")
        return cls(
            str(name),
            str(t["dtype"]),
            tuple(int(x) for x in t["shape"]),
            int(t["offset"]),
            int(t["length"]),
            str(t["xxh3_128"]),
            None if t.get("encoding") is None else str(t["encoding"]),
            None if t.get("fqn") is None else str(t["fqn"]),
            None if offsets is None else tuple(int(x) for x in offsets),
            None if head is None else (int(head["length"]), str(head["xxh3_128"])),
        )


@dataclass(frozen=True)
class FileIndex:
    """What a manifest records of one file besides its size and digest (protocol §3b): the
    xxh3-128 of each ``chunk_size`` chunk (``chunks``; empty for a file of one chunk or none,
    whose one chunk's digest is the file's own) and, for a safetensors file whose header
    parsed, its tensors (``tensors``, in file order; None for any other file)."""

    chunk_size: int
    chunks: tuple[str, ...]
    tensors: tuple[TensorRecord, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chunk_size": self.chunk_size, "chunks": list(self.chunks)}
        if self.tensors is not None:
            out["tensors"] = {t.name: t.to_json() for t in self.tensors}
        return out

    def chunk_digests(self, size: int, file_digest: str) -> list[str]:
        """The digest of every chunk of the file (``size`` bytes, digest ``file_digest``), in order."""
        if self.chunks:
            return list(self.chunks)
        return [file_digest] if size else []

    def chunk_range(self, i: int, size: int) -> tuple[int, int]:
        """(offset, length) of chunk ``i`` of a file of ``size`` bytes."""
        start = i * self.chunk_size
        return start, min(self.chunk_size, size - start)

    @classmethod
    def from_json(cls, name: str, d: Any, size: int) -> "FileIndex":
        """The index of file ``name`` (``size`` bytes) from its manifest entry's ``index``,
        checked: one digest per chunk, every tensor inside the file. ManifestError otherwise."""
        try:
            chunk_size = int(d["chunk_size"])
            chunks = tuple(str(c) for c in d["chunks"])
            raw = d.get("tensors")
            tensors = None
            if raw is not None:
                tensors = tuple(
                    sorted(
                        (TensorRecord.from_json(t_name, t) for t_name, t in raw.items()),
                        key=lambda t: (t.offset, t.length, t.name),  # file order, as the indexer lists them
                    )
                )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(
                f"the tensor index of {name!r} is malformed ({e!r}); the checkpoint is damaged"
            ) from None
        count = -(-size // chunk_size) if chunk_size > 0 else -1
        if chunk_size <= 0 or (chunks and len(chunks) != count) or (not chunks and count > 1):
            raise ManifestError(
                f"the tensor index of {name!r} has {len(chunks)} chunk digests of {chunk_size} bytes for a "
                f"file of {size} bytes; the checkpoint is damaged"
            )
        for t in tensors or ():
            if t.offset < 0 or t.length < 0 or t.offset + t.length > size or any(x < 0 for x in t.shape):
                raise ManifestError(
                    f"the tensor index of {name!r} places tensor {t.name!r} at bytes "
                    f"{t.offset}..{t.offset + t.length} of a file of {size}; the checkpoint is damaged"
                )
            if t.head is not None and not 0 < t.head[0] < t.length:
                raise ManifestError(
                    f"the tensor index of {name!r} gives tensor {t.name!r} ({t.length} bytes) a head of "
                    f"{t.head[0]} bytes; the checkpoint is damaged"
                )
        return cls(chunk_size, chunks, tensors)


#: The ending (of a lower-cased name) of the files whose header the indexer reads.
SAFETENSORS_SUFFIX = ".safetensors"


def is_safetensors_name(name: str) -> bool:
    """Whether the indexer reads ``name``'s header: a ``.safetensors`` file, by name (the rule
    ``tx.save`` writes by)."""
    return name.lower().endswith(SAFETENSORS_SUFFIX)


class Indexer:
    """Builds the :class:`FileIndex` of the file ``name`` from its bytes, fed once and in order
    through :meth:`update` (a memoryview or bytes; any split); :meth:`finish` gives the index.
    With ``chunks=False`` it leaves the chunk digests to a writer that takes them as it hashes
    the file (:class:`~txckpt._base.checksum.HashingWriter`) and is given them at :meth:`finish`.
    For a ``.safetensors`` name it reads the header from the first bytes and digests each tensor's bytes;
    a header that does not parse (a file that is not safetensors after all) leaves the index
    without tensors, never fails the save."""

    __slots__ = (
        "chunk_size",
        "_chunks",
        "_pos",
        "_head",
        "_need",
        "_spans",
        "_ti",
        "_th",
        "_done",
        "_heads",
        "_bad",
    )

    def __init__(
        self,
        name: str,
        *,
        chunk_size: int = CHUNK_SIZE,
        chunks: bool = True,
        ranges: Iterable[TensorRecord] | None = None,
    ):
        """``chunks=False``: leave the chunk digests to the writer that hashes the file (given
        at :meth:`finish`). ``ranges``: digest these records' byte ranges instead of reading a
        safetensors header (a DCP file's items, whose places only the save knew: checking such
        a file again, txckpt._manifest.verify)."""
        safetensors = is_safetensors_name(name) and ranges is None
        self.chunk_size = chunk_size
        self._chunks = ChunkDigests(chunk_size) if chunks else None
        self._pos = 0
        #: The header's bytes so far (None once parsed, or when not reading one).
        self._head: bytearray | None = bytearray() if safetensors else None
        self._need = 8  # bytes of header wanted before the next parse step
        #: (start, end, name, dtype, shape) of each tensor, in file order, once the header parsed.
        self._spans: list[tuple[int, int, str, str, tuple[int, ...]]] = []
        self._ti = 0  # the first tensor not finished
        self._th: Any = None  # the hasher of tensor self._ti, once its bytes began
        self._done: list[str] = []  # digest of each finished tensor
        self._heads: dict[int, str] = {}  # tensor number -> its head's digest (HEAD_BYTES)
        self._bad = not safetensors
        if ranges is not None:
            spans = sorted((r.offset, r.offset + r.length, r.name, r.dtype, r.shape) for r in ranges)
            if not any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                self._spans, self._bad = spans, False

    def update(self, data: Any) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        n = len(view)
        if not n:
            return
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")
        pos = self._pos
        if self._chunks is not None:
            self._chunks.update(view)
        # the header, then the tensors
        if self._head is not None:
            self._read_header(view, pos)
        if self._spans and self._ti < len(self._spans):
            self._hash_tensors(view, pos, pos + n)
        self._pos = pos + n

    def _read_header(self, view: memoryview, pos: int) -> None:
        head = self._head
        assert head is not None
        end = pos + len(view)
        if end > len(head) and pos <= len(head):
            head += view[len(head) - pos : min(len(view), self._need - pos)]
        if len(head) < self._need:
            return
        if self._need == 8:
            (hlen,) = struct.unpack("<Q", bytes(head[:8]))
            if hlen > MAX_HEADER:
                self._give_up()
                return
            self._need = 8 + hlen
            if end > len(head):
                head += view[len(head) - pos : min(len(view), self._need - pos)]
            if len(head) < self._need:
                return
        self._parse(bytes(head[8 : self._need]))

    def _give_up(self) -> None:
        self._head, self._spans, self._bad = None, [], True

    def _parse(self, raw: bytes) -> None:
        base = 8 + len(raw)
        self._head = None
        try:
            header = json.loads(raw)
            spans = []
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, stop = (int(x) for x in info["data_offsets"])
                shape = tuple(int(x) for x in info["shape"])
                if not (0 <= begin <= stop) or any(x < 0 for x in shape) or not isinstance(info["dtype"], str):
                    raise ValueError(name)
                spans.append((base + begin, base + stop, str(name), info["dtype"], shape))
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            self._give_up()
            return
        spans.sort(key=lambda s: (s[0], s[1], s[2]))
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):  # overlapping tensors: not indexed
            self._give_up()
            return
        self._spans = spans

    def _hash_tensors(self, view: memoryview, pos: int, end: int) -> None:
        spans = self._spans
        while self._ti < len(spans):
            begin, stop = spans[self._ti][:2]
            if begin >= end and begin != stop:
                return
            if begin == stop:
                if begin > end:
                    return
                self._done.append(digest_bytes(b""))
                self._ti += 1
                continue
            lo, hi = max(begin, pos), min(stop, end)
            if lo < hi:
                if self._th is None:
                    self._th = new_hasher()
                mark = begin + HEAD_BYTES
                if stop - begin > HEAD_FROM and lo < mark <= hi:  # the head ends in this piece
                    self._th.update(view[lo - pos : mark - pos])
                    self._heads[self._ti] = self._th.hexdigest()  # a running digest: the stream goes on
                    lo = mark
                self._th.update(view[lo - pos : hi - pos])
            if stop > end:
                return
            self._done.append(self._th.hexdigest() if self._th is not None else digest_bytes(b""))
            self._th = None
            self._ti += 1

    def finish(self, size: int, chunks: tuple[str, ...] = ()) -> FileIndex:
        """The index of the file, which ended after ``size`` bytes (all fed). ``chunks``: its
        chunk digests, from the caller, for an indexer made with ``chunks=False``."""
        if size != self._pos:
            raise ValueError(f"the indexer was fed {self._pos} bytes of a file of {size}")
        if self._chunks is not None:
            chunks = self._chunks.finish()
        tensors = None
        if not self._bad and self._head is None and len(self._done) == len(self._spans):
            heads = self._heads
            tensors = tuple(
                TensorRecord(
                    name, dtype, shape, begin, stop - begin, digest, head=(HEAD_BYTES, heads[i]) if i in heads else None
                )
                for i, ((begin, stop, name, dtype, shape), digest) in enumerate(zip(self._spans, self._done))
            )
        return FileIndex(self.chunk_size, chunks, tensors)


def index_bytes(name: str, data: bytes | memoryview) -> FileIndex:
    """The index of a file of ``data`` named ``name``, in one call (tests, small files)."""
    ix = Indexer(name)
    ix.update(data)
    return ix.finish(len(data))


def index_pieces(name: str, pieces: Iterable[bytes]) -> FileIndex:
    """The index of a file whose bytes are ``pieces``, in order."""
    ix = Indexer(name)
    size = 0
    for p in pieces:
        ix.update(p)
        size += len(p)
    return ix.finish(size)


__all__ = [
    "CHUNK_SIZE",
    "FileIndex",
    "HEAD_BYTES",
    "Indexer",
    "SAFETENSORS_SUFFIX",
    "TORCH_SAVE_ENCODING",
    "TensorRecord",
    "index_bytes",
    "is_safetensors_name",
]
