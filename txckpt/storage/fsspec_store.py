"""Any fsspec filesystem without atomic directory rename: S3, GCS, Azure, memory, chained URLs.

The commit point is one create-if-absent write: ``PutObject`` with ``If-None-Match: *`` on S3,
``pipe_file(mode="create")`` elsewhere (``ifGenerationMatch=0`` on GCS, ``overwrite=False`` on
Azure), an atomic dict insert in memory.
Data is written once, to its final key. Nothing here renames, copies, or uses fsspec
transactions. Reads that decide correctness never trust a listing cache, because another process
may have written since (see docs/remote.md).

``FsspecStorage(url, fs, path)`` picks a specialised class for the filesystem it is given:

* :class:`S3Storage` (s3fs) talks to S3 through s3fs's async client with one request per
  operation where S3 allows it, and streams large files as concurrent multipart uploads.
* :class:`MemoryStorage` (fsspec ``memory://``) makes the in-process store behave like an object
  store: a file appears whole at ``close()``, and create-if-absent is atomic between threads.
* anything else (gcsfs, adlfs, ...) uses fsspec's generic file API.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import io
import os
import sys
import zlib
from typing import Any, BinaryIO, Iterator

from ..checksum import AbortOnError
from .base import Storage, WriteBatch

#: Multipart upload tuning for S3 (see docs/remote.md for the measurements behind them).
#: Memory held by one writer stays near ``part_size * (max_in_flight + 1)`` (see _S3Writer).
S3_PART_SIZE = int(os.environ.get("TXCKPT_S3_PART_SIZE", 16 << 20))
S3_MAX_IN_FLIGHT = int(os.environ.get("TXCKPT_S3_MAX_IN_FLIGHT", 4))
#: A file no larger than this goes up as one PutObject at close(); a larger one as a multipart
#: upload that starts once this much is buffered. Default: one full window of parts in flight
#: (``part_size * max_in_flight``), so the memory bound above is unchanged. A whole-file PUT
#: saves the create/complete requests and the server-side assembly of the parts, which is what
#: a file that fits in one window would gain nothing from (benchmarks/s3.py measures both).
S3_MULTIPART_THRESHOLD = int(os.environ.get("TXCKPT_S3_MULTIPART_THRESHOLD", 0)) or None
#: How many closed files of one transaction (``S3Storage.write_batch``) may still be uploading
#: (their single PutObject, or their last parts and CompleteMultipartUpload) while the next file
#: is written; a ``close()`` beyond that waits for the oldest. Each pending file holds at most
#: ``multipart_threshold`` bytes (a PutObject's body) or ``max_in_flight`` parts, so a save holds
#: at most ``pending * 64 MiB`` on top of the writer being filled (defaults). 2 measured faster
#: than 1 against moto (benchmarks/s3.py): the second file's request is prepared (signed,
#: checksummed) while the first one's is still on the wire. 0: every close() waits.
S3_PENDING_FILES = max(0, int(os.environ.get("TXCKPT_S3_PENDING_FILES", 2)))
_S3_MIN_PART = 5 << 20  # S3's minimum size of every part but the last
_S3_MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # DeleteObjects limit


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def _is_s3(fs: Any) -> bool:
    return any(p in ("s3", "s3a") for p in _protocols(fs)) and hasattr(fs, "_call_s3")


def _is_memory(fs: Any) -> bool:
    try:
        from fsspec.implementations.memory import MemoryFileSystem
    except ImportError:  # pragma: no cover
        return False
    return isinstance(fs, MemoryFileSystem)


class FsspecStorage(Storage):
    atomic_dir_rename = False
    overlap_requests = True  # every operation is a round trip to a remote store

    def __new__(cls, url: str, fs: Any, root_path: str):
        if cls is FsspecStorage:
            if _is_s3(fs):
                cls = S3Storage
            elif _is_memory(fs):
                cls = MemoryStorage
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
            return stripped[len(self.root) + 1:]
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

    # ----- reading -----------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        self._fresh(key)
        return self.fs.cat_file(self._p(key))

    def open_read(self, key: str) -> BinaryIO:
        self._fresh(key)
        return self.fs.open(self._p(key), "rb")

    def exists(self, key: str) -> bool:
        self._fresh(key)
        return self.fs.exists(self._p(key))

    def list_dir(self, key: str) -> list[str]:
        self._fresh(key, tree=True)
        try:
            entries = self.fs.ls(self._p(key), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self._p(key).rstrip("/") + "/"
        names = []
        for e in entries:
            e = self.fs._strip_protocol(e).rstrip("/")
            if e.startswith(base):
                names.append(e[len(base):])
        return sorted(n for n in names if n and "/" not in n)

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
                out.append((path[len(base):], int(info.get("size") or 0)))
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


# =================================================================================================
# memory://
# =================================================================================================
class MemoryStorage(FsspecStorage):
    """fsspec's in-process memory filesystem, made to behave like an object store.

    ``MemoryFileSystem.open("wb")`` publishes an empty file at open and fills it in place, and its
    ``"xb"`` is check-then-set: neither is what the contract asks. Here a file is published whole
    by one dict assignment at ``close()``, and create-if-absent is one ``dict.setdefault`` (atomic
    under the GIL), so of several threads exactly one wins. In-process only, by nature.
    """

    overlap_requests = False  # no round trips to hide

    def missing_root(self) -> str | None:
        return None  # memory:// has no buckets: every path can be written

    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        return _MemoryWriter(self.fs, self._p(key))  # type: ignore[return-value]

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        from fsspec.implementations.memory import MemoryFile

        path = self.fs._strip_protocol(self._p(key))
        f = MemoryFile(self.fs, path, bytes(data))
        if self.fs.store.setdefault(path, f) is not f:
            raise FileExistsError(17, "already exists", self.full_path(key))

    def replace(self, key: str, data: bytes, *, durable: bool = False) -> None:
        self.fs.pipe_file(self._p(key), bytes(data))


class _MemoryWriter(AbortOnError, io.RawIOBase):
    def __init__(self, fs: Any, path: str):
        super().__init__()
        self._fs = fs
        self._path = path
        self._buf = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        if self.closed:
            raise ValueError("write to a closed file")
        return self._buf.write(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._fs.pipe_file(self._path, self._buf.getvalue())
            finally:
                self._buf = io.BytesIO()
                super().close()

    def abort(self) -> None:
        self._buf = io.BytesIO()
        super().close()

    def __del__(self):  # an abandoned writer publishes nothing (IOBase.__del__ would close())
        if not self.closed:
            self.abort()


# =================================================================================================
# s3://
# =================================================================================================
def _run(fs: Any, coro, timeout: float | None = None):
    """Run ``coro`` on s3fs's event loop thread and wait for it."""
    from fsspec.asyn import sync

    async def _wrapped():
        return await coro

    return sync(fs.loop, _wrapped, timeout=timeout)


