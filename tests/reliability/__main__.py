"""``python -m tests.reliability [--quick] [--out PATH] [--only SUBSTRING ...]``

Runs the campaign (see tests/reliability/__init__.py) and writes the scorecard (default
docs/reliability.md). Exit status 1 if a violation is not explained by a known issue, or the
harness failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

from .core import REPO, Case, Ctx, Result, machine, run_cases, scratch_base, warm_up


def all_cases() -> list[Case]:
    from . import badinput, concurrency, crash, powerloss, ranks, soak

    return crash.cases() + powerloss.cases() + concurrency.cases() + badinput.cases() + ranks.cases() + soak.cases()


def run(
    quick: bool,
    only: list[str] | None = None,
    workers: int = 2,
    seed: int = 0,
    budget: float | None = None,
    progress=print,
) -> tuple[list[Result], float, dict[str, str]]:
    """Run the (selected) cases; returns (results, wall seconds, machine info)."""
    logging.getLogger("txckpt").addHandler(logging.NullHandler())
    logging.getLogger("txckpt").propagate = False
    cases = all_cases()
    if only:
        cases = [c for c in cases if any(o in c.id for o in only)]
    server = None
    endpoint = None
    if any(c.needs_s3 for c in cases):
        from . import s3

        try:
            server = s3.ServerProcess()
            endpoint = server.endpoint
            s3.apply_fake_env()
        except Exception as e:  # no moto here: S3 cases report the reason
            progress(f"no S3 server ({e}); S3 cases are skipped")
            cases = [c for c in cases if not c.needs_s3]
    warm_up(trainer=any("trainer" in c.id for c in cases), s3=endpoint is not None)
    workdir = tempfile.mkdtemp(prefix="txckpt-reliability-", dir=scratch_base())
    load_before = os.getloadavg()
    t0 = time.monotonic()
    try:
        results = run_cases(
            cases, Ctx(workdir, quick, seed, endpoint), workers=workers, budget=budget, progress=progress
        )
    finally:
        if server is not None:
            server.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - t0
    info = machine()
    info["Mode"] = ("quick" if quick else "full") + f", seed {seed}, {workers} cases at a time"
    # The wall time depends on what else the 2 cores run: say how busy they were.
    info["Load average"] = (
        f"{' '.join(f'{x:.2f}' for x in load_before)} at the start, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end (1/5/15 min; "
        f"the campaign itself keeps about {workers} busy)"
    )
    return results, wall, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI mode (< 6 minutes)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "reliability.md"))
    ap.add_argument("--json", default=None, help="also write the raw results as JSON")
    ap.add_argument("--only", nargs="*", help="run the cases whose id contains one of these")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    cmd = "python -m tests.reliability" + (" --quick" if args.quick else "")
    print(f"{cmd}: running...", flush=True)
    results, wall, info = run(args.quick, args.only, args.workers, args.seed, progress=lambda s: print(s, flush=True))
    from .report import render

    text = render(results, info, quick=args.quick, wall=wall, command=cmd)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_json() for r in results], f, indent=1)
    new = sum(len(r.violations) for r in results)
    errors = sum(1 for r in results if r.error)
    known = sum(len(r.known_violations) for r in results)
    print(
        f"{len(results)} cases, {new} unexplained violations, {errors} harness errors, {known} known-issue "
        f"violations; {wall / 60:.1f} min; wrote {args.out}"
    )
    return 1 if new or errors else 0


if __name__ == "__main__":
    sys.exit(main())
