"""Fault injection at every storage operation, for the three backends.

The counting and the decision are the suite's one tracer (tests/harness/tracer.py); this module
says where each backend's operations are interposed. One :class:`Injector` counts operations
and, at operation ``k``, does what its mode says:

* ``kill``   SIGKILL this process immediately before op k, or immediately after it returns
             (``on_crash`` runs first: the memory backend dumps its store there, see below);
* ``raise``  raise :class:`InjectedCrash` (a BaseException, like KeyboardInterrupt: txckpt's
             ``except Exception`` handlers do not swallow it, its ``finally`` blocks do run);
* ``enospc`` make op k fail with ``OSError(ENOSPC)`` instead of running it (local only; only
             operations that can run out of space: open for writing, write, fsync, mkdir, link,
             rename);
* ``None``   only count (and label) the operations.

Where the operations are counted:

* **local** (:class:`LocalInjector`): the Python-level file operations txckpt and its callers
  make: ``open`` for writing and every ``write`` on such a file, ``os.fsync/link/rename/replace/
  unlink/mkdir/rmdir`` and ``txckpt._storage.local.store.rename_noreplace`` (renameat2). Writes done
  inside C or Rust code (``torch.save`` to a *path*, safetensors' ``save_file``; the Trainer
  uses both) are not interposed: a crash point before and after the neighbouring operations
  brackets them. Consecutive writes to one buffered file form a *write run*: a crash between two
  of them leaves the same bytes on disk as a crash after the run's first op (they sit in a
  userspace buffer).
* **memory** (:class:`MemoryInjector`): every mutation of fsspec's in-process store
  (``pipe_file``, ``_rm``, ``rmdir``, ``mkdir``, ``makedirs``, and txckpt's atomic
  ``MemoryStorage.create_exclusive``). The store lives in the writer's process, so a SIGKILL would
  take it along: in ``kill`` mode the child first dumps the store as it is at the crash point (raw
  ``os.write``, no txckpt code), then SIGKILLs itself, and the checker (a fresh process) loads the
  dump: exactly the state an in-process reader would see if the writer thread died at that point.
  ``raise`` mode instead raises at op k and lets txckpt's own error handling run.
* **S3** (:class:`S3Injector`): every HTTP request the process sends, at the lowest async layer
  every botocore call goes through (``aiobotocore.endpoint.AioEndpoint._send``, below s3fs's
  retry wrapper and txckpt's own conditional-put client): "before" means the request never left,
  "after" means the server answered (and applied it).
"""

from __future__ import annotations

import os
import re
from typing import Any

from tests.harness.tracer import Tracer

_ID = re.compile(r"[0-9a-f]{8,}")


def stable(name: str) -> str:
    """An op label without random ids, so that op lists of two runs can be compared."""
    return _ID.sub("<id>", name)


class Injector(Tracer):
    """The suite's tracer (tests/harness/tracer.py) as the campaign counts: op labels stable across
    runs, every write its own op (``records`` groups the writes of one run), and an op made while
    another of the same thread runs not counted. ``inj.records`` lists the ops."""

    def __init__(
        self,
        kill_at: int | None = None,
        when: str = "before",
        mode: str | None = "kill",
        on_crash: Any = None,
        **kwargs: Any,
    ):
        super().__init__(kill_at, when, mode=mode, on_crash=on_crash, count_nested=False, rename=stable, **kwargs)


# =================================================================================================
# local files
# =================================================================================================
class LocalInjector(Injector):
    """The local file operations, as :meth:`Tracer.install` interposes them; ``under``: only paths
    below it are counted (None: every path)."""


# =================================================================================================
# fsspec memory://
# =================================================================================================
def memory_prefix(url: str) -> str:
    from fsspec.implementations.memory import MemoryFileSystem

    return MemoryFileSystem._strip_protocol(url).rstrip("/")


def memory_dump(url: str) -> bytes:
    """The memory store below ``url`` (files and pseudo-directories), pickled."""
    import pickle

    from fsspec.implementations.memory import MemoryFileSystem

    prefix = memory_prefix(url)
    under = lambda p: p == prefix or p.startswith(prefix + "/")  # noqa: E731
    store = {p: bytes(f.getvalue()) for p, f in list(MemoryFileSystem.store.items()) if under(p)}
    dirs = [d for d in list(MemoryFileSystem.pseudo_dirs) if under(d)]
    return pickle.dumps({"store": store, "dirs": dirs})


