"""The one operation tracer of the test suite: count operations, and at one of them crash.

A :class:`Tracer` numbers every operation it sees and, at the one named by ``kill_at``, does what
its ``mode`` says:

* ``kill``   SIGKILL this process immediately before the op, or immediately after it returns
             (``on_crash`` runs first; ``label_file`` records where it died);
* ``raise``  raise :class:`InjectedCrash` (a BaseException, like KeyboardInterrupt: txckpt's
             ``except Exception`` handlers do not swallow it, its ``finally`` blocks do run);
* ``enospc`` make the op fail with ``OSError(ENOSPC)`` instead of running it (only ops that can
             run out of space: ``inject=True``).

``kill_at`` is an op's 1-based index, or with ``by_occurrence`` the pair (name, how many times that
name occurred up to it; see :func:`occurrences`): ranks race to create shared directories, so the
index of an op can differ by one between runs while its name and occurrence do not.

:meth:`Tracer.install` interposes the Python-level file operations txckpt and its callers make:
``open`` for writing and every ``write`` on such a file, ``os.fsync/link/rename/replace/unlink/
mkdir/rmdir``, ``txckpt._storage.local.store.rename_noreplace`` (renameat2) and ``txckpt._base.fileio.rename_exchange``. Writes done inside C or
Rust code (``torch.save`` to a *path*, safetensors' ``save_file``) are not interposed: a crash point
before and after the neighbouring operations brackets them. Subclasses interpose other layers
(tests/reliability/injectors.py: fsspec's memory store, S3 requests) and call :meth:`op`.

What each user counts stays its own, through the options:

* ``coalesce_writes``: consecutive writes to one file are one op (they land in a userspace buffer,
  torch.save issues dozens of tiny ones, so a crash between two of them leaves the state of a crash
  before the run); "after" such a run means before the next op. Otherwise every write is an op
  (and ``records`` groups the writes of one run).
* ``count_nested``: whether an op made while another op of the same thread runs is counted
  (``rename_noreplace``'s fallback calls ``os.rename``).
* ``under``: only ops on paths below it are counted (``rename_noreplace`` and fd ops always are).
* ``root``: op names show paths below it as ``<root>/...``; ``rename`` turns names stable across
  runs (random ids out); ``write_sizes``: whether a write's name carries its size.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import signal
import threading
from typing import Any, Callable

_WRITE_MODES = set("wax+")
OS_OPS = ("fsync", "link", "rename", "replace", "unlink", "mkdir", "rmdir")
#: os ops that free space rather than take it: never made to fail with ENOSPC.
_NO_SPACE_NEEDED = ("unlink", "rmdir")


class InjectedCrash(BaseException):
    """Raised at the injection point in ``raise`` mode."""


def occurrences(ops: list[str]) -> list[tuple[str, int]]:
    """Each op as (name, how many times that name occurred up to and including it): a crash
    point that survives small differences in op order between runs."""
    seen: dict[str, int] = {}
    out = []
    for op in ops:
        seen[op] = seen.get(op, 0) + 1
        out.append((op, seen[op]))
    return out


def short(args: Any, root: str | None = None) -> str:
    """Op arguments for a name: paths relative to ``root`` (else their last three components),
    ``fd`` for a file descriptor."""
    out = []
    for a in args:
        if isinstance(a, (str, bytes, os.PathLike)):
            p = os.fsdecode(a)
            if root and (p == root or p.startswith(root + "/")):
                p = "<root>" + p[len(root) :]
            else:
                p = "/".join(p.split("/")[-3:])
            out.append(p)
        elif isinstance(a, int):
            out.append("fd")
    return ", ".join(out)


class Tracer:
    def __init__(
        self,
        kill_at: int | tuple[str, int] | None = None,
        when: str = "before",
        *,
        mode: str | None = "kill",
        on_crash: Callable[[], None] | None = None,
        by_occurrence: bool = False,
        coalesce_writes: bool = False,
        count_nested: bool = True,
        under: str | None = None,
        root: str | None = None,
        write_sizes: bool = True,
        rename: Callable[[str], str] | None = None,
        label_file: str | None = None,
    ):
        self.kill_at: int | tuple[str, int] | None = tuple(kill_at) if by_occurrence and kill_at else kill_at  # type: ignore[arg-type]  # a JSON list
        self.when = when
        self.mode = mode if kill_at is not None else None
        self.on_crash = on_crash
        self.by_occurrence = by_occurrence
        self.coalesce_writes = coalesce_writes
        self.count_nested = count_nested
        #: Only paths below ``under`` are counted (None: every path).
        self.under = os.path.realpath(under) if under else None
        self.root = os.path.abspath(root) if root else None
        self.write_sizes = write_sizes
        self.rename = rename
        self.label_file = label_file
        self.count = 0
        self.ops: list[str] = []
        #: Per op: {"name", "mut" (changes storage), "group" (write-run id), "inject" (ENOSPC-able)}.
        self.records: list[dict[str, Any]] = []
        self.fired = False
        self._seen: dict[str, int] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._real_open = builtins.open  # the label file is written past the tracer
        # Ops may run on several threads at once (the commit fsyncs staged files in a pool): each
        # op takes its number under the lock, and the nesting depth is per thread (a shared one
        # left one thread's fsync uncounted while another's ran).
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._last_write: str | None = None
        self._group = 0
        self._run_key: str | None = None
        self._kill_pending = False

    # ----- the decision at one operation ---------------------------------------------------------
    def _record(self, name: str, mut: bool, write_key: str | None, inject: bool) -> tuple[int, int]:
        with self._lock:
            if write_key is None or write_key != self._last_write:
                self._group += 1
            self._last_write = write_key
            self.count += 1
            self.ops.append(name)
            self.records.append({"name": name, "mut": mut, "group": self._group, "inject": inject})
            self._seen[name] = self._seen.get(name, 0) + 1
            return self.count, self._seen[name]

    def _crash(self, where: str, completed: int | None = None) -> None:
        self.fired = True
        if self.mode == "raise":
            raise InjectedCrash(f"injected crash {where} op {self.kill_at}")
        if self.label_file:  # which op this process dies at (the op order can vary a little)
            done = self.ops if completed is None else self.ops[:completed]
            with self._real_open(self.label_file, "w") as f:
                json.dump(
                    {"k": self.kill_at, "when": self.when, "op": self.ops[-1] if self.ops else None, "done": done}, f
                )
        if self.on_crash is not None:
            self.on_crash()
        os.kill(os.getpid(), signal.SIGKILL)

    def op(
        self,
        name: str,
        fn: Callable,
        *args: Any,
        mut: bool = True,
        write_key: str | None = None,
        inject: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as the operation ``name``, counted and judged."""
        depth = getattr(self._tls, "depth", 0)
        if depth and not self.count_nested:
            return fn(*args, **kwargs)
        if self.coalesce_writes:
            if write_key is not None and write_key == self._run_key:
                return fn(*args, **kwargs)  # the same run of writes
            self._run_key = write_key
        if self._kill_pending:  # "after" a write run: before the op that ends it
            self._crash("after")
        raw = name  # the ENOSPC error names the op as it was (ids and all), as a real one would
        if self.rename is not None:
            name = self.rename(name)
        k, nth = self._record(name, mut, write_key, inject)
        mine = self.mode is not None and (self.kill_at == (name, nth) if self.by_occurrence else k == self.kill_at)
        if mine and self.mode == "enospc":
            self.fired = True
            raise OSError(errno.ENOSPC, "No space left on device (injected)", raw)
        if mine and self.when == "before":
            self._crash("before", completed=len(self.ops) - 1)
        self._tls.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:  # an op that fails (mkdir of an existing dir) has still happened
            self._tls.depth = depth
            if mine and self.when == "after":
                if self.coalesce_writes and write_key is not None:
                    self._kill_pending = True
                else:
                    self._crash("after")

    async def op_async(self, name: str, fn: Callable, *args: Any, mut: bool = True) -> Any:
        """:meth:`op` for a coroutine (an S3 request); not coalesced, not nested."""
        if self.rename is not None:
            name = self.rename(name)
        k, nth = self._record(name, mut, None, False)
        mine = self.mode is not None and (self.kill_at == (name, nth) if self.by_occurrence else k == self.kill_at)
        if mine and self.when == "before":
            self._crash("before")
        try:
            return await fn(*args)
        finally:
            if mine and self.when == "after":
                self._crash("after")

    # ----- interposing ---------------------------------------------------------------------------
    def _patch(self, owner: Any, attr: str, wrapper_factory: Callable[[Any], Any]) -> None:
        real = getattr(owner, attr)
        self._saved.append((owner, attr, real))
        setattr(owner, attr, wrapper_factory(real))

    def _mine(self, args: Any) -> bool:
        if self.under is None:
            return True
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)):
                p = os.path.abspath(os.fsdecode(a))
                return (
                    p == self.under
                    or p.startswith(self.under + os.sep)
                    or os.path.realpath(p).startswith(self.under + os.sep)
                )
        return True  # fd-based (fsync): counted

    def name(self, what: str, args: Any, extra: str = "") -> str:
        return f"{what}({short(args, self.root)}{extra})"

    def install(self) -> "Tracer":
        """Interpose the local file operations (see the module docstring)."""
        import txckpt._base.fileio as fileio
        import txckpt._storage.local.store as local

        tracer = self
        for attr in OS_OPS:

            def factory(real: Any, attr: str = attr) -> Any:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    if not tracer._mine(args):
                        return real(*args, **kwargs)
                    return tracer.op(
                        tracer.name(attr, args), real, *args, inject=attr not in _NO_SPACE_NEEDED, **kwargs
                    )

                return wrapper

            self._patch(os, attr, factory)

        def rn_factory(real: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return tracer.op(tracer.name("rename_noreplace", args), real, *args, **kwargs)

            return wrapper

        # LocalStorage calls its own binding; the code above storage/ (fetch, Accelerate's
        # directories) calls fileio's: each call passes one of the two wrappers, once.
        self._patch(local, "rename_noreplace", rn_factory)
        self._patch(fileio, "rename_noreplace", rn_factory)

        def rx_factory(real: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return tracer.op(tracer.name("rename_exchange", args), real, *args, **kwargs)

            return wrapper

        self._patch(fileio, "rename_exchange", rx_factory)  # called as fileio.rename_exchange

        def open_factory(real_open: Any) -> Any:
            def traced_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
                if (
                    not (set(mode) & _WRITE_MODES)
                    or not isinstance(file, (str, bytes, os.PathLike))
                    or not tracer._mine((file,))
                ):
                    return real_open(file, mode, *args, **kwargs)
                f = tracer.op(tracer.name("open", (file,), f", {mode}"), real_open, file, mode, *args, **kwargs)
                return TracedFile(f, tracer, os.fsdecode(file))

            return traced_open

        self._patch(builtins, "open", open_factory)
        return self

    def uninstall(self) -> None:
        if self._kill_pending:
            self._crash("after")
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved.clear()

    def __enter__(self) -> "Tracer":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


class TracedFile:
    """A file opened for writing under a tracer: each ``write`` is an op."""

    def __init__(self, f: Any, tracer: Tracer, path: str):
        self._f = f
        self._tracer = tracer
        self._path = path

    def write(self, data: Any) -> int:
        size = ""
        if self._tracer.write_sizes:
            size = f", {len(data) if isinstance(data, str) else memoryview(data).nbytes}"
        return self._tracer.op(
            self._tracer.name("write", (self._path,), size), self._f.write, data, write_key=self._path
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __iter__(self) -> Any:
        return iter(self._f)

    def __enter__(self) -> "TracedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()
