"""Profiles for the report: where the time of a txckpt operation goes (cProfile, own time)."""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from typing import Any, Callable


def profile_call(
    label: str,
    fn: Callable[[Any], Any],
    setup: Callable[[], Any] | None = None,
    cleanup: Callable[[Any], None] | None = None,
    top: int = 12,
) -> str:
    """Run ``fn(setup())`` under cProfile; return a markdown block of the functions with the most
    own time (I/O shows as the builtin that blocks: ``posix.fsync``, ``write``, ``read``)."""
    ctx = setup() if setup else None
    os.sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        fn(ctx)
    finally:
        prof.disable()
        wall = time.perf_counter() - t0
        if cleanup:
            cleanup(ctx)
    st = pstats.Stats(prof)
    entries = []
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        entries.append((tt, ct, nc, _where(filename, line, func)))
    entries.sort(reverse=True)
    lines = [
        f"Profile: {label} — {wall:.3f} s wall (cProfile; own time per function, top {top})",
        "",
        "| own s | % of wall | cumulative s | calls | function |",
        "|---:|---:|---:|---:|---|",
    ]
    for tt, ct, nc, where in entries[:top]:
        lines.append(f"| {tt:.3f} | {100 * tt / wall:.0f}% | {ct:.3f} | {nc} | `{where}` |")
    return "\n".join(lines)


def _where(filename: str, line: int, func: str) -> str:
    if filename == "~":
        return func.strip("<>")
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("txckpt", "torch", "safetensors", "transformers", "benchmarks"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return f"{'/'.join(parts[i:])}:{line}:{func}"
    return f"{parts[-1]}:{line}:{func}"


def fsync_census(
    label: str,
    fn: Callable[[Any], Any],
    setup: Callable[[], Any] | None = None,
    cleanup: Callable[[Any], None] | None = None,
    root_of: Callable[[Any], str] | None = None,
) -> str:
    """Run ``fn(setup())`` once with ``os.fsync`` wrapped (in this process only) and return a
    markdown table of every fsync: what it synced and how long it blocked."""
    ctx = setup() if setup else None
    os.sync()
    real = os.fsync
    calls: list[tuple[float, str]] = []

    def timed_fsync(fd):
        t = time.perf_counter()
        real(fd)
        dt = time.perf_counter() - t
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = "?"
        calls.append((dt, path))

    os.fsync = timed_fsync
    t0 = time.perf_counter()
    try:
        fn(ctx)
    finally:
        wall = time.perf_counter() - t0
        os.fsync = real
        root = root_of(ctx) if (root_of and ctx is not None) else ""
        if cleanup:
            cleanup(ctx)
    total = sum(c[0] for c in calls)
    lines = [
        f"fsync census: {label} — {wall:.3f} s wall, {len(calls)} fsync calls blocking {total:.3f} s "
        f"({100 * total / wall:.0f}% of wall)",
        "",
        "| # | blocked | what |",
        "|---:|---:|---|",
    ]
    for i, (dt, path) in enumerate(calls, 1):
        shown = path.replace(root, "<root>") if root else path
        if os.path.isdir(path) or not os.path.splitext(path)[1]:
            shown += " (directory)" if os.path.isdir(path) else ""
        lines.append(f"| {i} | {dt * 1e3:.1f} ms | `{shown}` |")
    return "\n".join(lines)
