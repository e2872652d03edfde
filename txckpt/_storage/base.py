"""The storage seam: how bytes land under one root.

Everything above this module speaks in root-relative keys ("checkpoint-4/model.safetensors",
".txckpt/log/00000000000000000003.json") and never asks which backend it talks to. Where
backends differ, the difference is a method or attribute here, each with the one place that
asks it:

* how a new file becomes durable (``open_write`` + ``sync_dir``): the save path,
* how the commit point is made: ``create_exclusive`` is the one create-if-absent write,
* whether directories can be renamed atomically (``atomic_dir_rename``), which decides how a
  committed checkpoint is published (:mod:`txckpt._log.publication`),
* uploads a crashed writer can leave behind (``list_incomplete_uploads`` /
  ``abort_incomplete_uploads``: S3 multipart uploads; none elsewhere): garbage collection
  (:mod:`txckpt._maintenance.gc`) only,
* which files share their bytes (``file_links``: hard links on a local disk, none on an object
  store), so a deletion's freed bytes count each file once: garbage collection's report only,
* whether space can be held back on the root's disk (``space_reserve_path``: local disks;
  object stores never fill up that way): :mod:`txckpt._base.reserve` only.

The call sequence of a save, as the transaction issues it (see docs/protocol.md, "Save"):

1. ``write_batch()``, then ``open_write`` each data file under ``.txckpt/tx/<txid>/`` through
   the batch and ``close()`` it; ``wait()`` on the batch returns once every file closed through
   it is complete at its key (with ``durable=True``, on stable storage), or raises. An aborted
   save calls ``cancel()`` instead, before its staging is deleted.
2. ``sync_dir`` on the staging directory (and on any sub-directory written into).
3. ``create_exclusive`` of the manifest inside the staging directory, then ``sync_dir``.
4. ``create_exclusive`` of the next log entry: the commit point. Either the whole entry is
   visible to every reader or none of it is; of two racing writers exactly one succeeds.
5. After the commit point, independent follow-ups through ``run_concurrently``: the ``latest``
   hint, publication (rename backends: ``rename_noreplace`` of directories), the intent's delete.

Reads that decide correctness (``read_bytes``, ``exists``, ``list_dir``, ``list_subdirs``) must see every write
another process completed before the call: backends that cache listings bypass their caches.
"""

from __future__ import annotations

import abc
import concurrent.futures
import os
import posixpath
import threading
from typing import Any, BinaryIO, Callable, Hashable, Iterator, Mapping, Sequence

from .._base.checksum import PIECE, copy_hashing
from ..errors import UnsafePathError
from .._base.fileio import BufferRead, open_regular_file
from .errors import map_errors


def join(*parts: str) -> str:
    """Join root-relative keys with '/'."""
    return posixpath.join(*[p for p in parts if p])


def check_relative_key(key: str) -> str:
    """Return ``key`` normalised, or raise UnsafePathError if it could leave its directory."""
    if not isinstance(key, str) or not key:
        raise UnsafePathError(f"file name {key!r} is empty or not a string")
    if "\\" in key or "\x00" in key:
        raise UnsafePathError(f"file name {key!r} contains a backslash or NUL; use '/' separators")
    if key.startswith("/") or (len(key) > 1 and key[1] == ":"):
        raise UnsafePathError(f"file name {key!r} is absolute; give a path relative to the checkpoint")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"file name {key!r} has an empty, '.' or '..' component; give a plain relative path")
    return key


