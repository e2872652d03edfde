"""Fault injection at every storage operation, for the three backends.

One :class:`Injector` counts operations and, at operation ``k``, does what its mode says:

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
  unlink/mkdir/rmdir`` and ``txckpt.storage.local.rename_noreplace`` (renameat2). Writes done
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

import builtins
import errno
import os
import re
import signal
import threading
from typing import Any, Callable

_WRITE_MODES = set("wax+")
_ID = re.compile(r"[0-9a-f]{8,}")


class InjectedCrash(BaseException):
    """Raised at the injection point in ``raise`` mode."""


def stable(name: str) -> str:
    """An op label without random ids, so that op lists of two runs can be compared."""
    return _ID.sub("<id>", name)


class Injector:
    def __init__(self, kill_at: int | None = None, when: str = "before", mode: str | None = "kill",
                 on_crash: Callable[[], None] | None = None):
        self.kill_at = kill_at
        self.when = when
        self.mode = mode if kill_at is not None else None
        self.on_crash = on_crash
        self.count = 0
        #: [{"name", "mut" (changes storage), "group" (write-run id), "inject" (ENOSPC-able)}]
        self.ops: list[dict[str, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []
        # Per thread: txckpt fsyncs the staged files from a thread pool (transactions.py), and a
        # shared depth made one thread's fsync uncounted while another's ran (1 op fewer, 1 in ~15).
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._last_write: str | None = None
        self._group = 0
        self.fired = False

    @property
    def _depth(self) -> int:
        return getattr(self._tls, "depth", 0)

    @_depth.setter
    def _depth(self, value: int) -> None:
        self._tls.depth = value

    # ----- the decision at one operation ---------------------------------------------------------
    def _record(self, name: str, mut: bool, write_key: str | None, inject: bool) -> int:
        with self._lock:
            if write_key is None or write_key != self._last_write:
                self._group += 1
            self._last_write = write_key
            self.count += 1
            self.ops.append({"name": stable(name), "mut": mut, "group": self._group, "inject": inject})
            return self.count

    def _crash(self, where: str) -> None:
        self.fired = True
        if self.mode == "kill":
            if self.on_crash is not None:
                self.on_crash()
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.mode == "raise":
            raise InjectedCrash(f"injected crash {where} op {self.kill_at}")

    def op(self, name: str, fn: Callable, *args: Any, mut: bool = True, write_key: str | None = None,
           inject: bool = True, **kwargs: Any) -> Any:
        if self._depth:
            return fn(*args, **kwargs)
        k = self._record(name, mut, write_key, inject)
        mine = k == self.kill_at and self.mode is not None
        if mine and self.mode == "enospc":
            self.fired = True
            raise OSError(errno.ENOSPC, "No space left on device (injected)", name)
        if mine and self.when == "before":
            self._crash("before")
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            if mine and self.when == "after":
                self._crash("after")

    async def op_async(self, name: str, fn: Callable, *args: Any, mut: bool = True) -> Any:
        k = self._record(name, mut, None, False)
        mine = k == self.kill_at and self.mode is not None
        if mine and self.when == "before":
            self._crash("before")
        try:
            return await fn(*args)
        finally:
            if mine and self.when == "after":
                self._crash("after")

    def _patch(self, owner: Any, attr: str, wrapper_factory: Callable[[Any], Any]) -> None:
        real = getattr(owner, attr)
        self._saved.append((owner, attr, real))
        setattr(owner, attr, wrapper_factory(real))

    def uninstall(self) -> None:
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved.clear()

    def __enter__(self) -> "Injector":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def install(self) -> "Injector":  # pragma: no cover - abstract
        raise NotImplementedError


# =================================================================================================
# local files
# =================================================================================================
def _short(args: Any) -> str:
    out = []
    for a in args:
        if isinstance(a, (str, bytes, os.PathLike)):
            p = os.fsdecode(a)
            out.append("/".join(p.split("/")[-3:]))
        elif isinstance(a, int):
            out.append("fd")
    return ", ".join(out)


class _TracedFile:
    def __init__(self, f: Any, inj: "LocalInjector", path: str):
        self._f = f
        self._inj = inj
        self._path = path

    def write(self, data: Any) -> int:
        n = len(data) if isinstance(data, str) else memoryview(data).nbytes
        return self._inj.op(f"write({_short((self._path,))}, {n})", self._f.write, data, write_key=self._path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self) -> "_TracedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


class LocalInjector(Injector):
    OS_OPS = ("fsync", "link", "rename", "replace", "unlink", "mkdir", "rmdir")
    _NO_SPACE_NEEDED = ("unlink", "rmdir")

    def __init__(self, *args: Any, under: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: Only paths below ``under`` are counted (None: every path).
        self.under = os.path.realpath(under) if under else None

    def _mine(self, args: Any) -> bool:
        if self.under is None:
            return True
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)):
                p = os.path.abspath(os.fsdecode(a))
                return p == self.under or p.startswith(self.under + os.sep) or os.path.realpath(p).startswith(self.under + os.sep)
        return True  # fd-based (fsync): counted

    def install(self) -> "LocalInjector":
        import txckpt.storage.local as local

        inj = self

        for attr in self.OS_OPS:
            def factory(real, attr=attr):
                def wrapper(*args, **kwargs):
                    if not inj._mine(args):
                        return real(*args, **kwargs)
                    return inj.op(f"{attr}({_short(args)})", real, *args,
                                  inject=attr not in self._NO_SPACE_NEEDED, **kwargs)
                return wrapper
            self._patch(os, attr, factory)

        def rn_factory(real):
            def wrapper(*args, **kwargs):
                return inj.op(f"rename_noreplace({_short(args)})", real, *args, **kwargs)
            return wrapper
        self._patch(local, "rename_noreplace", rn_factory)

        def open_factory(real_open):
            def traced_open(file, mode="r", *args, **kwargs):
                if not (set(mode) & _WRITE_MODES) or not isinstance(file, (str, bytes, os.PathLike)) \
                        or not inj._mine((file,)):
                    return real_open(file, mode, *args, **kwargs)
                f = inj.op(f"open({_short((file,))}, {mode})", real_open, file, mode, *args, **kwargs)
                return _TracedFile(f, inj, os.fsdecode(file))
            return traced_open
        self._patch(builtins, "open", open_factory)
        return self


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
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


class MemoryInjector(Injector):
    def install(self) -> "MemoryInjector":
        from fsspec.implementations.memory import MemoryFileSystem

        from txckpt.storage.fsspec_store import MemoryStorage

        inj = self
        for owner, attr in ((MemoryFileSystem, "pipe_file"), (MemoryFileSystem, "_rm"),
                            (MemoryFileSystem, "rmdir"), (MemoryFileSystem, "mkdir"),
                            (MemoryFileSystem, "makedirs"), (MemoryStorage, "create_exclusive")):
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
    environ = {"REQUEST_METHOD": request.method, "PATH_INFO": urllib.parse.unquote(url.path),
               "QUERY_STRING": url.query}
    if "x-amz-copy-source" in headers:
        environ["HTTP_X_AMZ_COPY_SOURCE"] = headers["x-amz-copy-source"]
    op = classify(environ)
    if headers.get("if-none-match"):
        op += "(if-none-match)"
    parts = [p for p in urllib.parse.unquote(url.path).split("/") if p]
    key = "/".join(parts[1:])
    if root_prefix and key.startswith(root_prefix):
        key = key[len(root_prefix):].lstrip("/")
    if not key:
        q = urllib.parse.parse_qs(url.query)
        key = "prefix=" + (q.get("prefix", [""])[0][len(root_prefix):].lstrip("/") if q.get("prefix") else "")
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
