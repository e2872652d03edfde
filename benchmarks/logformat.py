"""Log entry size and history cost against the number of commits and lineages (protocol §4).

``python benchmarks/logformat.py [--scratch DIR] [--reps N] [--cycles N]`` with the txckpt to
measure on PYTHONPATH (so the same script measures an older txckpt side by side). Builds (once,
cached in DIR) a root of 10,000 commits across 50 lineages and one of 50 commits, exactly as
benchmarks/lookup.py does, then reports, for each:

- the largest and the newest log entry, and the log's size;
- ``txckpt ls ROOT`` and ``resume(root, step=K)`` (a fork, on a fresh copy) in a fresh process,
  and the fold alone (``CheckpointRoot.history()`` from a fresh root object), as medians;
- the ratio of the 10,000-commit root's time to the 50-commit root's;

and a soak-like loop (save, retention keep_last=3, a rollback every 20 cycles) with its first
and last cycles' mean time. Prints a Markdown table; measures only, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(path: str, commits: int, lineages: int) -> dict:
    import txckpt._log.log as commit_log

    stamp_path = path + ".json"
    want = {
        "commits": commits,
        "lineages": lineages,
        "log": commit_log.FORMAT,
        "snapshot": getattr(commit_log, "SNAPSHOT_FORMAT", None),
    }
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            stamp = json.load(f)
        if {k: stamp.get(k) for k in want} == want and os.path.isdir(path):
            return stamp
    shutil.rmtree(path, ignore_errors=True)
    sys.path.insert(0, HERE)
    from benchmarks.lookup import build_root

    stamp = {**want, **build_root(path, commits, lineages)}
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return stamp


def _log_sizes(path: str) -> tuple[int, int, int, int]:
    d = os.path.join(path, ".txckpt", "log")
    names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
    sizes = [os.path.getsize(os.path.join(d, n)) for n in names]
    return len(names), max(sizes), sizes[-1], sum(sizes)


def _fresh(code: str) -> float:
    """Wall time of a fresh interpreter running ``code`` (imports included, as a user sees it)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, env=os.environ.copy())
    return time.perf_counter() - t0


def _measure(path: str, stamp: dict, reps: int, scratch: str) -> dict:
    ls = f"import sys; from txckpt.cli import main; sys.exit(main(['ls', {path!r}]))"
    fold = (
        "import time, txckpt; r = txckpt.CheckpointRoot(%r); t = time.perf_counter(); r.history(); "
        "open(%r, 'a').write(f'{time.perf_counter() - t}\\n')"
    )
    out: dict = {"ls": [], "resume": [], "fold": []}
    fold_file = os.path.join(scratch, "fold.txt")
    step = max(1, stamp["tip"] - 3)  # an older step of the current lineage: resume forks
    for _ in range(reps):
        out["ls"].append(_fresh(ls))
        if os.path.exists(fold_file):
            os.unlink(fold_file)
        _fresh(fold % (path, fold_file))
        with open(fold_file) as f:
            out["fold"].append(float(f.read()))
        copy = os.path.join(scratch, "copy")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(path, copy, symlinks=True)
        out["resume"].append(
            _fresh(
                f"import logging, txckpt; logging.getLogger('txckpt').setLevel(logging.ERROR); "
                f"txckpt.resume({copy!r}, step={step})"
            )
        )
        shutil.rmtree(copy, ignore_errors=True)
    return {k: statistics.median(v) for k, v in out.items()}


def _soak(cycles: int, scratch: str) -> tuple[float, float, float, float]:
    import logging

    from txckpt import CheckpointRoot
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention

    logging.getLogger("txckpt").setLevel(logging.ERROR)
    path = os.path.join(scratch, "soak")
    shutil.rmtree(path, ignore_errors=True)
    r = CheckpointRoot(path, durable=False)
    policy = RetentionPolicy(keep_last=3, abandoned=0)
    times, cpu, step = [], [], 0
    for c in range(cycles):
        t0, c0 = time.perf_counter(), time.process_time()
        if c and c % 20 == 0:
            step -= 2
            r.resume(step=step)
        step += 1
        r.save(step, {"trainer_state.json": {"global_step": step}})
        apply_retention(r, policy)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    shutil.rmtree(path, ignore_errors=True)
    # The first window starts once retention has something to retire (keep_last=3) and the
    # first rollback happened; medians, as other processes share the disk.
    k = max(1, cycles // 20)
    first, last = slice(k // 2, k // 2 + k), slice(-k, None)
    return (
        statistics.median(times[first]),
        statistics.median(times[last]),
        statistics.median(cpu[first]),
        statistics.median(cpu[last]),
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "txckpt-logformat-bench"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cycles", type=int, default=1000)
    args = p.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    import txckpt._log.log as commit_log

    tag = f"{commit_log.FORMAT}-{getattr(commit_log, 'SNAPSHOT_FORMAT', '')}".replace("/", "-")
    roots = {"10,000 commits / 50 lineages": (10_000, 50), "50 commits / 1 lineage": (50, 1)}
    rows = {}
    for label, (commits, lineages) in roots.items():
        path = os.path.join(args.scratch, f"{tag}-{commits}x{lineages}")
        stamp = _build(path, commits, lineages)
        rows[label] = (_log_sizes(path), _measure(path, stamp, args.reps, args.scratch))
    print(f"txckpt {commit_log.FORMAT}, medians of {args.reps} fresh processes\n")
    print(
        "| root | entries | largest entry | newest entry | log | `txckpt ls` | `resume(step=K)` | fold (in process) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, ((n, big, new, total), t) in rows.items():
        print(
            f"| {label} | {n:,} | {big / 1024:.2f} KiB | {new / 1024:.2f} KiB | {total / 2**20:.2f} MiB | "
            f"{t['ls']:.2f} s | {t['resume']:.2f} s | {1e3 * t['fold']:.1f} ms |"
        )
    (_, a), (_, b) = rows.values()
    print(
        f"| ratio (10,000 ÷ 50) | | | | | {a['ls'] / b['ls']:.2f}× | {a['resume'] / b['resume']:.2f}× | "
        f"{a['fold'] / b['fold']:.1f}× |"
    )
    if args.cycles:
        first, last, cfirst, clast = _soak(args.cycles, args.scratch)
        k = max(1, args.cycles // 20)
        print(
            f"\nsoak-like loop, {args.cycles} cycles (save + retention keep_last=3, a rollback every 20), "
            f"median of cycles {k // 2}-{k // 2 + k - 1} vs the last {k}: wall {1e3 * first:.1f} -> {1e3 * last:.1f} ms "
            f"({last / first:.2f}×), CPU {1e3 * cfirst:.1f} -> {1e3 * clast:.1f} ms ({clast / cfirst:.2f}×)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