class WriteBatch:
    """The files one transaction (one rank) writes into its staging directory, and when their
    bytes are in place. Made by :meth:`Storage.write_batch`.

    Contract:

    * ``open_write`` / ``upload_file`` as on the storage. A backend MAY finish a file's upload
      after its ``close()`` (or ``upload_file``) returns, in the background, while the caller
      writes the next file. At most a small fixed number of closed files are pending at once
      (the backend documents it): a ``close()`` beyond that waits for the oldest, so memory
      stays bounded. A ``close()`` MAY raise the failure of an earlier file of the batch.
    * ``wait()`` returns only when every file closed through the batch is complete at its key
      (durable where ``durable=True`` was asked). If any upload failed it raises an ``OSError``
      naming the file, after every other upload of the batch has finished or failed; a failed
      upload leaves nothing at its key. The caller MUST call ``wait()`` before it relies on the
      files (lists or checks the staging, writes a manifest naming them).
    * ``cancel()`` waits for the uploads still running, ignores their failures, and starts no
      more: when it returns nothing of the batch is still being written, so the caller may
      delete the staging and know that no upload lands after the delete.

    This default writes synchronously (each ``close()`` returns with its file complete), so
    ``wait()`` and ``cancel()`` have nothing to do.
    """

    def __init__(self, storage: "Storage"):
        self.storage = storage

    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        return self.storage.open_write(key, durable=durable)

    def upload_file(
        self, local_file: str, key: str, *, durable: bool, tap: Callable[[memoryview], Any] | None = None
    ) -> tuple[int, str]:
        return self.storage.upload_file(local_file, key, durable=durable, tap=tap)

    def wait(self) -> None:
        """Block until every file of the batch is complete; raise the first failure (OSError)."""

    def cancel(self) -> None:
        """Block until no upload of the batch is running; failures are ignored."""


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as e:
        return e


#: Set in the shared pool's threads while they run a call: a call that itself runs calls
#: concurrently (a root's lookup inside a read beside it) runs them in its own thread, so that
#: pool threads never wait for tasks queued behind them on the same pool (a deadlock once
#: every thread of the pool waits).
_IN_POOL = threading.local()


def _pooled_outcome(call: Callable[[], Any]) -> Any:
    _IN_POOL.active = True
    try:
        return _outcome(call)
    finally:
        _IN_POOL.active = False


_POOL: list[concurrent.futures.ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _forget_pool_after_fork() -> None:
    # A forked child has none of the parent's threads: a pool inherited from the parent would
    # take work and never run it (the child hangs), and its lock may have been held at the fork.
    global _POOL_LOCK
    _POOL.clear()
    _POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _shared_pool() -> concurrent.futures.ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="txckpt-io"))
        return _POOL[0]


