"""What the stack below a remote root raises, as txckpt's typed errors.

Each client stack says the same three things its own way:

- no (or bad) credentials: botocore's ``NoCredentialsError`` & co.; google-auth's
  ``DefaultCredentialsError``/``RefreshError`` and a 401 from gcsfs; azure-core's
  ``ClientAuthenticationError`` and a 403 ``AuthenticationFailed`` -> :class:`CredentialsError`;
- no connection: botocore's ``EndpointConnectionError`` (after its own retries), aiohttp's
  ``ClientConnectorError`` (gcsfs), azure-core's ``ServiceRequestError`` (after the Azure SDK's
  retries) -> :class:`EndpointUnreachableError`;
- no bucket: S3's ``NoSuchBucket``, Azure's ``ContainerNotFound``, and gcsfs's bare
  ``FileNotFoundError(url)`` for an upload into a bucket that does not exist (it names no bucket
  and looks like a missing key: a write that finds nothing is told apart by asking the backend,
  ``missing_root``) -> :class:`RootNotFoundError`.

Each names the root, the bucket or the endpoint, and says what to do. :func:`map_errors` applies
:func:`translate` at the storage seam: every operation of every ``Storage`` class
(``Storage.__init_subclass__`` calls it), so no caller above the seam sees a third-party exception
for these, and no backend needs its own branch for them.

Everything else passes through unchanged, the exception itself (a missing key stays
``FileNotFoundError``, a 403 stays ``PermissionError``). Third-party types are recognised by
module and class name, so a local root imports none of these clients.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any, Callable, Iterator, Protocol
from urllib.parse import urlsplit

from .._base import deps
from ..errors import CredentialsError, EndpointUnreachableError, RootNotFoundError, TxckptError


class Backend(Protocol):
    """What the mapping reads of a storage (``storage.base.Storage``, which imports this module);
    the rest (its client, ``fs``, ``bucket``) it looks up with ``getattr``, backend by backend."""

    url: str

    def missing_root(self) -> str | None: ...


#: The Storage methods that talk to the backend; map_errors wraps these.
OPERATIONS = (
    "open_write",
    "create_exclusive",
    "replace",
    "upload_file",
    "read_bytes",
    "open_read",
    "exists",
    "list_dir",
    "list_subdirs",
    "walk_files",
    "modified_time",
    "delete_file",
    "delete_tree",
    "rename_noreplace",
    "missing_root",
)

#: Exception classes by the module their client defines them in (its prefix) -> what they mean.
_NO_CREDENTIALS = {
    "botocore": {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError"},
    "google.auth": {"DefaultCredentialsError", "RefreshError"},
    "azure.core": {"ClientAuthenticationError"},
}
_UNREACHABLE = {
    "botocore": {"EndpointConnectionError", "ConnectTimeoutError"},
    "aiohttp": {"ClientConnectorError", "ServerTimeoutError"},
    "azure.core": {"ServiceRequestError"},
}
#: Operations that write: on an object store, FileNotFoundError from one means a missing bucket.
_WRITES = {"open_write", "create_exclusive", "replace", "upload_file"}

_HOWTO = "see 'Using a remote root' in docs/remote.md"

_CREDENTIALS_HOWTO = {
    "s3": "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile (AWS_PROFILE, or storage "
    "option profile=NAME), or pass storage options key= and secret= (CLI: -o key=... -o "
    "secret=...)",
    "gs": "Pass storage option token= (a service-account JSON file, 'google_default' after `gcloud "
    "auth application-default login`, or 'anon' for a public bucket), or set "
    "GOOGLE_APPLICATION_CREDENTIALS",
    "az": "Pass storage options account_name= with account_key=, sas_token= or connection_string=, "
    "or set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and "
    "AZURE_STORAGE_ACCOUNT_KEY)",
}
_ENDPOINT_HOWTO = {
    "s3": 'Check the endpoint (storage option client_kwargs={"endpoint_url": URL}, CLI -o '
    "endpoint_url=URL, or AWS_ENDPOINT_URL) and that the server is running; AWS_MAX_ATTEMPTS=N "
    "sets the attempts",
    "gs": "Check the endpoint (storage option endpoint_url=URL, or STORAGE_EMULATOR_HOST) and that "
    "the server is running",
    "az": "Check the account's blob endpoint (BlobEndpoint= of the connection string, or "
    "account_host=) and that the server is running",
}


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
            mapped = translate(e, self, time.monotonic() - started, fn.__name__)
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


def _classes(e: BaseException) -> list[tuple[str, str]]:
    """(module, class name) of ``e``'s class and its bases, for the clients' modules only."""
    return [
        (c.__module__, c.__name__)
        for c in type(e).__mro__
        if c.__module__.startswith(("botocore", "google", "azure", "aiohttp", "gcsfs"))
    ]


def _is(cause: BaseException, table: dict[str, set[str]]) -> bool:
    return any(
        module.startswith(prefix) and name in table[prefix] for module, name in _classes(cause) for prefix in table
    )


def _status(cause: BaseException) -> int | None:
    code = getattr(cause, "status_code", None) or getattr(cause, "code", None)
    return code if isinstance(code, int) else None


def _kind(cause: BaseException) -> str | None:
    """What ``cause`` means: "credentials", "unreachable", "bucket", or None."""
    classes = _classes(cause)
    if not classes:
        return None
    if _is(cause, _NO_CREDENTIALS):
        return "credentials"
    if _is(cause, _UNREACHABLE):
        return "unreachable"
    modules = {m for m, _ in classes}
    if any(m.startswith("gcsfs") for m in modules) and _status(cause) == 401:
        return "credentials"
    if any(m.startswith("azure") for m in modules):
        code = getattr(cause, "error_code", None)
        if code == "AuthenticationFailed" or (_status(cause) == 403 and "authenticate" in str(cause)):
            return "credentials"
        if code == "ContainerNotFound":
            return "bucket"
    response = getattr(cause, "response", None)
    if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket":
        return "bucket"
    return None


def _scheme(storage: Backend) -> str:
    url = str(getattr(storage, "url", "") or "")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    return {"gcs": "gs", "abfs": "az", "adl": "az", "abfss": "az"}.get(scheme, scheme)


def translate(
    e: BaseException, storage: Backend, seconds: float = 0.0, operation: str | None = None
) -> BaseException | None:
    """The typed txckpt error for ``e``, raised by ``operation`` of ``storage`` that ran for
    ``seconds``; None when ``e`` is not one of the cases above (raise it as it is)."""
    if isinstance(e, TxckptError):
        return None
    root = getattr(storage, "url", None)
    scheme = _scheme(storage)
    endpoint = endpoint_of(storage)
    where = f"endpoint {endpoint}" if endpoint else "the provider's default endpoint"
    for cause in _chain(e):
        kind = _kind(cause)
        if kind == "credentials":
            return CredentialsError(
                f"no valid credentials for {root} ({where}): {_first_line(cause)}. "
                f"{_CREDENTIALS_HOWTO.get(scheme, 'Pass the credentials in storage_options')}; "
                f"{_HOWTO}",
                root=root,
                endpoint=endpoint,
            )
        if kind == "unreachable":
            endpoint = _base_url(getattr(cause, "kwargs", {}).get("endpoint_url")) or endpoint
            attempts = _attempts(storage)
            tried = f"{attempts} attempts failed" if attempts else "the connection failed"
            return EndpointUnreachableError(
                f"cannot connect to {endpoint or where} for {root}: {tried} in {seconds:.1f} s "
                f"({_first_line(cause)}). "
                f"{_ENDPOINT_HOWTO.get(scheme, 'Check the endpoint and that the server is running')}; "
                f"{_HOWTO}",
                root=root,
                endpoint=endpoint,
                attempts=attempts,
                seconds=seconds,
            )
        if kind == "bucket":
            response = getattr(cause, "response", None)
            named = response.get("Error", {}).get("BucketName") if isinstance(response, dict) else None
            return missing_bucket_error(storage, getattr(storage, "bucket", None) or named or _bucket_of_root(storage))
    if operation in _WRITES and isinstance(e, FileNotFoundError) and scheme and scheme not in ("file", "local"):
        # An object store has no directories: a write finds nothing only when the bucket is gone
        # (gcsfs says so with the bare URL it posted to). Ask the backend to be sure.
        try:
            missing = storage.missing_root()
        except Exception:
            return None
        if missing:
            return missing_bucket_error(storage, missing)
    return None


def _bucket_of_root(storage: Backend) -> str | None:
    url = str(getattr(storage, "url", "") or "")
    return url.split("://", 1)[1].split("/", 1)[0] or None if "://" in url else None


def missing_bucket_error(storage: Backend, bucket: str | None) -> RootNotFoundError:
    """The error for a root whose bucket (Azure: container) does not exist; ``bucket`` is its name
    or URL in any of the client's spellings (``abfs://c`` is named ``az://c`` when the root is)."""
    root = getattr(storage, "url", None)
    scheme = _scheme(storage) or "s3"
    word = "container" if scheme == "az" else "bucket"
    if bucket and "://" in bucket:
        bucket = bucket.split("://", 1)[1]
    bucket = bucket.split("/", 1)[0] if bucket else None
    bucket_url = f"{scheme}://{bucket}" if bucket else None
    endpoint = endpoint_of(storage)
    where = f"endpoint {endpoint}" if endpoint else "the provider's default endpoint"
    return RootNotFoundError(
        f"the {word} {bucket_url} of the root {root} does not exist at {where}: check the {word} "
        f"name, the endpoint and the account or region, or create the {word} (txckpt never creates "
        f"one); {_HOWTO}",
        root=root,
        bucket=bucket_url,
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def endpoint_of(storage: Backend) -> str | None:
    """The endpoint URL the storage's client uses (None: the provider's default)."""
    fs = getattr(storage, "fs", None)
    client = getattr(fs, "_s3", None)
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    if url is None and fs is not None:
        url = (
            getattr(fs, "endpoint_url", None)
            or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
            or getattr(fs, "_endpoint", None)
        )  # gcsfs: endpoint_url= as given, else None
        service = getattr(fs, "service_client", None)  # adlfs: the account's blob endpoint
        if url is None and service is not None and not isinstance(service, (list, tuple)):
            url = getattr(service, "url", None)
    return _base_url(url if isinstance(url, str) else None)


def _base_url(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url


def _attempts(storage: Backend) -> int | None:
    """How many attempts botocore makes per request, as its client is configured
    (``AWS_MAX_ATTEMPTS`` / ``config_kwargs={"retries": ...}``; legacy mode: 5, else 3); None for
    other clients (their retry policies are their own)."""
    client = getattr(getattr(storage, "fs", None), "_s3", None)
    if client is None and _scheme(storage) != "s3":
        return None
    return _client_attempts(client)


def _client_attempts(client: Any) -> int:
    retries = getattr(getattr(getattr(client, "meta", None), "config", None), "retries", None) or {}
    if retries.get("total_max_attempts") is not None:
        return int(retries["total_max_attempts"])
    if retries.get("max_attempts") is not None:
        return int(retries["max_attempts"]) + 1
    return 5 if retries.get("mode", "legacy") == "legacy" else 3


# ----- what is being retried, while it is (S3) ---------------------------------------------------
_log = logging.getLogger("txckpt")
_RETRY_HOOK = "txckpt-log-retries"


def log_retries(fs: Any) -> None:
    """Log each request botocore retries for s3fs filesystem ``fs`` (a wrong endpoint is
    otherwise silent for the 7-10 s of its backoff before :class:`EndpointUnreachableError`).
    Registered on the filesystem's session, whose event handlers every client it creates later
    copies, and on its client if it has one already; once (by id) however many roots share it.

    The hook holds ``fs`` weakly: s3fs's ``weakref.finalize`` holds the client, the client its
    hooks, so a strong reference here kept every filesystem (and its botocore session and service
    models, ~40 000 objects each) alive for good; ``skip_instance_cache`` opens one per root."""
    try:
        session = getattr(fs, "session", None)
        if session is None:
            fs.session = session = deps.aiobotocore_session.AioSession(**getattr(fs, "kwargs", {}))
            fs._session_is_owned = True  # s3fs's own flag: it may recreate it on a refresh
        emitters = [session] + [c.meta.events for c in [getattr(fs, "_s3", None)] if c is not None]
        for emitter in emitters:
            emitter.register("needs-retry.s3", functools.partial(_note_retry, weakref.ref(fs)), unique_id=_RETRY_HOOK)
    except Exception as e:  # pragma: no cover - another s3fs/aiobotocore layout: log nothing
        _log.debug("not logging S3 retries: %s: %s", type(e).__name__, e)


def _note_retry(
    fs_ref: weakref.ref[Any],
    attempts: int = 0,
    caught_exception: BaseException | None = None,
    response: Any = None,
    endpoint: Any = None,
    operation: Any = None,
    **_: Any,
) -> None:
    """botocore's ``needs-retry`` event, after every attempt: log a failed one that it retries.
    Attempt 1 at INFO; attempt 2 at WARNING, so that Python's default level shows one line
    within the first second of a wrong endpoint; later ones at INFO. The last attempt is not
    retried: the typed error says it. Returns None: the retry decision stays botocore's."""
    fs = fs_ref()
    if fs is None:  # the filesystem is gone; its client is being closed
        return None
    if caught_exception is not None:
        why = _first_line(caught_exception)
    else:
        meta = response[1].get("ResponseMetadata", {}) if isinstance(response, tuple) and len(response) > 1 else {}
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        if not isinstance(status, int) or (status < 500 and status != 429):
            return None  # an answer: success, or an error botocore does not retry
        why = f"HTTP {status}"
    total = _client_attempts(getattr(fs, "_s3", None))
    if attempts >= total:
        return None
    _log.log(
        logging.WARNING if attempts == 2 else logging.INFO,
        "S3 %s to %s: attempt %d of %d failed (%s); retrying",
        getattr(operation, "name", "request"),
        _base_url(getattr(endpoint, "host", None)) or "the default endpoint",
        attempts,
        total,
        why,
    )
    return None
