"""Incremental saves: a file whose bytes equal a committed file's is shared, not written again.

docs/incremental.md is the user's page; protocol.md §3 (``prefixes``) and §8a the rules. One
:class:`Sharing` per transaction and rank, used by ``txckpt._save.transactions`` in this order:

1. :meth:`Sharing.unchanged` for each object ``tx.save`` is given. It serializes the object into a
   hash-only :class:`_Probe` (nothing is written) against the files of the newest committed
   checkpoints of the root (any lineage; :func:`committed_files`). The probe compares the running
   digest at each prefix boundary (``checksum.next_boundary``) with every candidate's recorded
   one and stops at the first boundary that no candidate matches, so a changed file costs the
   hashing of the bytes before that boundary (usually its first MiB), not a second write. A
   file whose size and xxh3-128 equal a candidate's is unchanged: the source checkpoint is
   leased (``txckpt._maintenance.leases``: retention and gc leave it alone until the save ends) and the share
   is pending.
2. :meth:`Sharing.place`, at the rank's end of the transaction, after every writer of the
   staging directory is done: each pending file is made at its staging key by the storage's
   ``share_file`` (a clone or a read-only hard link on local disks, a server-side copy on
   object stores), once :meth:`Sharing.trusted` holds for it again, or, where
   the storage cannot, copied through this process and checked against the source's checksum.
   Placing late means no code writing into ``tx.directory`` can open a shared (hard-linked)
   file for writing: a name it wrote as well makes the placement fail, like any name written
   twice.
3. :meth:`Sharing.release` when the transaction ends, committed or not: the leases go back.

A committed file is shared only once its bytes are known to match its manifest entry
(:meth:`Sharing.trusted`): hashed once per process, then trusted while the storage's
``file_identity`` of it stays the same, and hashed again after :data:`RECHECK_EVERY` shares. One
that does not match is never shared again in this process: the save writes the bytes and warns
once, naming the damaged checkpoint; a checkpoint a fallback found damaged (:func:`distrust`)
offers nothing.

A shared file is a file of its checkpoint like any other: its manifest entry has the same size,
checksum and prefixes, loads verify it byte for byte, and deleting another checkpoint that holds
the same bytes deletes none of them (a hard link or a copy is a file of its own).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from .._base.checksum import copy_hashing, new_hasher, next_boundary, prefix_boundaries
from ..errors import CheckpointNotFoundError, IntegrityError, InvalidArgumentError, ManifestError, storage_error
from .._base.fileio import SizeMismatch, hash_file
from .._maintenance.leases import acquire_reader_lease, release_reader_lease
from .._log.lineage import Checkpoint
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import FileEntry, Manifest, as_entry, read_manifest_at
from .._log.publication import Root
from .._base.refs import Ref
from .serialization import write_object
from .._storage.base import Storage

log = logging.getLogger("txckpt")

#: How long the lease on a source lasts: past the longest save (its release ends it sooner); a
#: process killed mid-save holds its sources this long (+ the deleters' clock-skew margin).
LEASE_S = 6 * 3600.0

#: How many of the newest committed checkpoints (of any lineage) an incremental save compares
#: its files with: the previous save's, a fork point's, a sibling run's. Each costs one manifest
#: read per process, once (manifests never change).
DEPTH = 8


@dataclass(frozen=True)
class Source:
    """One committed file an unchanged file can share: its checkpoint and its entry there."""

    ref: Ref
    name: str
    entry: FileEntry


# Decoded manifests by (root identity, txid, digest), the most recently used last: a committed
# manifest never changes, so a save re-reads only the checkpoints committed since the last one.
# Bounded: a long run's older checkpoints fall out of every save's DEPTH anyway.
_MANIFESTS: "OrderedDict[tuple[str, str, str], Manifest]" = OrderedDict()
_MANIFESTS_KEPT = 4 * DEPTH
_MANIFESTS_LOCK = threading.Lock()

#: How many shares a checked file's unchanged identity vouches for before its bytes are read
#: again: bit rot (or a write that restores every stat field) changes no identity, and a file
#: shared forever unread would carry such damage into every later checkpoint.
RECHECK_EVERY = 64

# What this process knows of committed files' bytes, by (storage identity, file identity): the
# (size, xxh3-128) they were hashed to and how many more shares that vouches for, the most
# recently used last; and the identities whose bytes did not match their entry (warned once).
_CHECKED: "OrderedDict[tuple[str, Hashable], list[Any]]" = OrderedDict()
_CHECKED_KEPT = 4096
_DAMAGED: set[tuple[str, Hashable]] = set()
# Checkpoints a fallback found damaged, by (storage identity, txid): never a candidate again.
_DISTRUSTED: set[tuple[str, str]] = set()
_CHECK_LOCK = threading.Lock()


def distrust(root: Root, txids: Sequence[str], paths: Sequence[str | None] = ()) -> None:
    """Never share a file of these checkpoints of ``root`` again in this process, nor the
    damaged files at ``paths`` (full paths) under any other checkpoint's name (a hard link is
    one inode): a fallback or a load found them damaged (txckpt._root.fallback, txckpt._read.reader)."""
    storage, where = root.storage, root.storage.identity()
    damaged = []
    for path in paths:
        key = storage.key_of(path) if path else None
        try:
            damaged.append(storage.file_identity(key) if key is not None else None)
        except OSError:  # gone, or unreadable: nothing of it to share anyway
            pass
    with _CHECK_LOCK:
        _DISTRUSTED.update((where, txid) for txid in txids)
        for identity in damaged:
            if identity is not None:
                _DAMAGED.add((where, identity))
                _CHECKED.pop((where, identity), None)


def committed_files(root: Root, depth: int = DEPTH, *, where: str | None = None) -> list[Source]:
    """The files of the ``depth`` newest committed, not retired checkpoints of ``root``, newest
    checkpoint first. A checkpoint whose manifest cannot be read, or does not match the digest
    its commit entry recorded, offers nothing (its bytes are not trusted to share). ``where``:
    the root's storage identity, if the caller has it."""
    history = root.history()
    where = root.storage.identity() if where is None else where
    live = [
        c for c in history.checkpoints.values() if c.txid not in history.retired and (where, c.txid) not in _DISTRUSTED
    ]
    live.sort(key=lambda c: c.seq, reverse=True)
    out: list[Source] = []
    for c in live[:depth]:
        manifest = _manifest(root, c, where)
        if manifest is not None:
            ref = c.ref  # one Ref per checkpoint, shared by its files' sources
            out.extend(Source(ref, name, entry) for name, entry in sorted(manifest.files.items()))
    return out