class Storage(abc.ABC):
    """One root on one backend. Keys are root-relative, '/'-separated, never absolute."""

    #: True where a directory can be renamed atomically without replacing a non-empty target
    #: (local POSIX filesystems). False on object stores, where "rename" is copy + delete.
    atomic_dir_rename: bool = False
    #: True where an operation costs a network round trip, so that independent ones are worth
    #: overlapping (:meth:`run_concurrently`). False on local disks (microseconds each, and one
    #: order of file operations keeps crash tests deterministic) and in memory.
    overlap_requests: bool = False

    def __init__(self, url: str):
        self.url = url

    #: Whether the backend operations this class itself defines go through storage/errors.py's
    #: mapping. False only where nothing could be mapped: a local disk raises its OSErrors, which
    #: ``translate`` leaves as they are (no client, no bucket, no endpoint), so a wrapper per
    #: file operation would only cost a call. Set in a class's own body; subclasses map again.
    maps_errors: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # What the stack below raises (no credentials, a missing bucket, an unreachable
        # endpoint) leaves every backend operation as a typed txckpt error: storage/errors.py.
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("maps_errors", True):
            map_errors(cls)

    def run_concurrently(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run independent operations of this storage; returns, per call in order, its result
        or the exception it raised (this method itself does not raise them).

        Contract: the caller passes only operations that may complete in any order (no call
        depends on another's effect) and returns only after all of them finished. Backends
        with ``overlap_requests`` run them at once, on a small shared thread pool; others run
        them one after the other, in the order given, and so does a call made from one of the
        pool's own threads (nested: no pool thread ever waits on the pool)."""
        if not self.overlap_requests or len(calls) < 2 or getattr(_IN_POOL, "active", False):
            return [_outcome(call) for call in calls]
        pool = _shared_pool()
        return [f.result() for f in [pool.submit(_pooled_outcome, call) for call in calls]]

    def start_concurrently(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """Start one operation of this storage beside what the caller goes on to do; returns a
        function that waits for it and returns its result or the exception it raised. Under
        the same contract and on the same pool as :meth:`run_concurrently` (elsewhere, and from
        the pool's own threads, it runs now, in this thread)."""
        if not self.overlap_requests or getattr(_IN_POOL, "active", False):
            outcome = _outcome(call)
            return lambda: outcome
        return _shared_pool().submit(_pooled_outcome, call).result

    # ----- addresses ---------------------------------------------------------------------------
    @abc.abstractmethod
    def full_path(self, key: str) -> str:
        """The path or URL a user passes to other tools (what ``get_last_checkpoint`` returns)."""

    def key_of(self, path: str) -> str | None:
        """The root-relative key of a full path or URL under this root, or None if outside it."""
        root = self.full_path("").rstrip("/")
        path = path.rstrip("/")
        if path == root:
            return ""
        if path.startswith(root + "/"):
            return path[len(root) + 1 :]
        return None

    def identity(self) -> str:
        """What this root addresses, however it was spelled: two storages of one identity (and
        the same options) read and write the same objects (txckpt/_log/identity.py keys by it)."""
        return self.full_path("").rstrip("/")

    def local_path(self, key: str) -> str | None:
        """A local filesystem path for ``key`` if this backend is a local disk, else None."""
        return None

    # ----- writing -----------------------------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        """Open a new file at ``key`` for writing, creating parent directories.

        Contract: the key is private to the caller (a staging key), so an existing file may be
        replaced. Bytes become visible at ``close()``; with ``durable=True`` they are on stable
        storage when ``close()`` returns. ``abort()`` on the returned object discards a partial
        upload; the object is an :class:`~txckpt._base.checksum.AbortOnError` context manager.
        """

    @abc.abstractmethod
    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        """Create ``key`` holding ``data`` if and only if it does not exist.

        Contract: atomic and all-or-nothing: a reader sees no file or the whole ``data``. Of two
        concurrent callers exactly one returns; the other raises ``FileExistsError``. With
        ``durable=True`` the file and its directory entry are durable when this returns.
        A caller that retries after an ambiguous failure must read the key back to learn whether
        its own earlier attempt won (txckpt puts a unique id in every such file).
        """

    @abc.abstractmethod
    def replace(self, key: str, data: bytes, *, durable: bool = False) -> None:
        """Write ``data`` at ``key``, replacing any previous content atomically (readers see the
        old or the new bytes). Never a commit point: used for hints, intents, and manifests of an
        adoption that the log has not committed yet. ``durable=True`` fsyncs the new content."""

    def write_batch(self) -> WriteBatch:
        """A :class:`WriteBatch` for the staging files of one transaction (see its contract)."""
        return WriteBatch(self)

    def sync_dir(self, key: str) -> None:
        """Make the directory entries under ``key`` durable. No-op where there are no directories."""

    def upload_file(
        self, local_file: str, key: str, *, durable: bool, tap: Callable[[memoryview], Any] | None = None
    ) -> tuple[int, str]:
        """Copy a local file to ``key`` once, hashing on the way; returns (size, xxh3-128 hex).
        ``tap`` gets every block right after it is hashed, in order (a tensor index's indexer)."""
        writer = self.open_write(key, durable=durable)
        ok = False
        try:
            with open_regular_file(local_file) as src:  # a FIFO there raises, never blocks
                size, digest = copy_hashing(src, writer, chunk=16 << 20, piece=PIECE, tap=tap)
            ok = True
        finally:
            if ok:
                writer.close()
            else:
                writer.abort()  # type: ignore[attr-defined]  # open_write's writers are AbortOnError
        return size, digest

    def share_file(self, src: str, dst: str, *, replace: bool = False) -> bool:
        """Make the new key ``dst`` hold the bytes of the existing, committed file ``src``
        without the client sending them again (an incremental save's unchanged file:
        docs/incremental.md). Returns False where this backend cannot (the caller then writes
        the bytes itself); raises FileNotFoundError if ``src`` is gone. ``dst`` is a staging key,
        private to the caller as for :meth:`open_write` (a local disk raises FileExistsError
        where it exists). With ``replace=True`` ``dst`` is a file the caller wrote there with the
        same bytes, which the shared one replaces atomically (a reader of ``dst`` sees either);
        on False it is left as it was.

        Contract: afterwards ``dst`` is a file of its own: deleting either key never deletes the
        other's bytes, so retention and gc need no reference counts. Local disks make a clone
        where the file system can (copy-on-write: a later write into either name changes that
        file only), else a hard link whose inode they make read-only (the two names share one
        inode: txckpt never writes a committed file again); object stores a server-side copy. The bytes are as durable as ``src``'s; the caller makes the
        directory entry durable with ``sync_dir``, as for a written file. This default cannot."""
        return False

    def file_identity(self, key: str) -> Hashable | None:
        """What changes whenever the bytes at ``key`` may have changed, read fresh: an
        incremental save trusts a committed file it has hashed once while this stays the same
        (docs/incremental.md, *What is checked*). Local disks give the inode with its size,
        mtime and ctime (an in-place write moves mtime and ctime; a ``touch`` back or an
        ``rsync --inplace`` that restores mtime still moves ctime; a rename over the name gives
        another inode); object stores the object's ETag or generation (a new upload gives a new
        one). Raises FileNotFoundError if ``key`` is missing. This default has none: None, and
        the caller hashes the file each time it relies on it."""
        return None

    def identity_after_share(self, key: str, before: Hashable) -> Hashable | None:
        """The identity of ``key`` after this process shared it (``share_file`` with ``key``
        as the source), given the identity ``before`` it had when checked: the share itself may
        move it (a hard link and the chmod to 0444 change the inode's ctime). None if the bytes
        may have changed since (the caller then checks them again before it trusts them)."""
        now = self.file_identity(key)
        return now if now == before else None

    # ----- reading -----------------------------------------------------------------------------
    @abc.abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """The whole content of ``key``, fresh (no cache). Raises FileNotFoundError."""

    def start_read(self, key: str, size: int, *, hash: bool) -> BufferRead | None:
        """Start reading the whole file at ``key``, which must hold ``size`` bytes, into a new
        uint8 tensor, hashing as it lands (``hash``); a :class:`~txckpt._base.fileio.BufferRead`
        once the last byte is in the buffer, its hash possibly still finishing. Raises
        :class:`~txckpt._base.fileio.SizeMismatch` when the file is not ``size`` bytes,
        FileNotFoundError when it is missing. None where this backend reads no faster than
        :meth:`read_bytes` (the caller reads and hashes that instead). The verified read of a
        load (txckpt._manifest.verify) asks it for remote files; local disks read through txckpt._base.fileio."""
        return None

    def read_through(self, key: str, size: int, write: Callable[[memoryview], Any]) -> tuple[int, str] | None:
        """Read the whole file at ``key``, which must hold ``size`` bytes, handing its bytes in
        order to ``write`` and hashing them; ``(size, xxh3-128)``. Raises
        :class:`~txckpt._base.fileio.SizeMismatch` when the file is not ``size`` bytes,
        FileNotFoundError when it is missing. None where this backend reads no faster than a
        stream of :meth:`open_read` (the caller copies that). A fetch (txckpt._read.fetch) asks it
        for each file it copies; S3 answers with parallel ranged GETs."""
        return None

    def read_to_file(
        self, key: str, size: int, fd: int, progress: Callable[[int], Any] | None = None
    ) -> tuple[int, str] | None:
        """Copy the whole file at ``key``, which must hold ``size`` bytes, into the new local
        file open for reading and writing at ``fd`` (bytes 0 .. ``size``, in any order),
        hashing it; ``(size, xxh3-128)``; ``progress`` is called with the size of each block
        written. Nothing writes to ``fd`` once this has returned or raised. Raises as
        :meth:`read_through`; None where this backend has no faster way than that (the caller
        uses :meth:`read_through`, then a stream). A fetch to a local directory (txckpt._read.fetch)
        asks it first; S3 answers with parallel ranged GETs written at their offsets."""
        return None

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A readable binary stream of ``key``. Raises FileNotFoundError."""

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes at each ``(offset, length)`` of ``key`` (fewer where the file ends first),
        and no others: a remote store overrides it with one ranged request per range, where a
        stream's read-ahead would fetch the rest of the file (a loading rank's Merkle proof,
        protocol §3a, must not cost it the whole tree). A range of length 0 is ``b""`` and asks
        the store nothing. Raises FileNotFoundError."""
        out = []
        with self.open_read(key) as f:
            for offset, length in ranges:
                f.seek(offset)
                out.append(f.read(length))
        return out

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a file or directory exists at ``key``, fresh."""

    @abc.abstractmethod
    def list_dir(self, key: str) -> list[str]:
        """Names (not keys) of the direct children of directory ``key``, fresh; [] if absent."""

    @abc.abstractmethod
    def list_subdirs(self, key: str) -> list[str]:
        """Names of the direct children of ``key`` that are directories, fresh; [] if absent.
        On an object store a directory is a prefix with objects under it: a plain object is a
        file there, whatever its name. Costs what ``list_dir`` costs (the same listing)."""

    @abc.abstractmethod
    def walk_files(self, key: str) -> Iterator[tuple[str, int]]:
        """Every file below ``key`` as (key relative to ``key``, size), fresh. Symlinks are
        reported by ``is_symlink_escape`` rather than followed."""

    def file_links(self, key: str) -> Iterator[tuple[Hashable, int, int]]:
        """Every file below ``key`` as (identity, size, links): its bytes are freed only when
        every one of its ``links`` names is deleted. Files of one identity share their bytes
        (a local disk's hard links: an incremental save's shared files, protocol §8a), so
        deleting ``key`` frees a file's size only where no link is left outside it; gc counts
        each identity once (txckpt._maintenance.intents.GcReport.measure). An object store has no links:
        each object is its own identity with one name (this default)."""
        for rel, size in self.walk_files(key):
            yield f"{key}/{rel}", max(0, size), 1

    def missing_root(self) -> str | None:
        """What of the root itself is missing (the local directory, the bucket), or None.
        An object-store prefix exists once something is written under it, so only a missing
        bucket counts there; backends that cannot tell answer None."""
        return None

    def is_symlink_escape(self, key: str) -> bool:
        """True if ``key`` is (or passes through) a symlink that resolves outside the root."""
        return False

    def read_location(self, key: str) -> tuple[bool, str | None]:
        """(:meth:`is_symlink_escape`, :meth:`local_path`) of ``key``: the two questions a
        verified read asks of every file before it reads it, in one call (a backend answers
        both from one path)."""
        return self.is_symlink_escape(key), self.local_path(key)

    def modified_time(self, key: str) -> float | None:
        """Last-modified time of ``key`` in seconds since the epoch, or None if unknown/absent."""
        return None

    # ----- removing ----------------------------------------------------------------------------
    @abc.abstractmethod
    def delete_file(self, key: str) -> None:
        """Remove one file; no error if it is already gone."""

    @abc.abstractmethod
    def delete_tree(self, key: str) -> None:
        """Remove ``key`` and everything below it; no error if it is already gone. Afterwards no
        listing names ``key`` or anything below it (the contract's test_delete_tree checks this on
        SeaweedFS too, whose filer keeps emptied directories unless they are deleted)."""

    # ----- what a crash leaves behind (gc) -------------------------------------------------------
    def list_incomplete_uploads(self, under: str = "") -> list[dict[str, Any]]:
        """Uploads below key ``under`` (the whole root by default) that were started and never
        completed or aborted, fresh: a writer killed mid-upload leaves them, and the store keeps
        (and bills) them until they are aborted. Each is a dict with ``"key"`` (root-relative),
        ``"upload_id"``, ``"initiated"`` (epoch seconds or a datetime) and, where known,
        ``"bytes"``. Backends whose failed writes leave nothing of the kind answer ``[]``.

        Called by :mod:`txckpt._maintenance.gc`, which decides which of them belong to a dead writer."""
        return []

    def abort_incomplete_uploads(self, uploads: Sequence[Mapping[str, Any]]) -> None:
        """Abort ``uploads`` (as :meth:`list_incomplete_uploads` listed them); one that was
        completed or aborted meanwhile is no error. Nothing to do where there are none."""

    # ----- space held back for retention (reserve) ---------------------------------------------
    def space_reserve_path(self, key: str) -> str | None:
        """The local path at which :mod:`txckpt._base.reserve` keeps a file of allocated blocks for
        ``key``, so that a retire entry still fits on a full disk; None where the root cannot
        run out of space that way (object stores, memory). Called by txckpt._base.reserve only."""
        return None

    # ----- rename backends only ----------------------------------------------------------------
    def rename_noreplace(self, src: str, dst: str) -> None:
        """Atomically rename directory ``src`` to ``dst``; FileExistsError if ``dst`` exists.

        Only called when ``atomic_dir_rename`` is True."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename directories atomically")

    def describe(self) -> str:
        return f"{type(self).__name__}({self.url})"