class S3Storage(FsspecStorage):
    """S3 (and S3-compatible stores) through s3fs's async client, never its listing cache.

    Requests per operation (counted against moto by tests/test_storage_contract.py; the table in
    docs/remote.md is the full one):

    =====================  ==========================================================
    create_exclusive       1 PutObject (If-None-Match: *)
    replace                1 PutObject
    open_write (<= thr.)   1 PutObject at close() (thr.: ``multipart_threshold``, 64 MiB)
    open_write (> thr.)    CreateMultipartUpload + N UploadPart + CompleteMultipartUpload;
                           abort(): AbortMultipartUpload (after the parts in flight)
    write_batch()          the same requests; a file's PutObject (or its last parts and
                           CompleteMultipartUpload) runs after close() returns, at most
                           ``S3_PENDING_FILES`` files at once; wait() and cancel() send none
    read_bytes             1 GetObject
    open_read              1 HeadObject + ranged GetObjects
    exists                 1 HeadObject for a file; + 1 ListObjectsV2 otherwise
    list_dir / walk_files  1 ListObjectsV2 per 1000 entries
    delete_file            1 DeleteObject
    delete_tree            ListObjectsV2 pages + DeleteObjects per 1000 keys
                           + 1 ListMultipartUploads (aborting any left under the prefix)
    =====================  ==========================================================
    """

    def __init__(self, url: str, fs: Any, root_path: str):
        super().__init__(url, fs, root_path)
        bucket, prefix, _ = fs.split_path(self.root)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = max(S3_PART_SIZE, _S3_MIN_PART)
        self.max_in_flight = max(1, min(S3_MAX_IN_FLIGHT, getattr(fs, "max_concurrency", 10)))
        self.multipart_threshold = max(S3_MULTIPART_THRESHOLD or self.part_size * self.max_in_flight,
                                       self.part_size)

    # ----- helpers -----------------------------------------------------------------------------
    def _obj(self, key: str) -> str:
        if not key:
            return self.prefix
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dir(self, key: str) -> str:
        obj = self._obj(key)
        return obj + "/" if obj else ""

    def _call(self, method: str, **kwargs):
        return _run(self.fs, self.fs._call_s3(method, Bucket=self.bucket, **kwargs))

    def _list(self, prefix: str, delimiter: str | None) -> Iterator[dict]:
        """Pages of ListObjectsV2 under ``prefix`` (fresh: no cache involved)."""
        kwargs: dict[str, Any] = {"Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        while True:
            page = self._call("list_objects_v2", **kwargs)
            yield page
            if not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def _forget(self, key: str) -> None:
        # Keep s3fs's own cache honest for other users of the same filesystem object.
        try:
            self.fs.invalidate_cache(self._p(key))
        except Exception:  # pragma: no cover
            pass

    # ----- writing -----------------------------------------------------------------------------
    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        return _S3Writer(self, key)  # type: ignore[return-value]

    def write_batch(self) -> WriteBatch:
        """Files closed through the batch finish uploading in the background (at most
        ``S3_PENDING_FILES`` of them, default 2) while the caller writes the next one."""
        return _S3WriteBatch(self, S3_PENDING_FILES)

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        _run(self.fs, self._put_if_absent(self._obj(key), bytes(data)))
        self._forget(key)

    async def _put_if_absent(self, obj: str, data: bytes) -> None:
        """One conditional PutObject, retried on transient failures.

        A retry makes a 412 ambiguous: the earlier attempt may have been applied before its
        answer was lost. Then, and only then, the object is read back: if it holds exactly our
        bytes, our attempt won (txckpt writes a unique id into every such file).
        """
        from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError
        from s3fs.errors import translate_boto_error

        fs = self.fs
        await fs.set_session()
        client = await fs.get_s3(self.bucket)
        method = client.put_object
        # The client is called directly (not through s3fs's retrying wrapper) so that every
        # attempt is known; s3fs's kwargs (SSE, RequestPayer, ...) still apply.
        kwargs = fs._get_s3_method_kwargs(
            method, Bucket=self.bucket, Key=obj, Body=data, IfNoneMatch="*"
        )
        retries = max(int(getattr(fs, "retries", 5)), 1)
        sent_before = False
        last: BaseException | None = None
        for attempt in range(retries):
            if attempt:
                await asyncio.sleep(min(0.1 * 1.7**attempt, 5.0))  # back-off between attempts
            try:
                await method(**kwargs)
                return
            except (EndpointConnectionError, ConnectTimeoutError):
                raise  # never sent, and botocore already retried it (storage/errors.py says so)
            except ClientError as e:
                response = getattr(e, "response", {}) or {}
                code = str(response.get("Error", {}).get("Code", ""))
                status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                retried = response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
                if code == "PreconditionFailed" or status == 412:
                    if sent_before or retried:
                        try:
                            existing = await fs._cat_file(f"{self.bucket}/{obj}", max_concurrency=1)
                        except FileNotFoundError:
                            existing = None
                        if existing == data:
                            return
                    raise FileExistsError(17, "already exists", f"s3://{self.bucket}/{obj}") from None
                if code == "ConditionalRequestConflict" or status == 409 or (
                    isinstance(status, int) and status >= 500
                ) or code in ("SlowDown", "RequestTimeout", "InternalError"):
                    sent_before = True
                    last = e
                    continue
                raise translate_boto_error(e) from e
            except (OSError, asyncio.TimeoutError) as e:
                # Connection-level failure: the request may or may not have been applied.
                sent_before = True
                last = e
                continue
            except Exception as e:  # aiohttp / botocore transport errors
                name = type(e).__name__
                if "Timeout" in name or "Connection" in name or "Payload" in name:
                    sent_before = True
                    last = e
                    continue
                raise
        assert last is not None
        raise last

    def replace(self, key: str, data: bytes, *, durable: bool = False) -> None:
        self._call("put_object", Key=self._obj(key), Body=bytes(data))
        self._forget(key)

    def upload_file(self, local_file: str, key: str, *, durable: bool) -> tuple[int, str]:
        """Read the local file part by part (no extra copy), hash it, upload parts concurrently."""
        return self._upload_file(local_file, key, None)

    def _upload_file(self, local_file: str, key: str, batch: "_S3WriteBatch | None") -> tuple[int, str]:
        from ..checksum import new_hasher
        from ..fileio import open_regular_file

        hasher = new_hasher()
        writer = _S3Writer(self, key, batch)
        ok = False
        size = 0
        try:
            with open_regular_file(local_file, 0) as src:  # a FIFO in the scratch dir never blocks
                while True:
                    block = src.read(writer.next_part_size())
                    if not block:
                        break
                    hasher.update(block)
                    size += len(block)
                    writer.write(block)
            ok = True
        finally:
            if ok:
                writer.close()
            else:
                writer.abort()
        return size, hasher.hexdigest()

    # ----- reading -----------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        async def _get():
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._obj(key))
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        return _run(self.fs, _get())

    def open_read(self, key: str) -> BinaryIO:
        self._forget(key)
        return self.fs.open(self._p(key), "rb")

    def _head(self, key: str) -> dict | None:
        obj = self._obj(key)
        if not obj:
            return None
        try:
            return self._call("head_object", Key=obj)
        except FileNotFoundError:
            return None

    def missing_root(self) -> str | None:
        try:
            self._call("head_bucket")  # 1 HeadBucket
        except FileNotFoundError:
            return f"s3://{self.bucket}"
        return None

    def exists(self, key: str) -> bool:
        if self._head(key) is not None:
            return True
        page = self._call("list_objects_v2", Prefix=self._dir(key), MaxKeys=1)
        return bool(page.get("KeyCount") or page.get("Contents") or page.get("CommonPrefixes"))

    def list_dir(self, key: str) -> list[str]:
        prefix = self._dir(key)
        names: set[str] = set()
        for page in self._list(prefix, "/"):
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(prefix):].rstrip("/")
                if name:
                    names.add(name)
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix):]
                if name and "/" not in name:
                    names.add(name)
        return sorted(names)

    def walk_files(self, key: str) -> Iterator[tuple[str, int]]:
        prefix = self._dir(key)
        out = []
        for page in self._list(prefix, None):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if rel and not rel.endswith("/"):  # skip "directory marker" objects
                    out.append((rel, int(obj.get("Size", 0))))
        return iter(out)

    def modified_time(self, key: str) -> float | None:
        head = self._head(key)
        if head is None or not head.get("LastModified"):
            return None
        return float(head["LastModified"].timestamp())

    # ----- removing ----------------------------------------------------------------------------
    def delete_file(self, key: str) -> None:
        self._call("delete_object", Key=self._obj(key))
        self._forget(key)

    def delete_tree(self, key: str) -> None:
        prefix = self._dir(key)
        batch: list[dict] = []
        if self._obj(key):
            batch.append({"Key": self._obj(key)})  # ``key`` itself may be a file
        for page in self._list(prefix, None):
            for obj in page.get("Contents", []):
                batch.append({"Key": obj["Key"]})
                if len(batch) == _DELETE_BATCH:
                    self._delete_objects(batch)
                    batch = []
        if len(batch) == 1:
            self._call("delete_object", Key=batch[0]["Key"])
        elif batch:
            self._delete_objects(batch)
        # A writer that crashed mid-upload leaves a multipart upload that S3 keeps (and bills)
        # until aborted; the staging tree is the only place txckpt starts them.
        self._abort_uploads(prefix)
        self._fresh(key, tree=True)

    def _delete_objects(self, batch: list[dict]) -> None:
        out = self._call("delete_objects", Delete={"Objects": batch, "Quiet": True})
        errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise OSError(f"S3 refused to delete {len(errors)} object(s), e.g. "
                          f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}")

    def _abort_uploads(self, prefix: str) -> None:
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            page = self._call("list_multipart_uploads", **kwargs)
            for up in page.get("Uploads", []):
                try:
                    self._call("abort_multipart_upload", Key=up["Key"], UploadId=up["UploadId"])
                except FileNotFoundError:
                    pass
            if not page.get("IsTruncated"):
                return
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")