def remember_manifest(where: str, manifest: Manifest) -> None:
    """A manifest this process has just committed (encoded, so its digest is set) on the
    storage of identity ``where``: the next incremental save compares with it without reading
    it back (it is byte for byte what the log's entry records)."""
    with _MANIFESTS_LOCK:
        _MANIFESTS[(where, manifest.txid, manifest.digest)] = manifest
        while len(_MANIFESTS) > _MANIFESTS_KEPT:
            _MANIFESTS.popitem(last=False)


def _manifest(root: Root, c: Checkpoint, where: str) -> Manifest | None:
    cache_key = (where, c.txid, c.digest)
    with _MANIFESTS_LOCK:  # an async save's thread and the caller's may both look
        if cache_key in _MANIFESTS:
            _MANIFESTS.move_to_end(cache_key)
            return _MANIFESTS[cache_key]
    key = root.publication.locate(c.ref)
    if key is None:
        return None
    try:
        manifest = read_manifest_at(
            root.storage, key, Manifest.decode(root.storage.read_bytes(f"{key}/{MANIFEST_NAME}"), where=key), key
        )
    except (OSError, ManifestError):
        return None
    if manifest.txid != c.txid or manifest.digest != c.digest:
        return None
    remember_manifest(where, manifest)
    return manifest


