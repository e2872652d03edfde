"""A moto S3 server on loopback, with request counting and fault injection.

Used by the tests (the fixtures in tests/harness/backends.py), the benchmarks (benchmarks/s3.py)
and the reliability campaign (tests/reliability/s3.py); it lives outside tests/ so that
benchmarks need not import the test suite. Not shipped in the wheel (pyproject's package
find includes only txckpt*).

Request counting happens on the server side, in a WSGI middleware in front of moto: it sees every
request any client sends (s3fs, boto3, child processes, retries), not just those of one client
object, and it does not depend on s3fs keeping the same botocore client for its whole life.

Fidelity fix: moto checks ``If-None-Match: *`` / ``If-Match`` and then stores the object as two
unsynchronised steps, and its server answers requests on concurrent threads, so two racing
conditional writes can both succeed on moto (real S3 makes them atomic: one gets 412). The
middleware serialises *conditional* writes against each other (and only those), which is what S3
guarantees. Unconditional traffic is not serialised, so it does not hide check-then-write code:
a backend that HEADs and then PUTs without a condition still races. Set
``TXCKPT_MOTO_RAW=1`` to run against unmodified moto and watch the race happen.

Second fidelity fix: werkzeug's request handler leaves Nagle's algorithm on. botocore sends every
PutObject and UploadPart with ``Expect: 100-continue``; werkzeug answers with an interim
``100 Continue`` and then, once moto is done, the final response, which Nagle holds back until the
client's delayed ACK of the interim one arrives: about 10 ms on this machine's loopback, for a
request that otherwise takes 2-4 ms. Real S3 endpoints (and nginx, Envoy and other production HTTP
servers) send with TCP_NODELAY, so the handler here does too; without it every small PUT costs
10 ms that no real store charges, which swamps request counts in timings.

Third fidelity fix: moto 5 answers a ranged GET by reading the whole object out of its store,
copying it, and slicing the range off the copy, so reading a 1 GiB object in 16 MiB ranges moves
about 130 GiB through memory (minutes a read). Real S3, GCS and SeaweedFS read the range alone,
which is what every parallel reader (boto3's transfer manager, s3fs ``cat_ranges``, txckpt's
ranged load) is built on. A reader right in front of moto (behind the counting middleware and
any ``wrapped`` app) answers a plain ranged GET (one ``bytes=a-b`` or ``bytes=a-`` range inside
the object, no query, no ``If-*`` header but an ``If-Match`` of the object's ETag, which boto3's
transfer manager sends with every part) itself from moto's stored object, with moto's own
headers for that object; everything else (a missing key, a range moto would reject, another
conditional read, a version) goes to moto as before.
``TXCKPT_MOTO_RAW=1`` turns this off too.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

BUCKET = "txckpt-test"
REGION = "us-east-1"
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    # Never read a developer's real profile or credentials.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
# The moto control plane (reset etc.) is not S3 traffic: not counted.
_MOTO_API = "/moto-api"
_App = TypeVar("_App")
#: The ranged GETs _RangeReader answers itself (third fidelity fix): one range, from a byte on.
_PLAIN_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


# ---------------------------------------------------------------------------------------------
# Request classification and counting
# ---------------------------------------------------------------------------------------------
def classify(environ: dict[str, Any]) -> str:
    """The S3 API operation of one WSGI request (path-style addressing, as s3fs/boto3 send it
    to an endpoint_url)."""
    method = environ.get("REQUEST_METHOD", "GET")
    path = environ.get("PATH_INFO", "/")
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    parts = [p for p in path.split("/") if p]
    on_object = len(parts) >= 2
    if not parts:
        return "ListBuckets" if method == "GET" else f"{method}Service"
    if method == "PUT":
        if not on_object:
            return "CreateBucket" if not query else "PutBucket" + "".join(sorted(query)).title()
        if "partNumber" in query and "uploadId" in query:
            if environ.get("HTTP_X_AMZ_COPY_SOURCE"):
                return "UploadPartCopy"
            return "UploadPart"
        if environ.get("HTTP_X_AMZ_COPY_SOURCE"):
            return "CopyObject"
        if "tagging" in query:
            return "PutObjectTagging"
        return "PutObject"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        if "delete" in query:
            return "DeleteObjects"
        return "PostObject"
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload"
        return "DeleteObject" if on_object else "DeleteBucket"
    if method == "HEAD":
        return "HeadObject" if on_object else "HeadBucket"
    if method == "GET":
        if on_object:
            if "uploadId" in query:
                return "ListParts"
            if "tagging" in query:
                return "GetObjectTagging"
            return "GetObject"
        if "uploads" in query:
            return "ListMultipartUploads"
        if "location" in query:
            return "GetBucketLocation"
        if "versions" in query:
            return "ListObjectVersions"
        if query.get("list-type") == ["2"]:
            return "ListObjectsV2"
        return "ListObjects"
    return method


def _body_length(environ: dict[str, Any]) -> int:
    # aws-chunked bodies (flexible checksums) carry the payload size separately.
    for name in ("HTTP_X_AMZ_DECODED_CONTENT_LENGTH", "CONTENT_LENGTH"):
        value = environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                pass
    return 0


@dataclass
class RequestStats:
    """Cumulative counts since the server started (thread-safe)."""

    ops: Counter = field(default_factory=Counter)
    uploaded_bytes: int = 0
    #: (path, Range header or None) of every GetObject: what a read asked the server for.
    gets: list[tuple[str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_get(self, path: str, byte_range: str | None) -> None:
        with self.lock:
            self.gets.append((path, byte_range))

    def record(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.ops[op] += 1
            if op in ("PutObject", "UploadPart"):
                self.uploaded_bytes += nbytes

    def snapshot(self) -> tuple[Counter, int]:
        with self.lock:
            return Counter(self.ops), self.uploaded_bytes


class RequestCounter:
    """Requests (by S3 operation) and uploaded bytes (PutObject + UploadPart bodies) that reached
    the server since this counter was created or last ``reset()``.

    >>> counter = s3_server.counter()
    >>> storage.create_exclusive("a", b"x", durable=True)
    >>> counter.ops           # Counter({'PutObject': 1})
    >>> counter.total, counter.uploaded_bytes

    Also a context manager: ``with s3_server.counter() as c: ...`` freezes the counts at exit.
    Counts include every client of the server, so measure one thing at a time.
    """

    def __init__(self, stats: RequestStats):
        self._stats = stats
        self._frozen: tuple[Counter, int] | None = None
        self.reset()

    def reset(self) -> "RequestCounter":
        self._base_ops, self._base_bytes = self._stats.snapshot()
        with self._stats.lock:
            self._base_gets = len(self._stats.gets)
        self._frozen = None
        return self

    @property
    def gets(self) -> list[tuple[str, str | None]]:
        """(path, Range header or None: the whole object) of each GetObject since the reset."""
        with self._stats.lock:
            return list(self._stats.gets[self._base_gets :])

    def _now(self) -> tuple[Counter, int]:
        if self._frozen is not None:
            return self._frozen
        ops, nbytes = self._stats.snapshot()
        ops.subtract(self._base_ops)
        return Counter({k: v for k, v in ops.items() if v}), nbytes - self._base_bytes

    @property
    def ops(self) -> Counter:
        return self._now()[0]

    @property
    def total(self) -> int:
        return sum(self._now()[0].values())

    @property
    def uploaded_bytes(self) -> int:
        return self._now()[1]

    def __enter__(self) -> "RequestCounter":
        return self.reset()

    def __exit__(self, *exc) -> None:
        self._frozen = self._now()

    def __repr__(self) -> str:
        ops, nbytes = self._now()
        return f"RequestCounter(total={sum(ops.values())}, ops={dict(ops)}, uploaded_bytes={nbytes})"


class _Middleware:
    """Counts S3 requests and serialises conditional writes (see module docstring)."""

    def __init__(self, app, stats: RequestStats, serialise_conditional: bool):
        self.app = app
        self.stats = stats
        self.serialise_conditional = serialise_conditional
        self.latency = 0.0  # seconds every request is held first: a network's round trip (benchmarks)
        self.conditional_lock = threading.Lock()
        self.faults: list[dict[str, Any]] = []
        self.faults_lock = threading.Lock()

    def _take_fault(self, op: str, path: str) -> dict[str, Any] | None:
        with self.faults_lock:
            for fault in self.faults:
                if fault["op"] == op and path.endswith("/" + fault["key"]):
                    self.faults.remove(fault)
                    return fault
        return None

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO", "").startswith(_MOTO_API):
            return self.app(environ, start_response)
        op = classify(environ)
        self.stats.record(op, _body_length(environ))
        if op == "GetObject":
            self.stats.record_get(environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE"))
        if self.latency:
            time.sleep(self.latency)
        fault = self._take_fault(op, environ.get("PATH_INFO", ""))
        if fault is not None and fault.get("delay"):  # a slow request: answered normally, late
            time.sleep(fault["delay"])
            return self._dispatch(op, environ, start_response)
        if fault is not None:
            if fault["after_apply"]:  # moto applies the request; the client never hears of it
                list(self._dispatch(op, environ, lambda *a, **k: lambda data: None))
            status, code = fault.get("status", "500 Internal Server Error"), fault.get("code", "InternalError")
            body = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                "<Message>injected by emulators/s3.py</Message></Error>"
            ).encode()
            start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        return self._dispatch(op, environ, start_response)

    def _dispatch(self, op: str, environ, start_response):
        conditional = op in ("PutObject", "CompleteMultipartUpload", "DeleteObject") and (
            environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH")
        )
        if conditional and self.serialise_conditional:
            with self.conditional_lock:
                # moto builds the whole response inside the call; materialise it under the lock.
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


class _RangeReader:
    """In front of moto, behind everything else: answers plain ranged GETs itself (third
    fidelity fix), passes every other request on."""

    def __init__(self, app, enabled: bool):
        self.app = app
        self.enabled = enabled
        self.answered = 0  # ranged GETs answered here rather than by moto (tests read it)

    def __call__(self, environ, start_response):
        if self.enabled and classify(environ) == "GetObject":
            answer = _ranged_get(environ, start_response)
            if answer is not None:
                self.answered += 1
                return answer
        return self.app(environ, start_response)


def _ranged_get(environ, start_response) -> list[bytes] | None:
    """A plain ranged GetObject answered from the range alone (third fidelity fix), or None where
    moto must answer (anything but one in-object range of an existing key, read unconditionally)."""
    match = _PLAIN_RANGE.fullmatch(environ.get("HTTP_RANGE", ""))
    conditions = {name for name in environ if name.startswith("HTTP_IF_")}
    if (
        match is None
        or environ.get("QUERY_STRING")
        or environ.get("HTTP_ORIGIN")  # CORS rules: moto's
        or conditions - {"HTTP_IF_MATCH"}
    ):
        return None
    bucket, _, name = environ.get("PATH_INFO", "").lstrip("/").partition("/")
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import FakeKey, s3_backends

    try:
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, name)
    except Exception:  # no such bucket, and the like: moto's own answer says what is wrong
        return None
    if not isinstance(key, FakeKey) or key.storage_class not in ("STANDARD", None):
        return None
    if conditions and environ["HTTP_IF_MATCH"] != key.etag:
        return None  # If-Match of another ETag: moto answers 412 (boto3's transfer manager sends If-Match)
    with key.lock:
        size = key.size
        first = int(match.group(1))
        last = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
        if first > last:  # past the end (416) or inverted: moto's rules
            return None
        if key.checksum_algorithm and first == 0 and last == size - 1 and environ.get("HTTP_X_AMZ_CHECKSUM_MODE"):
            return None  # the whole object, whose stored checksum moto then sends (not for a part)
        key._value_buffer.seek(first)
        body = key._value_buffer.read(last - first + 1)
    # moto's server adds Access-Control-Allow-Origin to every response (its flask app's CORS).
    headers = {
        **key.response_dict,
        **key.metadata,
        "Accept-Ranges": "bytes",
        "Access-Control-Allow-Origin": "*",
        "content-range": f"bytes {first}-{last}/{size}",
        "content-length": str(len(body)),
    }
    start_response("206 Partial Content", [(k, str(v)) for k, v in headers.items()])
    return [body]


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------
class _Endpoint:
    """What a client needs of a server at ``endpoint_url``: options, a boto3 client, buckets."""

    @property
    def endpoint_url(self) -> str:
        raise NotImplementedError

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server. ``skip_instance_cache`` makes every open_storage() call
        a separate client with its own listing cache, like a separate process."""
        options: dict[str, Any] = {
            "key": FAKE_ENV["AWS_ACCESS_KEY_ID"],
            "secret": FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
            "token": FAKE_ENV["AWS_SESSION_TOKEN"],
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "skip_instance_cache": True,
        }
        options.update(extra)
        return options

    def boto3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=FAKE_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
            aws_session_token=FAKE_ENV["AWS_SESSION_TOKEN"],
        )

    def create_bucket(self, bucket: str = BUCKET) -> None:
        self.boto3_client().create_bucket(Bucket=bucket)

    def multipart_uploads(self, bucket: str = BUCKET, prefix: str = "") -> list[dict]:
        """In-progress multipart uploads (what an abort must leave empty)."""
        out = self.boto3_client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        return out.get("Uploads", [])


