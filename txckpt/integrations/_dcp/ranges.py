"""The byte-range digests of a DCP checkpoint: what lets ``TransactionalReader(verify="ranges")``
check every byte range DCP reads against the digest of the bytes the writer wrote there
(docs/distributed.md, "DCP").

This module owns them from end to end:

* recorded as each rank writes its shards (:class:`RangeHashingWriter`: DCP's item writer calls
  ``tell()`` around every item, so each item's byte range gets its own xxh3-128);
* kept, for a save of W >= 2 ranks (manifest format /2, protocol §3a), in the writing rank's own
  part of the manifest (its ``"ranges"``, committed by the Merkle root with its files): the
  coordinator never receives them and a loading rank reads only those of the ranks whose shards
  it loads. A save of one rank (format /1), and /2 checkpoints written before the ranges moved
  into the parts, keep every rank's in the committer's :data:`RANGES_NAME` instead;
* checked on a ranged read (:func:`read_ranges`).
"""

from __future__ import annotations

import os
from typing import Any

from ... import errors
from ..._manifest import parts
from ..._base.checksum import PIECE, HashingWriter, digest_bytes, new_hasher
from ...errors import IntegrityError
from ..._manifest.manifest import RangeTable
from ..._read.reader import Found
from ..._manifest.verify import FALLBACK_HINT
from .compat import DEFAULT_SUFFIX, _StorageInfo

#: name -> {offset: [length, xxh3-128]} of every item's bytes of every rank: the committer's file
#: of a one-rank save (and of /2 checkpoints written before the ranges moved into the parts).
RANGES_NAME = "txckpt-dcp-ranges.json"


class RangeHashingWriter(HashingWriter):
    """A HashingWriter that also hashes each stretch between two ``tell()`` calls: DCP's item
    writer calls ``tell()`` before and after every item, so each item's range gets its digest.
    ``whole``: the file holds one item, whose range is the file (its digest, not hashed twice).

    ``key``: (a hasher, n): every write of exactly n bytes (``torch.save`` writes a tensor's
    storage in one write) also goes into the hasher, piece by piece beside the file's hash;
    :attr:`key_writes` counts them, so the caller can tell that the hasher saw that one write.
    ``tap``: as HashingWriter's (the file's chunk digests, protocol §3b)."""

    def __init__(self, sink: Any, whole: bool = False, key: tuple[Any, int] | None = None, tap: Any = None):
        super().__init__(sink, tap=tap)
        self._whole = whole
        self._start = 0
        self._range = new_hasher()
        self.ranges: RangeTable = {}
        self._key = key
        self.key_writes = 0

    def write(self, data: Any) -> int:
        if self._whole:
            if self._key is not None and memoryview(data).nbytes == self._key[1]:
                self.key_writes += 1
                self._also = self._key[0]
                try:
                    return super().write(data)
                finally:
                    self._also = None
            return super().write(data)
        view = memoryview(data).cast("B")
        # Piece by piece, so the range hash, the file hash and the write all find the piece in
        # the CPU cache (one pass over memory, as HashingWriter's own).
        for start in range(0, len(view), PIECE):
            piece = view[start : start + PIECE]
            self._range.update(piece)
            super().write(piece)
        return len(view)

    def tell(self) -> int:
        if self.size != self._start and not self._whole:
            self.ranges[str(self._start)] = [self.size - self._start, self._range.hexdigest()]
            self._range.reset()
            self._start = self.size
        return self.size


def shard_rank(name: str) -> int | None:
    """The rank of a shard ``__<rank>_<n>.distcp`` (whose part holds its entry and ranges); None:
    not a shard."""
    rank, _, rest = name[2:].partition("_")
    return int(rank) if name.startswith("__") and rank.isdigit() and rest.endswith(DEFAULT_SUFFIX) else None


def _looked_in(found: Found, name: str) -> str:
    """Where a load looked for ``name``'s range digests, for the error that found none."""
    rank, manifest = shard_rank(name), found.manifest
    places = []
    if manifest.parts is not None and rank is not None:
        places.append(f"rank {rank}'s part of the manifest ({parts.part_name(rank)})")
    if RANGES_NAME in manifest.files:
        places.append(RANGES_NAME)
    if not places:
        return f"the checkpoint has no {RANGES_NAME}, and no part of the manifest of a rank that wrote it"
    return ("none in " if len(places) == 1 else "neither in ") + " nor in ".join(places)


def read_ranges(found: Found, ranges: dict[str, RangeTable], name: str, infos: list[_StorageInfo]) -> list[bytes]:
    """The byte ranges ``infos`` of the checkpoint's file ``name``, each checked against its
    recorded digest in ``ranges`` (and the file's size against the manifest's) before it is
    returned; damage is an IntegrityError naming the file."""
    storage, key = found.storage, found.file_key(name)
    where, entry = f"{found.path}/{name}", found.manifest.files[name]
    recorded = ranges.get(name)
    if recorded is None:
        raise IntegrityError(
            f'{where} has no recorded range digests ({_looked_in(found, name)}); load it with verify="full"', path=where
        )
    if storage.is_symlink_escape(key):
        raise errors.UnsafePathError(f"{where} is a symlink that leaves the root; refusing to read it")
    try:
        f = storage.open_read(key)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise IntegrityError(
            f"{where} is missing (the manifest lists it): the checkpoint is damaged; {FALLBACK_HINT}", path=where
        ) from None
    out = []
    with f:
        size = os.fstat(f.fileno()).st_size if storage.local_path(key) is not None else getattr(f, "size", None)
        if size != entry.size:
            raise IntegrityError(
                f"{where} has {size} bytes, the manifest says {entry.size} (truncated or "
                f"rewritten): the checkpoint is damaged; {FALLBACK_HINT}",
                path=where,
            )
        for info in infos:
            f.seek(info.offset)
            blob = f.read(info.length)
            if [len(blob), digest_bytes(blob)] != recorded.get(str(info.offset)):
                raise IntegrityError(
                    f"{where} bytes {info.offset}..{info.offset + info.length} do not match their recorded "
                    f"xxh3-128: the checkpoint is damaged; {FALLBACK_HINT}",
                    path=where,
                )
            out.append(blob)
    return out


__all__ = ["RANGES_NAME", "RangeHashingWriter", "shard_rank", "read_ranges"]