def _remember(where: str, identity: Hashable | None, entry: FileEntry, left: int | None = None) -> None:
    """This process knows the file of ``identity`` holds ``entry``'s bytes, for ``left`` more
    shares (RECHECK_EVERY: it has just read or written them)."""
    if identity is None:
        return
    with _CHECK_LOCK:
        _CHECKED[(where, identity)] = [(entry.size, entry.checksum), RECHECK_EVERY if left is None else left]
        _CHECKED.move_to_end((where, identity))
        while len(_CHECKED) > _CHECKED_KEPT:
            _CHECKED.popitem(last=False)


def _hash_stored(storage: Storage, key: str, size: int) -> tuple[int, str | None]:
    """(size, xxh3-128) of the stored file ``key`` that should hold ``size`` bytes, read whole
    (a local file through fileio, a remote one by the storage's fastest read); (its size, None)
    where it does not have ``size`` bytes."""
    path = storage.local_path(key)
    if path is not None:
        return hash_file(path)
    try:
        got = storage.read_through(key, size, lambda _view: None)
    except SizeMismatch as e:
        return e.actual, None
    if got is not None:
        return got
    with storage.open_read(key) as f:
        return copy_hashing(f)


#: Where every probe takes its first running digest (the first of ``prefix_boundaries``).
_FIRST_BOUNDARY = next_boundary(0)


class _Changed(Exception):
    """Raised inside the serializer when no candidate is left: the file is written instead."""


class _Probe(io.RawIOBase):
    """A write-only stream that hashes what a serializer gives it, writes nothing, and drops
    each candidate whose recorded prefix digest differs at a boundary (or that is too short to
    be equal). Raises :class:`_Changed` as soon as none is left."""

    def __init__(self, candidates: Sequence[Source]):
        super().__init__()
        self._alive = list(candidates)
        self._hasher = new_hasher()
        self._boundary = _FIRST_BOUNDARY
        self._index = 0  # of the next boundary in every candidate's prefixes
        self.size = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def write(self, data: Any) -> int:
        if not self._alive:
            raise _Changed()
        view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
        n, start = len(view), 0
        while start < n:
            end = min(n, start + self._boundary - self.size)
            self._hasher.update(view[start:end])
            self.size += end - start
            start = end
            if self.size == self._boundary:
                self._at_boundary()
        return n

    def _at_boundary(self) -> None:
        digest, i, size = self._hasher.hexdigest(), self._index, self.size
        # A candidate of exactly this size may still be equal: the end decides it.
        self._alive = [
            s
            for s in self._alive
            if s.entry.size == size
            or (s.entry.size > size and len(s.entry.prefixes) > i and s.entry.prefixes[i] == digest)
        ]
        self._index += 1
        self._boundary = next_boundary(size)
        if not self._alive:
            raise _Changed()

    def equal(self) -> Source | None:
        """After the serializer returned: the first candidate with this size and checksum."""
        return next(iter(self.equals()), None)

    def equals(self) -> list[Source]:
        """After the serializer returned: every candidate with this size and checksum, in order."""
        digest = self._hasher.hexdigest()
        return [s for s in self._alive if s.entry.size == self.size and s.entry.checksum == digest]