class S3Server(_Endpoint):
    """moto's ThreadedMotoServer on 127.0.0.1 behind the counting middleware."""

    def __init__(self, serialise_conditional: bool | None = None):
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from moto.server import ThreadedMotoServer

        raw = os.environ.get("TXCKPT_MOTO_RAW", "") == "1"
        if serialise_conditional is None:
            serialise_conditional = not raw
        self.stats = RequestStats()
        stats = self.stats
        owner = self
        self._app: _Middleware | None = None
        self.ranges: _RangeReader | None = None  # the third fidelity fix, once started

        class _Handler(MotoRequestHandler):
            disable_nagle_algorithm = True  # TCP_NODELAY, as real S3 (second fidelity fix above)

            def log_request(self, *args, **kwargs) -> None:  # one line per request: too noisy
                pass

        class _Server(ThreadedMotoServer):
            def _server_entry(self) -> None:  # same as moto's, with the middleware in front
                from werkzeug.serving import make_server

                from moto.moto_server.werkzeug_app import (
                    DomainDispatcherApplication,
                    create_backend_app,
                )

                owner.ranges = _RangeReader(DomainDispatcherApplication(create_backend_app), enabled=not raw)
                app = _Middleware(owner.ranges, stats, serialise_conditional)
                owner._app = app
                self._server = make_server(self._ip_address, self._port, app, True, request_handler=_Handler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = _Server(ip_address="127.0.0.1", port=0, verbose=False)
        self.host = "127.0.0.1"
        self.port = 0

    def start(self) -> "S3Server":
        self._server.start()
        host, port = self._server.get_host_and_port()
        assert host == "127.0.0.1", host
        self.port = port
        return self

    def stop(self) -> None:
        self._server.stop()

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self) -> None:
        """Forget every bucket and object (moto's control plane)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()

    def counter(self) -> RequestCounter:
        return RequestCounter(self.stats)

    @contextlib.contextmanager
    def wrapped(self, make: Callable[[Any], _App]) -> Iterator[_App]:
        """Put ``make(moto_app)``, a WSGI app that calls the one it is given, in front of moto
        for the block (inside the counting and fault-injecting middleware) and yield it: how a
        test sees the headers a client sent, or a benchmark times each request in the server."""
        assert self._app is not None, "the server is not started"
        inner = self._app.app
        outer = make(inner)
        self._app.app = outer
        try:
            yield outer
        finally:
            self._app.app = inner

    def inject_failure(self, op: str, key: str, *, after_apply: bool = True) -> None:
        """Answer the next ``op`` request on a path ending in ``/key`` with HTTP 500 InternalError
        (which botocore retries). With ``after_apply`` moto performs the request first: the
        write happened but its client was told it failed, the ambiguous case."""
        assert self._app is not None, "start() the server first"
        with self._app.faults_lock:
            self._app.faults.append({"op": op, "key": key, "after_apply": after_apply})

    def inject_denial(self, op: str, key: str) -> None:
        """Answer the next ``op`` request on a path ending in ``/key`` with 403 AccessDenied
        without applying it (not retried: s3fs raises PermissionError)."""
        assert self._app is not None, "start() the server first"
        with self._app.faults_lock:
            self._app.faults.append(
                {"op": op, "key": key, "after_apply": False, "status": "403 Forbidden", "code": "AccessDenied"}
            )

    def set_latency(self, seconds: float) -> None:
        """Hold every request ``seconds`` before it is handled: what a real store's round trip
        (~10-50 ms to S3 from EC2) adds to each request, which loopback does not (benchmarks
        that count round trips: benchmarks/s3load.py's fresh loads)."""
        assert self._app is not None, "start the server first"
        self._app.latency = seconds

    def inject_delay(self, op: str, key: str, seconds: float) -> None:
        """Hold the next ``op`` request on a path ending in ``/key`` for ``seconds`` before moto
        handles it (an upload that is still on the wire)."""
        assert self._app is not None, "start() the server first"
        with self._app.faults_lock:
            self._app.faults.append({"op": op, "key": key, "after_apply": False, "delay": seconds})

    def clear_failures(self) -> None:
        if self._app is not None:
            with self._app.faults_lock:
                self._app.faults.clear()


#: Variables that would point a client at a real account or endpoint: unset while faking.
_REAL_AWS = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


@contextlib.contextmanager
def environ(set: Mapping[str, str], unset: Iterable[str] = ()) -> Iterator[None]:
    """``set`` in os.environ and ``unset`` removed from it for the block, then every one of
    those variables as it was (what pytest's MonkeyPatch does; benchmarks run without pytest)."""
    unset = tuple(unset)
    saved = {name: os.environ.get(name) for name in (*set, *unset)}
    try:
        os.environ.update(set)
        for name in unset:
            os.environ.pop(name, None)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def fake_aws_env() -> contextlib.AbstractContextManager[None]:
    """FAKE_ENV set and the real-account variables unset for the block, then as they were."""
    return environ(FAKE_ENV, _REAL_AWS)


@contextlib.contextmanager
def running_s3_server(**kwargs: Any) -> Iterator[S3Server]:
    """Start a server for a script or benchmark outside pytest fixtures."""
    with fake_aws_env():
        server = S3Server(**kwargs).start()
        try:
            yield server
        finally:
            server.stop()


class S3ServerProcess(_Endpoint):
    """The same server (middleware, fidelity fixes) in a Python process of its own: for a
    benchmark whose client must have its CPU, its GIL and its RSS to itself (in process, moto's
    threads share the client's GIL, and its copies of the objects count in the client's RSS)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "emulators.s3"], cwd=here, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # the child prints its endpoint once it listens
        if not line.startswith("http://127.0.0.1:"):
            self.stop()
            raise RuntimeError(f"the S3 server process did not start: {line!r}")
        self._endpoint = line.strip()

    @property
    def endpoint_url(self) -> str:
        return self._endpoint

    def stop(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the child stops its server when its stdin ends
        try:
            self._proc.wait(timeout=30)
        except Exception:
            self._proc.kill()
            self._proc.wait()


@contextlib.contextmanager
def running_s3_server_process() -> Iterator[S3ServerProcess]:
    """:func:`running_s3_server`, the server in a process of its own."""
    with fake_aws_env():
        server = S3ServerProcess()
        try:
            yield server
        finally:
            server.stop()


if __name__ == "__main__":  # S3ServerProcess's child: serve until stdin ends
    import sys

    with running_s3_server() as _server:
        print(_server.endpoint_url, flush=True)
        sys.stdin.read()
