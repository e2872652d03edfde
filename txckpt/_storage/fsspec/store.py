"""Any fsspec filesystem without atomic directory rename: GCS, Azure, chained URLs, and the base
of the S3 and memory backends (storage/s3.py, storage/memory.py).

The commit point is one create-if-absent write: ``pipe_file(mode="create")`` (``ifGenerationMatch=0``
on GCS, ``overwrite=False`` on Azure). Data is written once, to its final key. Nothing here
renames, copies, or uses fsspec transactions. Reads that decide correctness never trust a listing
cache, because another process may have written since (see docs/remote.md).

``FsspecStorage(url, fs, path)`` picks a specialised class for the filesystem it is given (see
``FsspecStorage._specialised``):

* :class:`~txckpt._storage.s3.store.S3Storage` (s3fs) talks to S3 through s3fs's async client with one
  request per operation where S3 allows it, and streams large files as concurrent multipart uploads.
* :class:`~txckpt._storage.fsspec.memory.MemoryStorage` (fsspec ``memory://``) makes the in-process store
  behave like an object store.
* anything else (gcsfs, adlfs, ...) uses fsspec's generic file API, here. GCS and Azure need no
  code of their own: their differences are the two comments on ``create_exclusive`` and ``_fresh``.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Hashable, Iterator, Sequence

from ..._base.checksum import AbortOnError
from ..base import Storage


class FsspecStorage(Storage):
    atomic_dir_rename = False
    overlap_requests = True  # every operation is a round trip to a remote store

    #: The specialised subclasses (storage/s3.py, storage/memory.py), in the order they are
    #: asked: each defines :meth:`handles`. They register themselves when their module is
    #: imported (``txckpt._storage`` imports both), so this module never imports them.
    _specialised: list[type["FsspecStorage"]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "handles" in cls.__dict__:
            FsspecStorage._specialised.append(cls)

    @classmethod
    def handles(cls, fs: Any) -> bool:
        """Whether this class is the one for filesystem ``fs`` (the generic class: none)."""
        return False

    def __new__(cls, url: str, fs: Any, root_path: str):
        if cls is FsspecStorage:
            cls = next((c for c in FsspecStorage._specialised if c.handles(fs)), cls)
        return super().__new__(cls)

    def __init__(self, url: str, fs: Any, root_path: str):
        super().__init__(url)
        self.fs = fs
        self.root = root_path.rstrip("/")

    def _p(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def missing_root(self) -> str | None:
        """GCS, Azure and other bucketed stores: the root's first path component is the bucket
        (or container); it missing is a missing root (protocol §6 step 5). One existence check,
        made only when the root has no log."""
        bucket = self.root.split("/", 1)[0]
        if not bucket:
            return None
        self.fs.invalidate_cache(bucket)  # another process may have just created it
        return None if self.fs.exists(bucket) else self.fs.unstrip_protocol(bucket)

    def full_path(self, key: str) -> str:
        return self.fs.unstrip_protocol(self._p(key))

    def key_of(self, path: str) -> str | None:
        stripped = self.fs._strip_protocol(path).rstrip("/")
        if stripped == self.root:
            return ""
        if stripped.startswith(self.root + "/"):
            return stripped[len(self.root) + 1 :]
        return None

    def _fresh(self, key: str, tree: bool = False) -> None:
        """Forget cached listings of ``key`` and of every parent (with ``tree``, also below it).

        ``invalidate_cache(path)`` is not enough on its own: s3fs and gcsfs drop the parents too,
        but adlfs drops only ``path``, and a cached parent listing then makes ``info``/``open``
        of a file another process just wrote raise FileNotFoundError."""
        path = self.fs._strip_protocol(self._p(key)).rstrip("/")
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # pragma: no cover - a backend without a cache
            pass
        cache = getattr(self.fs, "dircache", None)
        if cache is None:
            return
        p = path
        while p:
            cache.pop(p, None)
            cache.pop(p + "/", None)
            parent = self.fs._parent(p).rstrip("/")
            if parent == p:
                break
            p = parent
        cache.pop("", None)
        if tree:
            below = path + "/"
            for cached in [c for c in list(cache) if c.startswith(below)]:
                cache.pop(cached, None)

    # ----- writing -----------------------------------------------------------------------------
    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        # An object is durable once its upload completes at close(); there is nothing to fsync.
        return _AbortableWriter(self.fs, self._p(key))  # type: ignore[return-value]

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        # pipe_file(mode="create"), not open("xb"): gcsfs 2026.10's open("xb") does not send
        # its precondition (every racer "wins" against fake-gcs-server), while its pipe_file
        # sends ifGenerationMatch=0; adlfs maps mode="create" to overwrite=False (If-None-Match).
        self.fs.pipe_file(self._p(key), bytes(data), mode="create")
        self._fresh(key)

    def replace(self, key: str, data: bytes, *, durable: bool = False) -> None:
        self.fs.pipe_file(self._p(key), data)
        self._fresh(key)

    def share_file(self, src: str, dst: str, *, replace: bool = False) -> bool:
        # fsspec's copy is the store's own: S3 CopyObject (UploadPartCopy past 5 GiB), GCS
        # rewrite, Azure copy-from-URL; no byte of the file passes through this process. The
        # destination is a staging key, private to the caller (as for open_write); a copy
        # replaces an object whole, so ``replace`` needs nothing more.
        self.fs.copy(self._p(src), self._p(dst))
        self._fresh(dst)
        return True

    def file_identity(self, key: str) -> Hashable | None:
        # A fresh HEAD (s3fs, adlfs: the ETag; gcsfs: the generation); the key is part of it, as
        # an object store has no inode two names share. None where the backend reports neither.
        self._fresh(key)
        info = self.fs.info(self._p(key))
        tag = next((info[f] for f in ("generation", "ETag", "etag") if info.get(f)), None)
        return None if tag is None else (self._p(key), str(tag), info.get("size"))

    def identity_after_share(self, key: str, before: Hashable) -> Hashable | None:
        # A server-side copy reads its source and changes nothing of it: no second HEAD.
        return before

    # ----- reading -----------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        self._fresh(key)
        return self.fs.cat_file(self._p(key))

    def open_read(self, key: str) -> BinaryIO:
        self._fresh(key)
        return self.fs.open(self._p(key), "rb")

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        # cat_file by range: a file object's read-ahead would fetch a block per range.
        self._fresh(key)
        path = self._p(key)
        # An empty range (a 0-element tensor) asks nothing: Azure answers a zero-length range with no
        # Content-Range, which its client refuses.
        return [
            self.fs.cat_file(path, start=offset, end=offset + length) if length > 0 else b""
            for offset, length in ranges
        ]

    def exists(self, key: str) -> bool:
        self._fresh(key)
        return self.fs.exists(self._p(key))

    def list_dir(self, key: str) -> list[str]:
        return sorted({name for name, _is_dir in self._children(key)})

    def list_subdirs(self, key: str) -> list[str]:
        return sorted(name for name, is_dir in self._children(key) if is_dir)

    def _children(self, key: str) -> list[tuple[str, bool]]:
        """(name, is a directory) of each direct child of ``key``: one fresh ``ls``."""
        self._fresh(key, tree=True)
        try:
            entries = self.fs.ls(self._p(key), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self._p(key).rstrip("/") + "/"
        out = []
        for e in entries:
            path = self.fs._strip_protocol(e["name"]).rstrip("/")
            if path.startswith(base):
                name = path[len(base) :]
                if name and "/" not in name:
                    out.append((name, e.get("type") == "directory"))
        return out

    def walk_files(self, key: str) -> Iterator[tuple[str, int]]:
        self._fresh(key, tree=True)
        base = self._p(key).rstrip("/") + "/"
        try:
            found = self.fs.find(self._p(key), detail=True)
        except FileNotFoundError:
            return iter(())
        out = []
        for path, info in sorted(found.items()):
            path = self.fs._strip_protocol(path)
            if path.startswith(base) and info.get("type", "file") != "directory":
                out.append((path[len(base) :], int(info.get("size") or 0)))
        return iter(out)

    def modified_time(self, key: str) -> float | None:
        self._fresh(key)
        try:
            info = self.fs.info(self._p(key))
        except FileNotFoundError:
            return None
        for field in ("LastModified", "mtime", "updated", "last_modified", "modified", "created"):
            value = info.get(field)
            if value is None:
                continue
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            try:
                return float(value)
            except (TypeError, ValueError):
                continue
        return None

    # ----- removing ----------------------------------------------------------------------------
    def delete_file(self, key: str) -> None:
        try:
            self.fs.rm_file(self._p(key))
        except FileNotFoundError:
            pass
        self._fresh(key)

    def delete_tree(self, key: str) -> None:
        self._fresh(key, tree=True)
        try:
            self.fs.rm(self._p(key), recursive=True)
        except FileNotFoundError:
            pass
        self._fresh(key, tree=True)


class _AbortableWriter(AbortOnError):
    """fsspec file opened for writing, with abort() that discards a partial upload.

    fsspec uploads a half-written object when an exception leaves ``with fs.open(...)``; txckpt
    never leaves it there: abort() discards the upload (``discard()``) and deletes whatever the
    backend may already have made visible.
    """

    def __init__(self, fs: Any, path: str):
        self._fs = fs
        self._path = path
        self._f = fs.open(path, "wb")
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.closed:
            raise ValueError("write to a closed file")
        return self._f.write(data)

    def flush(self) -> None:
        # Flushing an fsspec buffered file uploads a part; let the file decide when.
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._f.close()
            try:
                self._fs.invalidate_cache(self._path)
            except Exception:  # pragma: no cover
                pass

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        discard = getattr(self._f, "discard", None)
        try:
            if discard is not None:
                discard()
        finally:
            self._f.closed = True  # fsspec: mark closed so nothing is committed on GC
            try:
                self._fs.invalidate_cache(self._path)
                if self._fs.exists(self._path):
                    self._fs.rm_file(self._path)
            except Exception:  # best effort: gc reclaims what is left
                pass
