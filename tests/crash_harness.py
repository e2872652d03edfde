"""Crash injection by counting file operations and SIGKILLing a real process at each one.

A *scenario* is a function run in a child process against a root. The harness first runs it with
a tracer that counts every file operation txckpt performs (open-for-write, write, fsync, link,
rename, replace, unlink, mkdir, rmdir), then, for every operation k, runs it again on a fresh
copy of the root in a child that SIGKILLs itself immediately before op k, and once more
immediately after it. A *checker* then runs in another fresh process and returns the
violations it found.

Children are forked from the test process (which has imported torch and txckpt already), so a
crash point costs milliseconds; each child starts with no txckpt state of its own (the parent
never opened the copied root).
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

_WRITE_MODES = set("wax+")


class Tracer:
    """Counts file operations; kills the process before/after op ``kill_at`` (1-based)."""

    def __init__(self, kill_at: int | None = None, when: str = "before"):
        self.kill_at = kill_at
        self.when = when
        self.count = 0
        self.ops: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []
        # Ops may run on several threads at once (the commit hashes and fsyncs files written by
        # other code in a pool): each op takes its number under the lock and is judged by it.
        self._lock = threading.Lock()

    def op(self, name: str, fn: Callable, *args, **kwargs):
        with self._lock:
            self.count += 1
            n = self.count
            self.ops.append(name)
        if n == self.kill_at and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            return fn(*args, **kwargs)
        finally:  # an op that fails (mkdir of an existing dir) has still happened
            if n == self.kill_at and self.when == "after":
                os.kill(os.getpid(), signal.SIGKILL)

    def _patch(self, owner: Any, attr: str, name: str) -> None:
        real = getattr(owner, attr)
        self._saved.append((owner, attr, real))
        tracer = self

        def wrapper(*args, **kwargs):
            return tracer.op(f"{name}({_short(args)})", real, *args, **kwargs)

        setattr(owner, attr, wrapper)

    def install(self) -> None:
        import txckpt.storage.local as local

        for attr in ("fsync", "link", "rename", "replace", "unlink", "mkdir", "rmdir"):
            self._patch(os, attr, attr)
        self._patch(local, "rename_noreplace", "rename_noreplace")
        real_open = builtins.open
        self._saved.append((builtins, "open", real_open))
        tracer = self

        def traced_open(file, mode="r", *args, **kwargs):
            if not (set(mode) & _WRITE_MODES) or not isinstance(file, (str, bytes, os.PathLike)):
                return real_open(file, mode, *args, **kwargs)
            f = tracer.op(f"open({_short((file,))}, {mode})", real_open, file, mode, *args, **kwargs)
            return _TracedFile(f, tracer, os.fspath(file))

        builtins.open = traced_open

    def uninstall(self) -> None:
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved.clear()


class _TracedFile:
    def __init__(self, f, tracer: Tracer, path):
        self._f = f
        self._tracer = tracer
        self._path = path

    def write(self, data):
        return self._tracer.op(f"write({_short((self._path,))}, {len(memoryview(data).cast('B'))})", self._f.write, data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _short(args) -> str:
    out = []
    for a in args:
        if isinstance(a, (str, bytes, os.PathLike)):
            p = os.fsdecode(a)
            out.append("/".join(p.split("/")[-3:]))
        elif isinstance(a, int):
            out.append("fd")
    return ", ".join(out)


def _run_child(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Fork; run fn in the child; return (signal or exit code, fn's JSON result or error)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            result = {"ok": fn()}
        except BaseException as e:  # report, don't raise through the fork
            result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=-3)}
            code = 3
        with os.fdopen(w, "w") as out:
            out.write(json.dumps(result, default=str))
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status), (json.loads(data) if data else None)
    return os.WEXITSTATUS(status), (json.loads(data) if data else None)


@dataclass
class SweepResult:
    name: str
    ops: list[str]
    crash_points: int = 0
    violations: list[str] = field(default_factory=list)


def count_ops(template: str, workdir: str, scenario: Callable[[str], Any]) -> list[str]:
    root = os.path.join(workdir, "count")
    shutil.copytree(template, root, symlinks=True)

    def child():
        tracer = Tracer()
        tracer.install()
        try:
            scenario(root)
        finally:
            tracer.uninstall()
        return tracer.ops

    code, result = _run_child(child)
    assert code == 0 and result and "ok" in result, f"counting run failed: {result}"
    shutil.rmtree(root)
    return result["ok"]


def sweep(
    name: str,
    template: str,
    workdir: str,
    scenario: Callable[[str], Any],
    check: Callable[[str, int, str], list[str]],
) -> SweepResult:
    """Crash ``scenario`` before and after each of its file operations; ``check(root, k, when)``
    runs in a fresh process and returns violations."""
    ops = count_ops(template, workdir, scenario)
    result = SweepResult(name, ops)
    for k in range(1, len(ops) + 1):
        for when in ("before", "after"):
            root = os.path.join(workdir, f"{k}-{when}")
            shutil.copytree(template, root, symlinks=True)

            def child(root=root, k=k, when=when):
                tracer = Tracer(kill_at=k, when=when)
                tracer.install()
                scenario(root)
                return "completed without reaching the crash point"

            code, out = _run_child(child)
            result.crash_points += 1
            if code != -signal.SIGKILL:
                result.violations.append(f"{when} op {k} ({ops[k - 1]}): child was not killed: {code} {out}")
                continue
            code, verdict = _run_child(lambda root=root, k=k, when=when: check(root, k, when))
            if code != 0:
                result.violations.append(f"{when} op {k} ({ops[k - 1]}): checker failed: {verdict}")
            elif verdict and verdict["ok"]:
                result.violations.extend(f"{when} op {k} ({ops[k - 1]}): {v}" for v in verdict["ok"])
            shutil.rmtree(root, ignore_errors=True)
    return result


def report(result: "SweepResult") -> None:
    """Print a sweep's one-line summary (also into pytest's terminal summary) and fail on any
    violation: the tail every crash-sweep test shares."""
    from tests import conftest

    line = (f"crash sweep [{result.name}]: {len(result.ops)} file operations, "
            f"{result.crash_points} crash points (SIGKILL before and after each), "
            f"{len(result.violations)} violations")
    conftest.SUMMARY_LINES.append(line)
    print(line)
    assert not result.violations, "\n".join(result.violations[:20])

