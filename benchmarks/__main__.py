"""``python -m benchmarks run [--quick] [--tiny] [--cases save,load] [--out DIR]``;
``python -m benchmarks render [--results R] [--merge R2]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import CASES, EXTRA_CASES
from . import harness as h


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = (
        text.strip().lower().rstrip("ib").rstrip("b")
        if text.strip().lower().endswith(("ib", "b"))
        else text.strip().lower()
    )
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
    r.add_argument(
        "--out",
        help="directory for benchmarks.md/.png (default docs/; for a --cases subset, "
        "<scratch>/partial-<cases>/, so that a partial run never replaces "
        "docs/benchmarks.md: fold it in with `render --merge`)",
    )
    r.add_argument("--scratch", help="directory for written files (default .bench-tmp; never tmpfs)")
    rr = sub.add_parser(
        "render",
        help="rewrite benchmarks.md/.png from the last run's saved results "
        "(after editing benchmarks/analysis.py or report.py; measures nothing)",
    )
    rr.add_argument("--results", help="results.json of a run (default: <scratch>/results.json)")
    rr.add_argument("--out", default=os.path.join(here, "docs"))
    rr.add_argument("--scratch", help="the run's scratch directory (default .bench-tmp)")
    rr.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="RESULTS",
        help="results of a later run of some cases (`run --cases s3` writes "
        "<scratch>/results.s3.json): "
        "its tables replace the same tables of --results, the machine table records "
        "when and at which commit and load they were measured, and the merged "
        "results are written to <scratch>/results.json (repeatable)",
    )
    a = p.parse_args(argv)
    if a.cmd == "render":
        return render(a)

    s = h.configure(
        quick=a.quick, tiny=a.tiny, scratch=a.scratch, sizes=[_size(x) for x in a.sizes.split(",")] if a.sizes else None
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cases = a.cases.split(",") if a.cases else CASES
    unknown = [c for c in cases if c not in CASES + EXTRA_CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {CASES}")
    h.log(
        f"mode={'tiny' if s.tiny else 'quick' if s.quick else 'full'} sizes={[h.fmt_size(x) for x in s.sizes]} "
        f"scratch={s.scratch}"
    )
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
    partial = a.cases is not None and set(cases) != set(CASES)
    tag = "+".join(cases)
    if a.out is None:
        a.out = os.path.join(s.scratch, f"partial-{tag}") if partial else os.path.join(here, "docs")
    results = os.path.join(s.scratch, f"results.{tag}.json" if partial else "results.json")
    os.makedirs(a.out, exist_ok=True)
    from .report import write_markdown, write_plot

    png = os.path.join(a.out, "benchmarks.png")
    have_png = write_plot(png, tables)
    md = os.path.join(a.out, "benchmarks.md")
    machine = h.machine()
    if a.cases:
        machine["Command"] += f" --cases {a.cases}"
    write_markdown(md, tables, machine, png if have_png else None, elapsed)
    with open(results, "w") as f:
        json.dump(
            {"mode": {"quick": s.quick, "tiny": s.tiny}, "machine": machine, "elapsed": elapsed, "tables": tables},
            f,
            indent=1,
            default=str,
        )
    h.log(f"wrote {md}{' and ' + png if have_png else ''} in {elapsed:.0f} s; raw results in {results}")
    if partial:
        h.log(
            f"a partial run: to update docs/benchmarks.md with it, `python -m benchmarks render "
            f"--merge {results}` (the other sections stay those of {os.path.join(s.scratch, 'results.json')})"
        )
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
    for other_path in a.merge:
        saved = _merge(saved, other_path)
    if a.merge:
        with open(os.path.join(scratch, "results.json"), "w") as f:
            json.dump(saved, f, indent=1, default=str)
    h.configure(quick=saved["mode"]["quick"], tiny=saved["mode"]["tiny"], scratch=scratch)
    os.makedirs(a.out, exist_ok=True)
    png = os.path.join(a.out, "benchmarks.png")
    have_png = write_plot(png, saved["tables"])
    md = os.path.join(a.out, "benchmarks.md")
    write_markdown(md, saved["tables"], saved["machine"], png if have_png else None, saved["elapsed"])
    h.log(f"re-rendered {md} from {path} (measured {saved['machine'].get('Date')})")
    return 0


def _merge(saved: dict, other_path: str) -> dict:
    """``saved`` with the tables of the run in ``other_path`` in place of its own of the same id
    (or title); a partial run never wipes the other sections. The machine table keeps the first
    run's rows and gains one per merged run."""
    with open(other_path) as f:
        other = json.load(f)
    if other["mode"] != saved["mode"]:
        raise SystemExit(f"{other_path} was measured in mode {other['mode']}, the results in {saved['mode']}")
    key = lambda t: t.get("id") or t["title"]  # noqa: E731
    new = {key(t): t for t in other["tables"]}
    tables = [new.pop(key(t), t) for t in saved["tables"]] + list(new.values())
    m = other["machine"]
    titles = ", ".join(dict.fromkeys(t["title"].split(":")[0] for t in other["tables"]))
    machine = dict(saved["machine"])
    machine[f"Re-measured: {titles}"] = (
        f"`{m.get('Command')}` ({other['elapsed'] / 60:.1f} min) on {m.get('Date')}, txckpt "
        f"{m.get('txckpt')}, load average {m.get('Load average')}"
    )
    return {**saved, "machine": machine, "tables": tables}


if __name__ == "__main__":
    sys.exit(main())