async def _upload_part(fs: Any, bucket: str, key: str, upload_id: str, number: int,
                       body: bytes) -> str:
    out = await fs._call_s3(
        "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
    return out["ETag"]


async def _put_object(fs: Any, bucket: str, key: str, body: io.BytesIO, crc32: int | None = None) -> None:
    """One PutObject of a file-like body, rewound before every attempt. botocore rewinds it
    between its own retries, but s3fs retries a transport error by calling again with the same
    arguments, and botocore sends a file-like body from where it stands: without the rewind, a
    retry after a connection dropped mid-body would store only the rest of the file.

    ``crc32``: the body's CRC32, computed by the writer as the bytes arrived. Sent as the
    request's checksum (S3 refuses a body that does not match it) unless the client is set not
    to send checksums or the user's ``s3_additional_kwargs`` chose one; botocore would otherwise
    compute the same CRC32 by re-reading the whole body on s3fs's event loop, the one thread
    every upload of the process shares."""
    import base64

    from s3fs.core import _error_wrapper

    await fs.set_session()
    client = await fs.get_s3(bucket)
    method = client.put_object
    kwargs = fs._get_s3_method_kwargs(method, Bucket=bucket, Key=key, Body=body)
    sends_checksums = getattr(client.meta.config, "request_checksum_calculation", None) == "when_supported"
    if crc32 is not None and sends_checksums and not any(k.startswith("Checksum") for k in kwargs):
        kwargs["ChecksumCRC32"] = base64.b64encode(crc32.to_bytes(4, "big")).decode()

    async def attempt(**kw):
        body.seek(0)
        return await method(**kw)

    await _error_wrapper(attempt, kwargs=kwargs, retries=fs.retries)


async def _complete_upload(fs: Any, bucket: str, key: str, upload_id: str, etags: dict[int, str],
                           inflight: dict[concurrent.futures.Future, int]) -> None:
    """Wait for the parts in flight, then complete the upload; on any failure abort it (once
    every part has landed or failed), so that nothing remains, and re-raise."""
    try:
        futures = list(inflight)
        results = await asyncio.gather(*[asyncio.wrap_future(f) for f in futures], return_exceptions=True)
        for f, result in zip(futures, results):
            if isinstance(result, BaseException):
                raise result
            etags[inflight[f]] = result
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": parts})
    except BaseException:
        try:
            await _abort_upload(fs, bucket, key, upload_id, [])
        except Exception:  # pragma: no cover - best effort: delete_tree and gc abort it too
            pass
        raise


async def _abort_upload(fs: Any, bucket: str, key: str, upload_id: str,
                        inflight: list[concurrent.futures.Future]) -> None:
    # Let parts already on the wire finish first (at most max_in_flight of them): S3 may keep a
    # part that lands after the abort, and cancelling a request does not unsend it.
    if inflight:
        await asyncio.gather(*[asyncio.wrap_future(f) for f in inflight], return_exceptions=True)
    try:
        await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except FileNotFoundError:
        pass


def _on_loop_thread(fs: Any) -> bool:
    try:
        return asyncio.get_running_loop() is fs.loop
    except RuntimeError:
        return False


class _S3Writer(AbortOnError, io.RawIOBase):
    """Streaming upload of one object, written exactly once (no copy, no rename).

    Bytes are copied once into a buffer (a BytesIO that becomes the request's body as it is) up
    to the storage's ``multipart_threshold`` (default: one window of ``max_in_flight`` parts). A
    file that ends before that is sent as a single PutObject at ``close()``. Otherwise a
    multipart upload starts, the buffer goes out as parts (cut from its end, so that it shrinks
    as they leave), and further parts are uploaded concurrently on s3fs's event loop, at most
    ``max_in_flight`` at a time (``write`` waits for a slot), so memory stays near
    ``part_size * (max_in_flight + 1)`` (at the switch to parts, plus the buffer's allocation
    slack, at most an eighth of the threshold).
    ``close()`` uploads the last part and completes the upload: the object appears whole, at once.
    ``abort()`` (or a failing ``close()``) aborts the multipart upload: nothing remains.

    A writer of a :class:`_S3WriteBatch` does not wait at ``close()``: its PutObject (or its
    last parts and CompleteMultipartUpload) runs on the event loop while the caller goes on, and
    the batch's ``wait()`` reports the outcome. Before it hands its upload over, ``close()``
    waits until fewer than the batch's ``max_pending`` uploads are pending.

    Part sizes double every 2000 parts so that a stream of unknown length stays within S3's 10000
    parts (16 MiB parts reach ~1 TiB); ``fixed_upload_size=True`` (Cloudflare R2) keeps them equal.
    """

    def __init__(self, storage: S3Storage, key: str, batch: "_S3WriteBatch | None" = None):
        super().__init__()
        self._st = storage
        self._batch = batch if batch is not None and batch.max_pending > 0 else None
        self._fs = storage.fs
        self._key = key
        self._obj = storage._obj(key)
        # Until the file outgrows one PutObject, its bytes are copied once, into ``_head``, which
        # is the request's body as it is (a BytesIO: botocore and aiohttp read a file-like body in
        # chunks, while a bytearray body would be copied whole into the socket's send buffer).
        # After that, ``_pieces`` holds what is not sent yet.
        self._head: io.BytesIO | None = io.BytesIO()
        self._pieces: collections.deque = collections.deque()  # bytes or memoryviews of bytes
        self._buffered = 0
        self._upload_id: str | None = None
        self._etags: dict[int, str] = {}
        self._inflight: dict[concurrent.futures.Future, int] = {}
        self._next_part = 1
        self._fixed = bool(getattr(self._fs, "fixed_upload_size", False))
        self._crc32 = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def next_part_size(self) -> int:
        base = self._st.part_size
        if self._fixed:
            return base
        return base << min((self._next_part - 1) // 2000, 8)

    # ----- writing -------------------------------------------------------------------------------
    def write(self, data) -> int:  # type: ignore[override]
        if self.closed:
            raise ValueError("write to a closed file")
        head = self._head
        if head is not None:  # may still end as one PutObject
            view = data if isinstance(data, (bytes, bytearray)) else memoryview(data).cast("B")
            n = len(view)
            if self.size + n <= self._st.multipart_threshold:
                head.write(view)  # the caller may reuse its buffer: copied, once
                self._crc32 = zlib.crc32(view, self._crc32)  # while the bytes are in cache
                self.size += n
                return n
            # Too large for one PutObject: a multipart upload.
            self._head = None
            self._parts_from_head(head)
        if isinstance(data, bytes):
            piece = data
        else:
            piece = bytes(memoryview(data).cast("B"))  # the caller may reuse its buffer
        n = len(piece)
        if not n:
            return 0
        self._pieces.append(piece)
        self._buffered += n
        self.size += n
        while self._buffered >= self.next_part_size():
            self._send_part(self._take(self.next_part_size()))
        return n

    def _parts_from_head(self, head: io.BytesIO) -> None:
        """Send the head's full parts, cut from its end so that it shrinks as they leave (memory
        stays near ``part_size * (max_in_flight + 1)``); its remainder begins the next part."""
        size, part = head.getbuffer().nbytes, self.next_part_size()
        full = size // part
        if size > full * part:
            head.seek(full * part)
            self._pieces.append(head.read())
            self._buffered += size - full * part
        self._next_part = full + 1
        for number in range(full, 0, -1):
            head.seek((number - 1) * part)
            body = head.read(part)
            head.truncate((number - 1) * part)
            self._send_part(body, number)

    def _take(self, n: int) -> bytes:
        """The first ``n`` buffered bytes, each copied at most once.

        Pieces are ``bytes`` (immutable: kept by reference) or memoryviews into them, so a huge
        single ``write()`` is cut into parts without re-copying its remainder each time."""
        pieces = self._pieces
        first = pieces[0]
        if len(first) == n:
            pieces.popleft()
            self._buffered -= n
            return first if isinstance(first, bytes) else bytes(first)
        taken: list = []
        need = n
        while need:
            piece = pieces[0]
            if len(piece) <= need:
                taken.append(pieces.popleft())
                need -= len(piece)
            else:
                view = piece if isinstance(piece, memoryview) else memoryview(piece)
                taken.append(view[:need])
                pieces[0] = view[need:]
                need = 0
        self._buffered -= n
        return b"".join(taken)

    def _send_part(self, body: bytes, number: int | None = None) -> None:
        if self._upload_id is None:
            out = _run(self._fs, self._fs._call_s3(
                "create_multipart_upload", Bucket=self._st.bucket, Key=self._obj))
            self._upload_id = out["UploadId"]
        self._wait(self._st.max_in_flight - 1)
        if number is None:
            number = self._next_part
            self._next_part += 1
        if number > _S3_MAX_PARTS:
            raise OSError(f"{self._st.full_path(self._key)}: more than {_S3_MAX_PARTS} parts")
        # The coroutine must not reference the writer, so that an abandoned writer is collected
        # (and its upload aborted, see __del__) in the thread that drops it.
        coro = _upload_part(self._fs, self._st.bucket, self._obj, self._upload_id, number, body)
        self._inflight[asyncio.run_coroutine_threadsafe(coro, self._fs.loop)] = number

    def _wait(self, at_most: int) -> None:
        """Block until at most ``at_most`` parts are in flight; re-raise a part's failure."""
        while len(self._inflight) > at_most:
            done, _ = concurrent.futures.wait(
                list(self._inflight), return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                number = self._inflight.pop(f)
                self._etags[number] = f.result()

    def flush(self) -> None:
        pass  # parts go out when full; close() completes the object

    # ----- finishing -----------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._batch is not None:
                self._batch.admit()  # at most max_pending uploads; an earlier file's failure raises here
            bucket = self._st.bucket
            if self._head is not None:
                body, self._head = self._head, None
                coro = _put_object(self._fs, bucket, self._obj, body, self._crc32)
            else:
                if self._buffered:
                    self._send_part(self._take(self._buffered))
                inflight, self._inflight = self._inflight, {}
                # From here the coroutine owns the upload: it completes it, or aborts it on failure.
                coro = _complete_upload(self._fs, bucket, self._obj, self._upload_id, self._etags, inflight)
                self._upload_id = None
            if self._batch is None:
                _run(self._fs, coro)
            else:
                self._batch.submit(self._key, asyncio.run_coroutine_threadsafe(coro, self._fs.loop))
        except BaseException:
            self._discard()
            super().close()
            raise
        self._pieces = collections.deque()
        self._st._forget(self._key)
        super().close()

    def abort(self) -> None:
        if self.closed:
            return
        try:
            self._discard()
        finally:
            super().close()

    def _discard(self, timeout: float | None = None) -> None:
        self._head = None
        self._pieces = collections.deque()
        self._buffered = 0
        inflight, self._inflight = list(self._inflight), {}
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        abort = _abort_upload(self._fs, self._st.bucket, self._obj, upload_id, inflight)
        if _on_loop_thread(self._fs):  # a writer collected by the event loop thread itself
            asyncio.ensure_future(abort)
        else:
            _run(self._fs, abort, timeout=timeout)

    def __del__(self):  # an abandoned writer must not leave an upload running
        if sys.is_finalizing():  # the event loop thread may be gone: gc reclaims the upload
            return
        try:
            if not self.closed:
                self._discard(timeout=60)
        except Exception:
            pass


class _S3WriteBatch(WriteBatch):
    """The staging files of one transaction on S3: each file's final request(s) run in the
    background while the next file is serialised (see :class:`txckpt.storage.base.WriteBatch`).

    At most ``max_pending`` closed files are uploading at once (``S3_PENDING_FILES``, default 2):
    on top of the writer being filled (below ``part_size * (max_in_flight + 1)``), memory holds
    at most ``max_pending`` bodies of up to ``multipart_threshold`` bytes, or their last
    ``max_in_flight`` parts. ``max_pending=0`` uploads synchronously, as without a batch.
    """

    def __init__(self, storage: S3Storage, max_pending: int):
        super().__init__(storage)
        self.max_pending = max_pending
        self._pending: collections.deque = collections.deque()  # (key, Future), oldest first
        self._failure: OSError | None = None

    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        return _S3Writer(self.storage, key, self)  # type: ignore[arg-type, return-value]

    def upload_file(self, local_file: str, key: str, *, durable: bool) -> tuple[int, str]:
        return self.storage._upload_file(local_file, key, self)  # type: ignore[attr-defined]

    def submit(self, key: str, future: concurrent.futures.Future) -> None:
        self._pending.append((key, future))

    def admit(self) -> None:
        """Called by a closing writer before it submits: wait for room, raise an earlier failure."""
        while len(self._pending) >= self.max_pending:
            self._settle_oldest()
        if self._failure is not None:
            raise self._failure

    def _settle_oldest(self) -> None:
        key, future = self._pending[0]
        try:
            future.result()
        except BaseException as e:
            if self._failure is None:
                self._failure = _upload_failure(self.storage.full_path(key), e)
        finally:
            self._pending.popleft()

    def wait(self) -> None:
        while self._pending:
            self._settle_oldest()
        if self._failure is not None:
            raise self._failure

    def cancel(self) -> None:
        while self._pending:
            self._settle_oldest()


def _upload_failure(path: str, e: BaseException) -> OSError:
    """An OSError naming the file whose background upload failed. Its errno is the error's own,
    or the one its class stands for (s3fs raises ``PermissionError(message)`` without one), so
    ``OSError(errno, ...)`` is again a PermissionError and ``storage_error`` gives its advice."""
    import errno

    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if not code:
        code = next((c for cls, c in ((PermissionError, errno.EACCES), (FileNotFoundError, errno.ENOENT),
                                      (FileExistsError, errno.EEXIST)) if isinstance(e, cls)), errno.EIO)
    err = OSError(code, f"upload of {path} failed: {e}")
    err.__cause__ = e
    return err