class Sharing:
    """One rank's shares in one transaction (see the module doc for the call sequence)."""

    def __init__(self, root: Root):
        self._root = root
        #: The storage's identity (what this process's knowledge of files is keyed by): asked
        #: once per save, not once per file.
        self._where = root.storage.identity()
        #: txid -> the key its checkpoint was found at (:meth:`_home`): looked up once per save,
        #: and again only where it moved since (:meth:`trusted`, :meth:`_checked_source`).
        self._homes: dict[str, str | None] = {}
        self._candidates: list[Source] | None = None
        self._leases: dict[str, str] = {}  # txid -> lease key
        #: name -> the committed file it shares, recorded by the transaction once the name is
        #: accepted; placed by :meth:`place`.
        self.pending: dict[str, Source] = {}
        # storage key -> the file identity it had when checked (its bytes matched its entry)
        self._identities: dict[str, Hashable | None] = {}

    def unchanged(self, name: str, obj: Any) -> tuple[Source, str] | None:
        """If ``obj``, serialized as file ``name``, has the bytes of a committed file: lease
        that file's checkpoint and return (the file, the kind ``tx.save`` gives it); the caller
        then records the share in :attr:`pending`. Otherwise None (the caller writes the file);
        never raises for the object's sake (a serializer error shows when the caller writes)."""
        probe = _Probe(self.sources())
        try:
            kind = write_object(name, obj, probe)  # type: ignore[arg-type]  # a write-only stream
        except Exception:  # _Changed, maybe wrapped by the serializer; or the object's own error
            return None
        source = self._first_leased(probe.equals())
        return None if source is None else (source, kind)

    def unchanged_file(self, path: str) -> Source | None:
        """If the local file ``path`` (other code's file in a remote root's scratch directory,
        about to be uploaded) has the bytes of a committed file: that file, leased; the caller
        records the share in :attr:`pending` and uploads nothing. Reads ``path`` only up to the
        first boundary where it differs from every committed file of its size."""
        size = os.path.getsize(path)
        candidates = [s for s in self.sources() if s.entry.size == size]
        if not candidates:
            return None
        if any(len(s.entry.prefixes) != len(prefix_boundaries(size)) for s in candidates):
            # A candidate without prefixes (a file uploaded or hashed whole, not streamed by an
            # incremental tx.save): only the whole file's checksum can tell.
            _, checksum = hash_file(path)
            return self.matching(size, checksum)
        probe = _Probe(candidates)
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(8 << 20), b""):
                    probe.write(chunk)
        except _Changed:
            return None
        return self._first_leased(probe.equals())

    def relink(self, storage_key: str, hashed: dict[str, FileEntry]) -> set[str]:
        """Files other code wrote into a local staging directory ``storage_key`` and this
        process has just hashed (``hashed``: name -> entry): each whose size and checksum equal
        a committed file's, once :meth:`trusted` holds for that file, is replaced by a share of
        it (``share_file``: a clone, or a read-only hard link), so the checkpoints hold its bytes once. The bytes were written once already (a Trainer's
        ``save_pretrained`` writes its own files), to memory: the caller fsyncs only the files
        not shared, so a replaced file's pages leave with its inode, never written to the disk.
        Returns the names shared."""
        shared_names: set[str] = set()
        for name, entry in sorted(hashed.items()):
            source = self.matching(entry.size, entry.checksum)
            if source is None:
                continue
            home = self._home(source.ref)
            if home is None:  # pragma: no cover - the lease keeps it
                continue
            try:
                shared = self._root.storage.share_file(f"{home}/{source.name}", f"{storage_key}/{name}", replace=True)
            except OSError as e:  # the written file stays: a share is an optimisation here
                log.debug("could not share %s with %s: %s", name, source.name, e)
                shared = False
            if shared:
                self._shared(f"{home}/{source.name}", f"{storage_key}/{name}", source.entry)
                shared_names.add(name)
        return shared_names

    def matching(self, size: int, checksum: str) -> Source | None:
        """The committed file with this size and checksum, leased; None if there is none."""
        return self._first_leased([s for s in self.sources() if s.entry.size == size and s.entry.checksum == checksum])

    def _first_leased(self, sources: Sequence[Source]) -> Source | None:
        return next((s for s in sources if self.lease(s)), None)

    def sources(self) -> list[Source]:
        """The committed files this save may share (:func:`committed_files`, read once per
        save), newest checkpoint first: also what a grouped save (txckpt._save.grouped) reads
        the previous tensor index from."""
        if self._candidates is None:
            self._candidates = committed_files(self._root, where=self._where)
        return self._candidates

    def lease(self, source: Source) -> bool:
        """Lease ``source``'s checkpoint for this save (once per checkpoint: retention and gc
        keep it until :meth:`release`); False (and it is no longer a candidate) if it was
        retired since the index was read. Public for a saver that decides by itself that a file
        is unchanged (txckpt.integrations._dcp.incremental: from a tensor's own bytes) and then
        records the share in :attr:`pending`. False as well (and it is no longer a candidate)
        where the file's bytes do not match its entry (:meth:`trusted`)."""
        if not self.trusted(source):
            if self._candidates is not None:
                self._candidates = [s for s in self._candidates if s != source]
            return False
        if source.ref.txid in self._leases:
            return True
        try:
            self._leases[source.ref.txid] = acquire_reader_lease(self._root, source.ref.txid, LEASE_S)
        except CheckpointNotFoundError:
            self._candidates = [s for s in self.sources() if s.ref.txid != source.ref.txid]
            return False
        return True

    def trusted(self, source: Source) -> bool:
        """Whether ``source``'s bytes match its manifest entry: known where this process hashed
        the file at its present identity fewer than :data:`RECHECK_EVERY` shares ago, else
        read and hashed now. A file that does not match (damaged in place, truncated, written
        over) is never trusted again at that identity; the first time, a warning names it and
        its checkpoint. False too where the file is gone."""
        storage = self._root.storage
        home = self._home(source.ref)
        if home is None:
            return False
        key, entry = f"{home}/{source.name}", source.entry
        try:
            identity = storage.file_identity(key)
        except FileNotFoundError:
            self._homes.pop(source.ref.txid, None)  # moved since it was found: look again next time
            return False
        where = self._where
        cache_key = (where, identity)
        if identity is not None:
            with _CHECK_LOCK:
                if cache_key in _DAMAGED:
                    return False
                known = _CHECKED.get(cache_key)
                if known is not None and known[0] == (entry.size, entry.checksum) and known[1] > 0:
                    known[1] -= 1
                    _CHECKED.move_to_end(cache_key)
                    self._identities[key] = identity
                    return True
        try:
            found = _hash_stored(storage, key, entry.size)
        except FileNotFoundError:
            return False
        if found != (entry.size, entry.checksum):
            # Without an identity nothing marks the file (it is read, and fails, each time it
            # is offered); with one, only its first failure warns.
            first = True
            if identity is not None:
                with _CHECK_LOCK:
                    first = cache_key not in _DAMAGED
                    _DAMAGED.add(cache_key)
                    _CHECKED.pop(cache_key, None)
            if first:
                log.warning(
                    "%s, a file of checkpoint step %d (txid %s), does not match its manifest entry (size %d, "
                    "xxh3-128 %s; it has size %d, xxh3-128 %s): that checkpoint is damaged, and every "
                    "other one holding the same file. This save writes the bytes instead of sharing them; "
                    "`txckpt verify` lists the damaged checkpoints.",
                    storage.full_path(key),
                    source.ref.step,
                    source.ref.txid,
                    entry.size,
                    entry.checksum,
                    found[0],
                    found[1] or "unknown",
                )
            return False
        _remember(where, identity, entry)
        self._identities[key] = identity
        return True

    def _home(self, ref: Ref) -> str | None:
        """Where checkpoint ``ref`` is, looked up once per save (its manifest read, locally)."""
        if ref.txid not in self._homes:
            self._homes[ref.txid] = self._root.publication.locate(ref)
        return self._homes[ref.txid]

    def _shared(self, src: str, dst: str, entry: FileEntry) -> None:
        """After ``src`` was shared as ``dst``: what this process knows of ``src``'s bytes holds
        for its identity now (the share may have moved it: a hard link's ctime) and for
        ``dst``'s (a clone or a copy is a file of its own, whose bytes are those checked), so
        the next save trusts either without reading it."""
        storage, before = self._root.storage, self._identities.get(src)
        if before is None:
            return
        try:
            after, copy = storage.identity_after_share(src, before), storage.file_identity(dst)
        except FileNotFoundError:  # pragma: no cover - leased, and dst is this save's
            return
        with _CHECK_LOCK:
            left = _CHECKED.pop((self._where, before), [None, None])[1]
        for identity in {after, copy} - {None}:
            _remember(self._where, identity, entry, left)
        if after is not None:
            self._identities[src] = after

    def place(self, staging_key: str, durable: bool, written: dict[str, Any] | None = None) -> None:
        """Make every pending share a file of the staging directory (module doc, step 2).
        ``written``: name -> manifest entry (a FileEntry, or its JSON) of the files this rank wrote and hashed as
        it wrote them; on a local disk their identities are remembered as checked, so the next
        save of this process shares them without reading them back."""
        storage = self._root.storage
        # A stat there; a request per file on an object store, where a file's first share reads
        # it once instead. Where the staging directory is, and the storage's identity, are the
        # same for every written file: asked once, not once per file.
        if written and storage.local_path(staging_key) is not None:
            where = self._where
            for name, entry in sorted(written.items()):
                if name in self.pending:
                    continue
                try:
                    _remember(where, storage.file_identity(f"{staging_key}/{name}"), as_entry(name, entry))
                except (OSError, ManifestError):  # not the caller's to fail: read when first shared
                    pass
        for name, source in sorted(self.pending.items()):
            src, dst = self._checked_source(source), f"{staging_key}/{name}"
            try:
                if storage.share_file(src, dst):
                    self._shared(src, dst, source.entry)
                    continue
            except FileExistsError:
                raise InvalidArgumentError(
                    f"{name!r} was saved with tx.save and written into tx.directory by other code as well; "
                    "write each file one way only, or under another name"
                ) from None
            except OSError as e:  # a full disk, a refused request: typed, saying which file
                raise storage_error(e, f"share {name!r} with {storage.full_path(src)}") from e
            # This storage cannot share: copy through this process, checked against the source.
            with storage.open_read(src) as f, storage.open_write(dst, durable=durable) as out:
                size, digest = copy_hashing(f, out, chunk=8 << 20)
                if (size, digest) != (source.entry.size, source.entry.checksum):  # aborts the copy
                    raise IntegrityError(
                        f"{storage.full_path(src)} does not match its manifest (size {size}, xxh3-128 "
                        f"{digest}); run `txckpt verify` on its root and save again without incremental=True",
                        path=storage.full_path(src),
                    )

    def _checked_source(self, source: Source) -> str:
        """The key of ``source``'s file now, its bytes still those checked by the probes: the
        same identity (one stat or HEAD), else read again. Its checkpoint is where the probes
        found it, or, if it moved since (a fork unpublishes what it abandons; the lease only
        keeps it from deletion), looked up again and checked there."""
        storage = self._root.storage
        for moved in (False, True):
            home = self._home(source.ref)
            if home is None:  # pragma: no cover - the lease keeps it
                break
            src = f"{home}/{source.name}"
            before = self._identities.get(src)
            try:
                if before is not None and storage.file_identity(src) == before:
                    return src
            except FileNotFoundError:
                self._homes.pop(source.ref.txid, None)
                continue
            if (before is None and not moved) or self.trusted(source):
                return src
            raise IntegrityError(
                f"{storage.full_path(src)}, which this save shares, changed while it saved and no longer "
                "matches its manifest (written by other code): save again (the next save writes the "
                "file), and run `txckpt verify` on the root",
                path=storage.full_path(src),
            )
        raise CheckpointNotFoundError(
            f"checkpoint {source.ref.txid}, whose {source.name!r} this save shares, is gone "
            "although leased; save again without incremental=True"
        )

    def release(self, committed: Manifest | None = None) -> None:
        """Give the leases back (the transaction has ended); never raises. ``committed``: the
        manifest this save committed, remembered for the next save (:func:`remember_manifest`)."""
        if committed is not None:
            remember_manifest(self._where, committed)
        for key in self._leases.values():
            try:
                release_reader_lease(self._root, key)
            except OSError:  # it expires; gc removes it
                log.warning("could not release the lease %s of an incremental save", key, exc_info=True)
        self._leases.clear()


__all__ = ["Sharing", "Source", "committed_files", "DEPTH"]
