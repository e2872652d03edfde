"""Uploads to S3 through s3fs's event loop: one object streamed as a single PutObject or a
concurrent multipart upload (:class:`S3Writer`), and the files of one transaction finishing in
the background (:class:`S3WriteBatch`). Used by :class:`txckpt._storage.s3.store.S3Storage`, which
passes itself as ``storage`` (its ``fs``, ``bucket``, ``part_size``, ``max_in_flight``,
``multipart_threshold``, ``_obj``, ``_forget``, ``full_path``, ``_upload_file``): this module does
not import it.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import errno
import io
import sys
import zlib
from typing import Any, BinaryIO, Callable, Protocol

from ..._base import deps
from ..._base.checksum import AbortOnError
from ..base import Storage, WriteBatch

_S3_MAX_PARTS = 10_000


def run_on_loop(fs: Any, coro, timeout: float | None = None):
    """Run ``coro`` on s3fs's event loop thread and wait for it."""

    async def _wrapped():
        return await coro

    return deps.fsspec_asyn.sync(fs.loop, _wrapped, timeout=timeout)


async def _upload_part(fs: Any, bucket: str, key: str, upload_id: str, number: int, body: bytes) -> str:
    out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
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
    _error_wrapper = deps.s3fs.core._error_wrapper
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


async def _complete_upload(
    fs: Any,
    bucket: str,
    key: str,
    upload_id: str,
    etags: dict[int, str],
    inflight: dict[concurrent.futures.Future, int],
) -> None:
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
        await fs._call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        try:
            await _abort_upload(fs, bucket, key, upload_id, [])
        except Exception:  # pragma: no cover - best effort: delete_tree and gc abort it too
            pass
        raise


async def _abort_upload(
    fs: Any, bucket: str, key: str, upload_id: str, inflight: list[concurrent.futures.Future]
) -> None:
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


class S3Target(Protocol):
    """What a writer uses of its :class:`txckpt._storage.s3.store.S3Storage` (which imports this module)."""

    fs: Any
    bucket: str
    part_size: int
    multipart_threshold: int
    max_in_flight: int

    def full_path(self, key: str) -> str: ...

    def _obj(self, key: str) -> str: ...

    def _forget(self, key: str) -> None: ...


class S3Writer(AbortOnError, io.RawIOBase):
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

    A writer of a :class:`S3WriteBatch` does not wait at ``close()``: its PutObject (or its
    last parts and CompleteMultipartUpload) runs on the event loop while the caller goes on, and
    the batch's ``wait()`` reports the outcome. Before it hands its upload over, ``close()``
    waits until fewer than the batch's ``max_pending`` uploads are pending.

    Part sizes double every 2000 parts so that a stream of unknown length stays within S3's 10000
    parts (16 MiB parts reach ~1 TiB); ``fixed_upload_size=True`` (Cloudflare R2) keeps them equal.
    """

    def __init__(self, storage: "S3Target", key: str, batch: "S3WriteBatch | None" = None):
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
    def write(self, data) -> int:
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
            out = run_on_loop(
                self._fs, self._fs._call_s3("create_multipart_upload", Bucket=self._st.bucket, Key=self._obj)
            )
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
            done, _ = concurrent.futures.wait(list(self._inflight), return_when=concurrent.futures.FIRST_COMPLETED)
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
                upload_id = self._upload_id
                # Past its head a writer has sent a part, which started the multipart upload.
                assert upload_id is not None
                # From here the coroutine owns the upload: it completes it, or aborts it on failure.
                coro = _complete_upload(self._fs, bucket, self._obj, upload_id, self._etags, inflight)
                self._upload_id = None
            if self._batch is None:
                run_on_loop(self._fs, coro)
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
            # No reference kept (RUF006): the loop holds tasks weakly, so this abort may be collected
            # unfinished; the upload is then left to Storage.abort_incomplete_uploads.
            asyncio.ensure_future(abort)  # noqa: RUF006
        else:
            run_on_loop(self._fs, abort, timeout=timeout)

    def __del__(self):  # an abandoned writer must not leave an upload running
        if sys.is_finalizing():  # the event loop thread may be gone: gc reclaims the upload
            return
        try:
            if not self.closed:
                self._discard(timeout=60)
        except Exception:
            pass


class S3WriteBatch(WriteBatch):
    """The staging files of one transaction on S3: each file's final request(s) run in the
    background while the next file is serialised (see :class:`txckpt._storage.base.WriteBatch`).

    At most ``max_pending`` closed files are uploading at once (``S3_PENDING_FILES``, default 2):
    on top of the writer being filled (below ``part_size * (max_in_flight + 1)``), memory holds
    at most ``max_pending`` bodies of up to ``multipart_threshold`` bytes, or their last
    ``max_in_flight`` parts. ``max_pending=0`` uploads synchronously, as without a batch.
    """

    def __init__(self, storage: Storage, max_pending: int):
        super().__init__(storage)
        self._target: S3Target = storage  # type: ignore[assignment]  # an S3Storage, which makes the batch
        self.max_pending = max_pending
        self._pending: collections.deque = collections.deque()  # (key, Future), oldest first
        self._failure: OSError | None = None

    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        return S3Writer(self._target, key, self)  # type: ignore[return-value]

    def upload_file(
        self, local_file: str, key: str, *, durable: bool, tap: Callable[[memoryview], Any] | None = None
    ) -> tuple[int, str]:
        return self.storage._upload_file(local_file, key, self, tap)  # type: ignore[attr-defined]

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
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if not code:
        code = next(
            (
                c
                for cls, c in (
                    (PermissionError, errno.EACCES),
                    (FileNotFoundError, errno.ENOENT),
                    (FileExistsError, errno.EEXIST),
                )
                if isinstance(e, cls)
            ),
            errno.EIO,
        )
    err = OSError(code, f"upload of {path} failed: {e}")
    err.__cause__ = e
    return err
