"""Crash injection by counting file operations and SIGKILLing a real process at each one.

A *scenario* is a function run in a child process against a root. The harness first runs it with
a tracer that counts every file operation txckpt performs (open-for-write, write, fsync, link,
rename, replace, unlink, mkdir, rmdir), then, for every operation k, runs it again on a fresh
copy of the root in a child that SIGKILLs itself immediately before op k, and once more
immediately after it. A *checker* then runs in another fresh process and returns the
violations it found.

Children are forked from the test process (which has imported torch and txckpt already), so a
crash point costs milliseconds; each child starts with no txckpt state of its own (the parent
never opened the copied root). The tracer and the fork runner are the suite's own
(tests/harness/tracer.py, tests/harness/procs.py); this module is the sweep built on them.
"""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.harness.procs import run_child
from tests.harness.tracer import Tracer


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

    code, result = run_child(child)
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

    line = (f"crash sweep [{result.name}]: {len(result.ops)} file operations, "
            f"{result.crash_points} crash points (SIGKILL before and after each), "
            f"{len(result.violations)} violations")
    conftest.SUMMARY_LINES.append(line)
    print(line)
    assert not result.violations, "\n".join(result.violations[:20])

