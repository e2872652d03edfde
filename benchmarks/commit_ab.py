"""Real W-rank saves of two txckpt checkouts, side by side (issue 33: "real 2- and 4-rank saves
no slower than today"): ``python -m benchmarks.commit_ab BASE [CANDIDATE] [--rounds N]
[--saves S] [--mib M]``.

``BASE`` and ``CANDIDATE`` are directories holding a ``txckpt/`` package (e.g. ``git worktree
add /tmp/base <commit>``; the candidate defaults to this checkout). Each round runs both, in an
order that alternates, for W = 2 and then 4: W real processes (gloo on a file store), each rank
holding ``M`` MiB (half a float32 tensor saved as torch, half random bytes), call
``txckpt.save_checkpoint(root, step, files)`` (fsync on) ``S`` times on a fresh root; a save's
time is the slowest rank's (a max all-reduce of each rank's time from a barrier to its return).
Reported per W: the median over rounds of the per-round ratio candidate ÷ base of the median of
saves 2..S (later saves: a writer session's steady state), its range, and the ratio of the first
saves' medians. Not part of ``make bench``: it compares two checkouts, not txckpt with another tool.
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

_WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist

def main(rank, world, store, root, out, saves, mib):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    import txckpt
    assert txckpt.__file__.startswith(os.environ["TXCKPT_AB_EXPECT"]), txckpt.__file__
    files = {f"rank{rank}.pt": {"w": torch.randn(mib * (1 << 20) // 8)}, f"rank{rank}.bin": os.urandom(mib * (1 << 19))}
    times = []
    for step in range(1, saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        txckpt.save_checkpoint(root, step, files)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    a = sys.argv[1:]
    mp.spawn(main, args=(int(a[0]), a[1], a[2], a[3], int(a[4]), int(a[5])), nprocs=int(a[0]))
"""


def _one(impl: str, world: int, saves: int, mib: int) -> list[float]:
    """One job of ``world`` ranks on ``impl``'s txckpt: each save's slowest-rank time."""
    d = tempfile.mkdtemp(prefix="txckpt-ab-")
    try:
        worker, out = os.path.join(d, "worker.py"), os.path.join(d, "times.json")
        with open(worker, "w") as f:
            f.write(_WORKER)
        env = {**os.environ, "PYTHONPATH": impl, "TXCKPT_AB_EXPECT": impl}
        subprocess.run(
            [
                sys.executable,
                worker,
                str(world),
                os.path.join(d, "store"),
                os.path.join(d, "root"),
                out,
                str(saves),
                str(mib),
            ],
            env=env,
            check=True,
            timeout=600,
        )
        with open(out) as f:
            return [float(t) for t in json.load(f)]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(prog="python -m benchmarks.commit_ab")
    p.add_argument("base")
    p.add_argument("candidate", nargs="?", default=here)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--mib", type=int, default=8, help="MiB per rank")
    a = p.parse_args(argv)
    impls = {"base": os.path.abspath(a.base), "candidate": os.path.abspath(a.candidate)}
    for impl in impls.values():
        if not os.path.isfile(os.path.join(impl, "txckpt", "__init__.py")):
            p.error(f"{impl} holds no txckpt/ package")
    for world in (2, 4):
        later: dict[str, list[float]] = {k: [] for k in impls}
        first: dict[str, list[float]] = {k: [] for k in impls}
        ratios = []
        for r in range(a.rounds):
            for k in list(impls) if r % 2 == 0 else list(impls)[::-1]:
                t = _one(impls[k], world, a.saves, a.mib)
                first[k].append(t[0])
                later[k].append(statistics.median(t[1:]))
            ratios.append(later["candidate"][-1] / later["base"][-1])
        med = {k: statistics.median(v) for k, v in later.items()}
        print(
            f"W={world}: saves 2..{a.saves}: candidate {med['candidate'] * 1e3:.1f} ms, base {med['base'] * 1e3:.1f} ms; "
            f"per-round ratio median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, "
            f"{a.rounds} rounds); first save: ratio of medians "
            f"{statistics.median(first['candidate']) / statistics.median(first['base']):.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
