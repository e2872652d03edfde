"""What the stack below a remote root raises, as txckpt's typed errors.

s3fs and botocore raise ``NoCredentialsError``, ``EndpointConnectionError`` (after botocore's
own retries) and a bare ``FileNotFoundError("The specified bucket does not exist")`` that names
no bucket and looks like a missing key. :func:`translate` maps them to
:class:`~txckpt.errors.CredentialsError`, :class:`~txckpt.errors.EndpointUnreachableError` and
:class:`~txckpt.errors.RootNotFoundError`, each naming the root, the bucket or the endpoint and
saying what to do. :func:`map_errors` applies it at the storage seam: every operation of every
``Storage`` class (``Storage.__init_subclass__`` calls it), so no caller above the seam sees a
third-party exception for these, and no backend needs its own branch for them.

Everything else passes through unchanged, the exception itself (a missing key stays
``FileNotFoundError``, a 403 stays ``PermissionError``). Third-party types are recognised by
module and class name, so a local root never imports botocore.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from ..errors import CredentialsError, EndpointUnreachableError, RootNotFoundError, TxckptError

#: The Storage methods that talk to the backend; map_errors wraps these.
OPERATIONS = (
    "open_write", "create_exclusive", "replace", "upload_file", "read_bytes", "open_read",
    "exists", "list_dir", "walk_files", "modified_time", "delete_file", "delete_tree",
    "rename_noreplace", "missing_root",
)

_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "NoAuthTokenError"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError"}

_S3_HOWTO = "see 'Using a remote root' in docs/remote.md"


def map_errors(cls: type) -> None:
    """Wrap the backend operations that ``cls`` itself defines so that they raise
    :func:`translate`'s errors. Idempotent: a wrapped method is not wrapped again."""
    for name in OPERATIONS:
        fn = cls.__dict__.get(name)
        if callable(fn) and not getattr(fn, "_txckpt_mapped", False):
            setattr(cls, name, _mapped(fn))


def _mapped(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def operation(self, *args: Any, **kwargs: Any):
        started = time.monotonic()
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:
            mapped = translate(e, self, time.monotonic() - started)
            if mapped is None:
                raise
            raise mapped from e

    operation._txckpt_mapped = True  # type: ignore[attr-defined]
    return operation


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and what it was raised from (s3fs raises its translation from the ClientError;
    only ``__cause__`` is followed: an exception merely raised while handling another is not
    that one)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__ if c.__module__.startswith("botocore")}


def translate(e: BaseException, storage: Any, seconds: float = 0.0) -> BaseException | None:
    """The typed txckpt error for ``e``, raised by an operation of ``storage`` that ran for
    ``seconds``; None when ``e`` is not one of the cases above (raise it as it is)."""
    if isinstance(e, TxckptError):
        return None
    for cause in _chain(e):
        names = _names(cause)
        if not names:
            continue
        root = getattr(storage, "url", None)
        endpoint = endpoint_of(storage)
        where = f"endpoint {endpoint}" if endpoint else "AWS's default endpoint (no endpoint_url given)"
        if names & _NO_CREDENTIALS:
            return CredentialsError(
                f"no credentials for {root} ({where}): {cause}. Set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or a profile (AWS_PROFILE, or storage option profile=NAME), "
                "or pass storage options key= and secret= (CLI: -o key=... -o secret=...); "
                f"{_S3_HOWTO}", root=root, endpoint=endpoint)
        if names & _UNREACHABLE:
            endpoint = _base_url(getattr(cause, "kwargs", {}).get("endpoint_url")) or endpoint
            attempts = _attempts(storage)
            return EndpointUnreachableError(
                f"cannot connect to {endpoint or where} for {root}: {attempts} attempts failed in "
                f"{seconds:.1f} s ({cause}). Check the endpoint (storage option "
                "client_kwargs={\"endpoint_url\": URL}, CLI -o endpoint_url=URL, or AWS_ENDPOINT_URL) "
                "and that the server is running; AWS_MAX_ATTEMPTS=N sets the attempts; "
                f"{_S3_HOWTO}", root=root, endpoint=endpoint, attempts=attempts, seconds=seconds)
        response = getattr(cause, "response", None) or {}
        if response.get("Error", {}).get("Code") == "NoSuchBucket":
            bucket = getattr(storage, "bucket", None) or response["Error"].get("BucketName")
            bucket_url = f"s3://{bucket}" if bucket else None
            return RootNotFoundError(
                f"the bucket {bucket_url} of the root {root} does not exist at {where}: check the "
                "bucket name, the endpoint and the region, or create the bucket (txckpt never "
                f"creates one); {_S3_HOWTO}", root=root, bucket=bucket_url)
    return None


def endpoint_of(storage: Any) -> str | None:
    """The endpoint URL the storage's client uses (None: the provider's default)."""
    fs = getattr(storage, "fs", None)
    client = getattr(fs, "_s3", None)
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    if url is None and fs is not None:
        url = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return _base_url(url)


def _base_url(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url


def _attempts(storage: Any) -> int:
    """How many attempts botocore makes per request, as its client is configured
    (``AWS_MAX_ATTEMPTS`` / ``config_kwargs={"retries": ...}``; legacy mode: 5, else 3)."""
    client = getattr(getattr(storage, "fs", None), "_s3", None)
    retries = getattr(getattr(getattr(client, "meta", None), "config", None), "retries", None) or {}
    if retries.get("total_max_attempts") is not None:
        return int(retries["total_max_attempts"])
    if retries.get("max_attempts") is not None:
        return int(retries["max_attempts"]) + 1
    return 5 if retries.get("mode", "legacy") == "legacy" else 3
