"""The crash campaign's ``crash/local/async-atexit`` case: a job's final save from an ``atexit``
handler (issue 29, item 4; docs/async.md, "At shutdown a save is synchronous").

Each run is a real interpreter (``python -m tests.reliability.atexit_save``), because what is under
test is the interpreter's own shutdown: the child commits nothing itself in ``main``; it requests an
``async_save`` of step 3 (still pending when ``main`` returns: txckpt's exit hook finishes it) and
registers an ``atexit`` handler that saves step 4 with ``async_save``, the fault injector installed
around that save only. The counting run must exit 0 with step 4 committed by the time the
interpreter is gone (a fresh process finds it the newest, carrying its tags); then the child is
SIGKILLed before or after each of the atexit save's file operations and a fresh process checks
every invariant (invariants.py): lookup returns step 3 or step 4, never a mix, a restarted job
resumes and saves, gc leaks nothing. Quick mode samples 6 points (each is an interpreter start
with torch), full mode every point.

Both the case (imported by crash.py: its main role, so it stays with the campaign) and the child
interpreter's entry point (tests/test_architecture.py lists it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.harness.procs import child_value, run_child

from .core import REPO, Case, Ctx, Result, classify, payload
from .invariants import check, snapshot

STEP_MAIN, STEP_ATEXIT = 3, 4


def child_main(root: str, kill_at: int, when: str, out: str) -> None:
    """The job: an async save pending at exit, then the final one from an atexit handler."""
    import atexit

    import txckpt

    from .injectors import LocalInjector

    inj = LocalInjector(kill_at=kill_at or None, when=when, under=os.path.dirname(root))

    def final_save() -> None:
        inj.install()
        try:
            future = txckpt.async_save(root, STEP_ATEXIT, payload(f"A-{STEP_ATEXIT}", STEP_ATEXIT))
            done = future.done()
            outcome = future.result()
        except Exception as e:  # reported to the parent, which judges it
            done, outcome = None, f"{type(e).__name__}: {e}"
        finally:
            inj.uninstall()
        with open(out, "w") as f:
            json.dump({"outcome": outcome, "done_at_return": done, "ops": inj.records}, f, default=str)

    txckpt.async_save(root, STEP_MAIN, payload(f"A-{STEP_MAIN}", STEP_MAIN))  # pending at exit
    atexit.register(final_save)


def _run(root: str, kill_at: int, when: str, out: str) -> tuple[int, dict[str, Any] | None, str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run(
        [sys.executable, "-m", "tests.reliability.atexit_save", root, str(kill_at), when, out],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = None
    if os.path.exists(out):
        with open(out) as f:
            report = json.load(f)
    return p.returncode, report, p.stderr[-2000:]


def atexit_sweep(ctx: Ctx, case: Case, result: Result) -> None:
    from .core import rmtree
    from .crash import choose_points

    template = os.path.join(ctx.workdir, "atexit-template", "root")

    def build() -> dict[str, Any]:
        import txckpt

        txckpt.save_checkpoint(template, 2, payload("A-2", 2))
        return snapshot(template, None)

    before = child_value(build, "building the atexit template")

    def fresh(point: str) -> str:
        import shutil

        d = os.path.join(ctx.workdir, "atexit-points", point)
        rmtree(d)
        shutil.copytree(os.path.dirname(template), d, symlinks=True)
        return os.path.join(d, "root")

    found: list[str] = []
    root = fresh("count")
    code, report, err = _run(root, 0, "before", root + ".json")
    result.tried = 1
    if code != 0 or not report or report["outcome"] != os.path.join(root, f"checkpoint-{STEP_ATEXIT}"):
        classify(
            result,
            [f"[lost] the atexit save did not commit (exit {code}; {report and report['outcome']}): {err}"],
            case.known,
        )
        return
    if report["done_at_return"] is not True:
        found.append(
            "[atexit] async_save from an atexit handler returned before its save finished: nothing would wait for it"
        )
    # The finished run: step 4 is the newest, for a fresh process, with every invariant.
    ccode, verdict = run_child(
        lambda: check(root, None, {"allowed": [f"A-{STEP_ATEXIT}"], "before": before}), timeout=300
    )
    if ccode != 0:
        found.append(f"completed run: [harness] the checker failed: {verdict and verdict.get('error')}")
    else:
        found += [f"completed run: {x}" for x in verdict["ok"]]
    rmtree(os.path.dirname(root))
    ops = report["ops"]
    pts = choose_points(ops, "local", ctx.quick, every=True, cap=6 if ctx.quick else None, seed=ctx.seed)
    expect = {"allowed": [f"A-{STEP_MAIN}", f"A-{STEP_ATEXIT}"], "before": before}
    unreached = 0
    for k, when in pts:
        point = f"{k}{when[0]}"
        u = fresh(point)
        code, report, err = _run(u, k, when, u + ".json")
        label = f"atexit save: {when} op {k}/{len(ops)} ({ops[k - 1]['name']})"
        if code == 0:
            unreached += 1  # fewer ops than the counting run: the completed state is checked
        elif code != -9:
            found.append(f"{label}: [harness] the child was not killed and failed (exit {code}): {err}")
            rmtree(os.path.dirname(u))
            continue
        ccode, verdict = run_child(lambda u=u: check(u, None, expect), timeout=300)
        if ccode != 0:
            found.append(f"{label}: [harness] the checker failed: {verdict and verdict.get('error')}")
        else:
            found += [f"{label}: {x}" for x in verdict["ok"]]
        rmtree(os.path.dirname(u))
    result.points = len(pts)
    result.notes.append(
        f"{len(ops)} file ops in the atexit save, {len(pts)} points"
        + (" (sampled)" if len(pts) < 2 * len(ops) else "")
        + (f", {unreached} not reached (fewer ops; the completed state was checked)" if unreached else "")
        + "; the unkilled run exits 0 with step 4 committed"
    )
    classify(result, found, case.known)


def crash_cases() -> list[Case]:
    return [
        Case(
            "crash/local/async-atexit",
            "crash",
            "async_save from an atexit handler (a save of main still pending at exit), the interpreter "
            "SIGKILLed at each file op of the atexit save",
            "local",
            atexit_sweep,
            cost=40,
            cost_full=200,
        )
    ]


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
