"""Crash injection by counting file operations and SIGKILLing a real process at each one.

A *scenario* is a function run in a child process against a root. The harness first runs it with
a tracer that counts every file operation txckpt performs (open-for-write, write, fsync, link,
rename, replace, unlink, mkdir, rmdir), then, for every operation k, runs it again on a fresh
copy of the root in a child that SIGKILLs itself immediately before op k, and once more
immediately after it. A *checker* then runs in another fresh process and returns the
violations it found. A sweep called with ``sampled=True`` (the campaign's) tries every point
around an operation that flips what a reader sees (:func:`flips_visibility`) and a seeded share
of the others; ``TXCKPT_FULL_SWEEP=1`` tries them all (tests/harness/sampling.py).

Children are forked from the test process (which has imported torch and txckpt already), so a
crash point costs milliseconds; each child starts with no txckpt state of its own (the parent
never opened the copied root). The tracer and the fork runner are the suite's own
(tests/harness/tracer.py, tests/harness/procs.py); this module is the sweep built on them.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.harness import sampling
from tests.harness.procs import run_child
from tests.harness.tracer import Tracer


@dataclass
class SweepResult:
    name: str
    ops: list[str]
    crash_points: int = 0  # the points tried: all 2 * len(ops) unless the sweep was sampled
    violations: list[str] = field(default_factory=list)
    sampled: bool = False


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

    code, result = run_child(child)
    assert code == 0 and result and "ok" in result, f"counting run failed: {result}"
    shutil.rmtree(root)
    return result["ok"]


#: The names in an operation that a reader's view of the root hangs on: a manifest, a log entry,
#: the `latest` hint.
_VISIBLE = ("txckpt-manifest", "/log/", "latest")


def flips_visibility(op: str) -> bool:
    """Whether ``op`` is one of the atomic steps that change what a reader sees: the link, rename
    or replace that puts a manifest, a log entry (the commit point) or `latest` in place, or the
    rename that publishes a checkpoint. The outcome of a crash flips across these; the writes and
    fsyncs between two of them leave the state the crash just before the next one leaves."""
    if op.startswith("rename_noreplace("):
        return True
    return op.startswith(("link(", "rename(", "replace(")) and any(v in op for v in _VISIBLE)


def request_flips_visibility(request: str) -> bool:
    """The object-store counterpart of :func:`flips_visibility`, for a mutating S3 request as
    tests/reliability/injectors.py names it (``PutObject(if-none-match) .txckpt/log/...``): one
    that puts or removes a manifest, a log entry (the commit point) or `latest`."""
    return any(v in request for v in _VISIBLE)


def sweep(
    name: str,
    template: str,
    workdir: str,
    scenario: Callable[[str], Any],
    check: Callable[[str, int, str], list[str]],
    *,
    sampled: bool = False,
    share: float = sampling.SHARE,
    limit: int | None = None,
) -> SweepResult:
    """Crash ``scenario`` before and after each of its file operations; ``check(root, k, when)``
    runs in a fresh process and returns violations. ``sampled``: only the points that
    :func:`tests.harness.sampling.sample` draws (all of them under ``TXCKPT_FULL_SWEEP=1``), with
    ``share`` of the non-critical ones, and at most ``limit`` of those, a seeded draw (a sweep
    whose every point costs a framework's start-up takes fewer; the runs cover the rest)."""
    ops = count_ops(template, workdir, scenario)
    result = SweepResult(name, ops, sampled=sampled)
    points = [(k, when) for k in range(1, len(ops) + 1) for when in ("before", "after")]
    if sampled:
        points = sampling.sample(name, points, lambda p: flips_visibility(ops[p[0] - 1]), share=share)
        if limit is not None and not sampling.FULL and len(points) > limit:
            points = sorted(random.Random(f"{sampling.sweep_seed()}:{name}:limit").sample(points, limit))
    for k, when in points:
        root = os.path.join(workdir, f"{k}-{when}")
        shutil.copytree(template, root, symlinks=True)

        def child(root=root, k=k, when=when):
            tracer = Tracer(kill_at=k, when=when)
            tracer.install()
            scenario(root)
            return "completed without reaching the crash point"

        code, out = run_child(child)
        result.crash_points += 1
        if code != -signal.SIGKILL:
            result.violations.append(f"{when} op {k} ({ops[k - 1]}): child was not killed: {code} {out}")
            continue
        code, verdict = run_child(lambda root=root, k=k, when=when: check(root, k, when))
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

    tried = sampling.describe(result.crash_points, 2 * len(result.ops), full=not result.sampled)
    line = (
        f"crash sweep [{result.name}]: {len(result.ops)} file operations, crash points (SIGKILL before "
        f"or after an op): {tried}, {len(result.violations)} violations"
    )
    conftest.SUMMARY_LINES.append(line)
    print(line)
    assert not result.violations, "\n".join(result.violations[:20])


def s3_request_sweep(
    name: str,
    base: str,
    fresh: Callable[[str], Any],
    scenario: Callable[[Any], Any],
    check: Callable[[Any], list[str]],
    *,
    share: float = sampling.SHARE,
    limit: int | None = None,
    done: Callable[[Any], None] | None = None,
) -> tuple[list[dict[str, Any]], list[tuple[int, str]], list[tuple[int, str]], list[str]]:
    """The object-store counterpart of :func:`sweep`: crash ``scenario`` before and after each of
    its mutating S3 requests (tests/reliability/injectors.py counts and kills them), on the
    requests under ``base`` (the bucket prefix of every copy). ``fresh(point)`` makes a point's
    copy of the template (its data under ``base``/``point``) and returns what ``scenario`` and
    ``check`` take; the counting run is the point ``count``. Each crash runs in a child that must
    die by SIGKILL; ``check(copy)`` runs in a fresh child and returns violations; ``done(copy)``
    cleans up after a point. The points: :func:`tests.harness.sampling.sample`'s draw (every
    request that flips what a reader sees, and ``share`` of the rest), then at most ``limit`` of
    them drawn by the seed. Returns (requests, every point, points tried, violations)."""
    from tests.reliability.injectors import S3Injector

    counted = fresh("count")

    def count() -> list[Any]:
        inj = S3Injector(None, mode=None, root_prefix=f"{base}/count").install()
        try:
            scenario(counted)
        finally:
            inj.uninstall()
        return inj.records

    code, out = run_child(count, timeout=300)
    assert code == 0 and "ok" in out, out
    ops = out["ok"]
    every = [(k, when) for k in range(1, len(ops) + 1) for when in ("before", "after") if ops[k - 1]["mut"]]
    points = sampling.sample(name, every, lambda p: request_flips_visibility(ops[p[0] - 1]["name"]), share=share)
    if limit is not None and not sampling.FULL:
        points = sorted(random.Random(f"{sampling.sweep_seed()}:{name}").sample(points, min(limit, len(points))))
    found: list[str] = []
    for k, when in points:
        point = f"{k}-{when}"
        copy = fresh(point)

        def child(copy: Any = copy, point: str = point, k: int = k, when: str = when) -> str:
            S3Injector(k, when=when, root_prefix=f"{base}/{point}").install()
            scenario(copy)
            return "completed without reaching the crash point"

        code, out = run_child(child, timeout=300)
        op = ops[k - 1]["name"]
        if code != -signal.SIGKILL:
            found.append(f"{when} {op}: child was not killed: {code} {out}")
            continue
        code, verdict = run_child(lambda copy=copy: check(copy), timeout=300)
        if code != 0:
            found.append(f"{when} {op}: checker failed: {verdict}")
        elif verdict["ok"]:
            found += [f"{when} {op}: {v}" for v in verdict["ok"]]
        if done is not None:
            done(copy)
    from tests import conftest

    line = (
        f"crash sweep [{name}]: {len(ops)} S3 requests ({len(every) // 2} mutating), crash points (SIGKILL "
        f"before or after a mutating one): {sampling.describe(len(points), len(every))}, {len(found)} violations"
    )
    conftest.SUMMARY_LINES.append(line)
    print(line)
    return ops, every, points, found
