"""``python -m benchmarks run [--quick] [--tiny] [--cases save,load] [--out DIR]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import CASES
from . import harness as h


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b") if text.strip().lower().endswith(("ib", "b")) else text.strip().lower()
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the benchmarks and write docs/benchmarks.md and .png")
    r.add_argument("--quick", action="store_true", help="64 MiB only, few rounds, ~10M model (under 3 minutes)")
    r.add_argument("--tiny", action="store_true", help="smoke test: tiny sizes, measures nothing")
    r.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)}")
    r.add_argument("--sizes", help="comma-separated sizes, e.g. 64M,256M (default by mode)")
    r.add_argument("--out", default=os.path.join(here, "docs"), help="directory for benchmarks.md/.png")
    r.add_argument("--scratch", help="directory for written files (default .bench-tmp; never tmpfs)")
    rr = sub.add_parser("render", help="rewrite benchmarks.md/.png from the last run's saved results "
                                         "(after editing benchmarks/analysis.py or report.py; measures nothing)")
    rr.add_argument("--results", help="results.json of a run (default: <scratch>/results.json)")
    rr.add_argument("--out", default=os.path.join(here, "docs"))
    rr.add_argument("--scratch", help="the run's scratch directory (default .bench-tmp)")
    a = p.parse_args(argv)
    if a.cmd == "render":
        return render(a)

    s = h.configure(quick=a.quick, tiny=a.tiny, scratch=a.scratch,
                    sizes=[_size(x) for x in a.sizes.split(",")] if a.sizes else None)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cases = a.cases.split(",") if a.cases else CASES
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {CASES}")
    h.log(f"mode={'tiny' if s.tiny else 'quick' if s.quick else 'full'} sizes={[h.fmt_size(x) for x in s.sizes]} "
          f"scratch={s.scratch}")
    t0 = time.perf_counter()
    tables = []
    for c in cases:
        h.log(f"case {c}")
        for t in h.run_case(c, s.quick):
            if t.get("status") != "ok":
                h.log(f"case {c}: {t.get('status')}: {t.get('reason')}")
            tables.append(t)
    h.remove(os.path.join(s.scratch, "run"))
    elapsed = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    from .report import write_markdown, write_plot

    png = os.path.join(a.out, "benchmarks.png")
    have_png = write_plot(png, tables)
    md = os.path.join(a.out, "benchmarks.md")
    machine = h.machine()
    write_markdown(md, tables, machine, png if have_png else None, elapsed)
    with open(os.path.join(s.scratch, "results.json"), "w") as f:
        json.dump({"mode": {"quick": s.quick, "tiny": s.tiny}, "machine": machine, "elapsed": elapsed,
                   "tables": tables}, f, indent=1, default=str)
    h.log(f"wrote {md}{' and ' + png if have_png else ''} in {elapsed:.0f} s; raw results in "
          f"{os.path.join(s.scratch, 'results.json')}")
    failed = [t["title"] for t in tables if t.get("status") == "failed"]
    if failed:
        h.log(f"failed cases: {failed}")
    return 0


def render(a) -> int:
    from .report import write_markdown, write_plot

    scratch = os.path.abspath(a.scratch or h.default_scratch())
    path = a.results or os.path.join(scratch, "results.json")
    with open(path) as f:
        saved = json.load(f)
    h.configure(quick=saved["mode"]["quick"], tiny=saved["mode"]["tiny"], scratch=scratch)
    os.makedirs(a.out, exist_ok=True)
    png = os.path.join(a.out, "benchmarks.png")
    have_png = write_plot(png, saved["tables"])
    md = os.path.join(a.out, "benchmarks.md")
    write_markdown(md, saved["tables"], saved["machine"], png if have_png else None, saved["elapsed"])
    h.log(f"re-rendered {md} from {path} (measured {saved['machine'].get('Date')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
