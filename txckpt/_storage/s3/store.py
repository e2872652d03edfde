"""S3 (and S3-compatible stores) through s3fs's async client: the commit point is one
``PutObject`` with ``If-None-Match: *``, sent and retried by txckpt itself; data files are streamed
by :mod:`txckpt._storage.s3.upload`."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence, TypeVar

from ..._base import deps
from ..._base.checksum import copy_hashing
from ..._base.fileio import BufferRead, open_regular_file
from ..base import WriteBatch
from ..errors import log_retries
from ..fsspec.store import FsspecStorage
from .download import RangeIgnored, ranged_copy, ranged_read, ranged_to_file, whole_object
from .upload import run_on_loop, S3Writer, S3WriteBatch

log = logging.getLogger("txckpt")
_T = TypeVar("_T")

#: Multipart upload tuning for S3 (see docs/remote.md for the measurements behind them).
#: Memory held by one writer stays near ``part_size * (max_in_flight + 1)`` (see S3Writer).
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
#: A verified read of a file larger than one part (a load, a fetch, the DCP reader) is that many
#: ranged GETs of this size, at most ``S3_READ_IN_FLIGHT`` at once, straight into the file's
#: buffer and hashed as they land (s3_download.py; benchmarks/s3load.py measures them).
S3_READ_PART = int(os.environ.get("TXCKPT_S3_READ_PART", 16 << 20))
S3_READ_IN_FLIGHT = int(os.environ.get("TXCKPT_S3_READ_IN_FLIGHT", 8))
_S3_MIN_PART = 5 << 20  # S3's minimum size of every part but the last
_DELETE_BATCH = 1000  # DeleteObjects limit


def _parent_dirs(obj: str, prefix: str) -> list[str]:
    """The directory keys (``a/b/``) between ``prefix`` (which ends in ``/``) and object ``obj``."""
    rest = obj[len(prefix) :].split("/")[:-1]
    return [prefix + "/".join(rest[: i + 1]) + "/" for i in range(len(rest))]


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
    list_dir / walk_files  1 ListObjectsV2 per 1000 entries (list_subdirs: the same)
    delete_file            1 DeleteObject
    delete_tree            ListObjectsV2 pages + DeleteObjects per 1000 keys
                           + 1 ListMultipartUploads (aborting any left under the prefix)
    list_incomplete_...    1 ListMultipartUploads per 1000 uploads
    abort_incomplete_...   1 AbortMultipartUpload per upload
    =====================  ==========================================================
    """

    @classmethod
    def handles(cls, fs: Any) -> bool:
        p = fs.protocol
        protocols = tuple(p) if isinstance(p, (tuple, list)) else (p,)
        return any(p in ("s3", "s3a") for p in protocols) and hasattr(fs, "_call_s3")

    def __init__(self, url: str, fs: Any, root_path: str):
        super().__init__(url, fs, root_path)
        bucket, prefix, _ = fs.split_path(self.root)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = max(S3_PART_SIZE, _S3_MIN_PART)
        self.max_in_flight = max(1, min(S3_MAX_IN_FLIGHT, getattr(fs, "max_concurrency", 10)))
        self.multipart_threshold = max(S3_MULTIPART_THRESHOLD or self.part_size * self.max_in_flight, self.part_size)
        log_retries(fs)  # what botocore retries is logged while it retries (storage/errors.py)
        # Set once a ranged GET came back 200 with the whole object (_ranged): read in one GET.
        self._ranges_ignored = False

    def identity(self) -> str:
        # Every object is under bucket/prefix, the prefix stripped of slashes (``s3://b//a`` is ``s3://b/a``).
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    # ----- helpers -----------------------------------------------------------------------------
    def _obj(self, key: str) -> str:
        if not key:
            return self.prefix
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dir(self, key: str) -> str:
        obj = self._obj(key)
        return obj + "/" if obj else ""

    def _call(self, method: str, **kwargs):
        return run_on_loop(self.fs, self.fs._call_s3(method, Bucket=self.bucket, **kwargs))

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
        return S3Writer(self, key)  # type: ignore[return-value]

    def write_batch(self) -> WriteBatch:
        """Files closed through the batch finish uploading in the background (at most
        ``S3_PENDING_FILES`` of them, default 2) while the caller writes the next one."""
        return S3WriteBatch(self, S3_PENDING_FILES)

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        run_on_loop(self.fs, self._put_if_absent(self._obj(key), bytes(data)))
        self._forget(key)

    async def _put_if_absent(self, obj: str, data: bytes) -> None:
        """One conditional PutObject, retried on transient failures.

        A retry makes a 412 ambiguous: the earlier attempt may have been applied before its
        answer was lost. Then, and only then, the object is read back: if it holds exactly our
        bytes, our attempt won (txckpt writes a unique id into every such file).
        """
        botocore = deps.botocore_exceptions
        ClientError, ConnectTimeoutError, EndpointConnectionError = (
            botocore.ClientError,
            botocore.ConnectTimeoutError,
            botocore.EndpointConnectionError,
        )
        translate_boto_error = deps.s3fs.errors.translate_boto_error
        fs = self.fs
        await fs.set_session()
        client = await fs.get_s3(self.bucket)
        method = client.put_object
        # The client is called directly (not through s3fs's retrying wrapper) so that every
        # attempt is known; s3fs's kwargs (SSE, RequestPayer, ...) still apply.
        kwargs = fs._get_s3_method_kwargs(method, Bucket=self.bucket, Key=obj, Body=data, IfNoneMatch="*")
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
                if (
                    code == "ConditionalRequestConflict"
                    or status == 409
                    or (isinstance(status, int) and status >= 500)
                    or code in ("SlowDown", "RequestTimeout", "InternalError")
                ):
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

    def upload_file(
        self, local_file: str, key: str, *, durable: bool, tap: Callable[[memoryview], Any] | None = None
    ) -> tuple[int, str]:
        """Read the local file part by part (no extra copy), hash it, upload parts concurrently."""
        return self._upload_file(local_file, key, None, tap)

    def _upload_file(
        self, local_file: str, key: str, batch: "S3WriteBatch | None", tap: Callable[[memoryview], Any] | None = None
    ) -> tuple[int, str]:
        writer = S3Writer(self, key, batch)
        ok = False
        try:
            with open_regular_file(local_file, 0) as src:  # a FIFO in the scratch dir never blocks
                # Blocks of one part each, written whole: the writer keeps them as its parts (no copy).
                size, digest = copy_hashing(src, writer, chunk=writer.next_part_size, tap=tap)
            ok = True
        finally:
            if ok:
                writer.close()
            else:
                writer.abort()
        return size, digest

    # ----- reading -----------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        async def _get():
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._obj(key))
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        return run_on_loop(self.fs, _get())

    def open_read(self, key: str) -> BinaryIO:
        self._forget(key)
        return self.fs.open(self._p(key), "rb")

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """One ranged GetObject per range, concurrently: s3fs's file read-ahead would fetch
        from the first offset to the end of the object (a Merkle proof's 16-byte nodes are
        spread over the whole tree file)."""
        obj = self._obj(key)

        async def _get(offset: int, length: int) -> bytes:
            if length <= 0:
                return b""
            resp = await self.fs._call_s3(
                "get_object", Bucket=self.bucket, Key=obj, Range=f"bytes={offset}-{offset + length - 1}"
            )
            try:
                if whole_object(resp):  # a server that ignores Range (HTTP allows it): cut it out
                    return (await resp["Body"].read())[offset : offset + length]
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        async def _all() -> list[bytes]:
            return list(await asyncio.gather(*(_get(o, n) for o, n in ranges)))

        return run_on_loop(self.fs, _all()) if ranges else []

    def start_read(self, key: str, size: int, *, hash: bool) -> BufferRead | None:
        if size <= S3_READ_PART or self._ranges_ignored:
            return None  # one GET (read_bytes) is as fast, in one request
        return self._ranged(
            key,
            lambda: ranged_read(
                self.fs, self.bucket, self._obj(key), size, hash=hash, part=S3_READ_PART, in_flight=S3_READ_IN_FLIGHT
            ),
        )

    def read_through(self, key: str, size: int, write: Callable[[memoryview], Any]) -> tuple[int, str] | None:
        if size <= S3_READ_PART or self._ranges_ignored:
            return None  # one GET streamed is as fast, in one request
        return self._ranged(
            key,
            lambda: ranged_copy(
                self.fs, self.bucket, self._obj(key), size, write, part=S3_READ_PART, in_flight=S3_READ_IN_FLIGHT
            ),
        )

    def read_to_file(
        self, key: str, size: int, fd: int, progress: Callable[[int], Any] | None = None
    ) -> tuple[int, str] | None:
        if size <= S3_READ_PART or self._ranges_ignored:
            return None  # one GET streamed is as fast, in one request
        return self._ranged(
            key,
            lambda: ranged_to_file(
                self.fs,
                self.bucket,
                self._obj(key),
                size,
                fd,
                part=S3_READ_PART,
                in_flight=S3_READ_IN_FLIGHT,
                progress=progress,
            ),
        )

    def _ranged(self, key: str, read: Callable[[], _T]) -> _T | None:
        """``read()``, a download in ranged parts; None (the caller reads the object in one plain
        GET) where the server answered the first range with the whole object: its bytes are
        not damaged, only unranged. From then on this storage asks for no range."""
        try:
            return read()
        except RangeIgnored as e:
            if not self._ranges_ignored:
                log.warning(
                    "%s: %s; the server (or a proxy before it) ignores Range headers: reading "
                    "each file of %s in one GET instead of parallel parts",
                    self.url,
                    e,
                    self.url,
                )
            self._ranges_ignored = True
            return None

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

    def _children(self, key: str) -> list[tuple[str, bool]]:
        # list_dir and list_subdirs (FsspecStorage's) read this: one ListObjectsV2 per 1000 names,
        # never s3fs's listing cache. A common prefix is a "directory" (objects under it); an
        # object is a file.
        prefix = self._dir(key)
        out: set[tuple[str, bool]] = set()
        for page in self._list(prefix, "/"):
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(prefix) :].rstrip("/")
                if name:
                    out.add((name, True))
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if name and "/" not in name:
                    out.add((name, False))
        return list(out)

    def walk_files(self, key: str) -> Iterator[tuple[str, int]]:
        prefix = self._dir(key)
        out = []
        for page in self._list(prefix, None):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
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
        dirs: set[str] = set()
        for page in self._list(prefix, None):
            for obj in page.get("Contents", []):
                batch.append({"Key": obj["Key"]})
                dirs.update(_parent_dirs(obj["Key"], prefix))
                if len(batch) == _DELETE_BATCH:
                    self._delete_objects(batch)
                    batch = []
        if dirs:
            # Stores with a real namespace behind their S3 API (SeaweedFS's filer) keep each
            # emptied directory, and list it as a common prefix: a deleted tree would still be
            # listed. Deleting the directories' keys, deepest first and after every object (one
            # batch is applied in order), removes them; on S3 itself these keys do not exist and
            # the deletes are no-ops in the same request.
            dirs.add(prefix)
            for d in sorted(dirs, key=lambda d: (-d.count("/"), d)):
                batch.append({"Key": d})
                if len(batch) == _DELETE_BATCH:
                    self._delete_objects(batch)
                    batch = []
        if len(batch) == 1:
            self._call("delete_object", Key=batch[0]["Key"])
        elif batch:
            self._delete_objects(batch)
        # A writer that crashed mid-upload leaves a multipart upload that S3 keeps (and bills)
        # until aborted; the staging tree is the only place txckpt starts them.
        self.abort_incomplete_uploads(self.list_incomplete_uploads(key))
        self._fresh(key, tree=True)

    def _delete_objects(self, batch: list[dict]) -> None:
        out = self._call("delete_objects", Delete={"Objects": batch, "Quiet": True})
        errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise OSError(
                f"S3 refused to delete {len(errors)} object(s), e.g. "
                f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
            )

    def list_incomplete_uploads(self, under: str = "") -> list[dict[str, Any]]:
        """ListMultipartUploads pages below ``under`` (fresh: no cache involved)."""
        base, kwargs = self._dir(""), {"Prefix": self._dir(under)}
        out: list[dict[str, Any]] = []
        while True:
            page = self._call("list_multipart_uploads", **kwargs)
            for up in page.get("Uploads", []) or []:
                obj = up["Key"]
                out.append(
                    {
                        "key": obj[len(base) :] if obj.startswith(base) else obj,
                        "object": obj,
                        "upload_id": up["UploadId"],
                        "initiated": up.get("Initiated"),
                    }
                )
            if not page.get("IsTruncated"):
                return out
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def abort_incomplete_uploads(self, uploads: Sequence[Mapping[str, Any]]) -> None:
        """One AbortMultipartUpload per upload, in order."""
        for up in uploads:
            obj = up.get("object") or self._obj(str(up["key"]))
            try:
                self._call("abort_multipart_upload", Key=obj, UploadId=up["upload_id"])
            except FileNotFoundError:
                pass  # completed or aborted meanwhile