def memory_load(url: str, blob: bytes | None) -> None:
    """Replace the store below ``url`` with a dump (None: empty)."""
    import pickle

    import fsspec
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

    prefix = memory_prefix(url)
    under = lambda p: p == prefix or p.startswith(prefix + "/")  # noqa: E731
    for p in [p for p in MemoryFileSystem.store if under(p)]:
        MemoryFileSystem.store.pop(p, None)
    MemoryFileSystem.pseudo_dirs[:] = [d for d in MemoryFileSystem.pseudo_dirs if not under(d)]
    if blob is None:
        return
    data = pickle.loads(blob)
    fs = fsspec.filesystem("memory")
    for p, b in data["store"].items():
        MemoryFileSystem.store[p] = MemoryFile(fs, p, b)
    for d in data["dirs"]:
        if d not in MemoryFileSystem.pseudo_dirs:
            MemoryFileSystem.pseudo_dirs.append(d)


def dump_to_file(url: str, path: str) -> None:
    """Write the memory store to ``path`` with raw os calls (used at a crash point)."""
    blob = memory_dump(url)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class MemoryInjector(Injector):
    def install(self) -> "MemoryInjector":  # fsspec's store instead of the local files
        from fsspec.implementations.memory import MemoryFileSystem

        from txckpt._storage.fsspec.memory import MemoryStorage

        inj = self
        for owner, attr in (
            (MemoryFileSystem, "pipe_file"),
            (MemoryFileSystem, "_rm"),
            (MemoryFileSystem, "rmdir"),
            (MemoryFileSystem, "mkdir"),
            (MemoryFileSystem, "makedirs"),
            (MemoryStorage, "create_exclusive"),
        ):

            def factory(real, attr=attr):
                def wrapper(self_, path, *args, **kwargs):
                    return inj.op(f"{attr}({'/'.join(str(path).split('/')[-3:])})", real, self_, path, *args, **kwargs)

                return wrapper

            self._patch(owner, attr, factory)
        return self


# =================================================================================================
# S3 (HTTP requests)
# =================================================================================================
def classify_request(request: Any, root_prefix: str = "") -> tuple[str, bool]:
    """('PutObject(if-none-match) root-relative-key', mutating) for one botocore request."""
    import urllib.parse

    from emulators.s3 import classify

    url = urllib.parse.urlsplit(request.url)
    headers = {k.lower(): v for k, v in dict(request.headers).items()}
    environ = {"REQUEST_METHOD": request.method, "PATH_INFO": urllib.parse.unquote(url.path), "QUERY_STRING": url.query}
    if "x-amz-copy-source" in headers:
        environ["HTTP_X_AMZ_COPY_SOURCE"] = headers["x-amz-copy-source"]
    op = classify(environ)
    if headers.get("if-none-match"):
        op += "(if-none-match)"
    parts = [p for p in urllib.parse.unquote(url.path).split("/") if p]
    key = "/".join(parts[1:])
    if root_prefix and key.startswith(root_prefix):
        key = key[len(root_prefix) :].lstrip("/")
    if not key:
        q = urllib.parse.parse_qs(url.query)
        key = "prefix=" + (q.get("prefix", [""])[0][len(root_prefix) :].lstrip("/") if q.get("prefix") else "")
    return f"{op} {key}", request.method in ("PUT", "POST", "DELETE")


class S3Injector(Injector):
    def __init__(self, *args: Any, root_prefix: str = "", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.root_prefix = root_prefix

    def install(self) -> "S3Injector":
        from aiobotocore.endpoint import AioEndpoint

        inj = self

        def factory(real):
            async def wrapper(self_, request):
                name, mut = classify_request(request, inj.root_prefix)
                return await inj.op_async(name, real, self_, request, mut=mut)

            return wrapper

        self._patch(AioEndpoint, "_send", factory)
        return self


def make_injector(backend: str, **kwargs: Any) -> Injector:
    if backend == "local":
        kwargs.pop("root_prefix", None)
        return LocalInjector(**kwargs)
    if backend == "memory":
        kwargs.pop("under", None)
        kwargs.pop("root_prefix", None)
        return MemoryInjector(**kwargs)
    if backend == "s3":
        kwargs.pop("under", None)
        return S3Injector(**kwargs)
    raise ValueError(backend)
