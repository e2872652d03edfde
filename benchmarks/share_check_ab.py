"""A/B of the check before a share (issue 45): the frozen-base incremental save
(benchmarks/incremental.py's state: a base of S bytes, an adapter of S/64 and its Adam state)
with this tree's txckpt against another tree's (the code before), alternating rounds.

Each round runs, for each tree in turn (the order alternating), one fresh process on a fresh
root: save 1 (writes everything, untimed), save 2 (the process's first share of the base: here
it reads the base once more to check it), then saves 3..3+N (steady state: each shared base is
trusted by its unchanged identity); then a new process (a restart) saves 4 more steps, its first
save reading the shared base once to check it. Printed: per round the ratio this/other of save
2, of the median steady save and of the first save after the restart, and the medians of those
per-round ratios.

    python -m benchmarks.share_check_ab OTHER_TREE [--size-mib 256] [--rounds 6] [--saves 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch, txckpt
root, size, first, saves = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
base = {f"layer{i}.w": torch.randn(size // 4 // 8, generator=g) for i in range(8)}
adapter = {"lora.a": torch.randn(max(size // 64 // 4, 64), generator=g)}
def files(step):
    a = {k: v + step for k, v in adapter.items()}
    return {"base.safetensors": base, "adapter.safetensors": a,
            "optimizer.pt": {"exp_avg": {k: v * 0.5 for k, v in a.items()},
                             "exp_avg_sq": {k: v * v for k, v in a.items()}, "step": step},
            "config.json": {"layers": 8, "frozen": True}}
times = []
for step in range(first, first + saves):
    t = time.perf_counter()
    txckpt.save_checkpoint(root, step, files(step), incremental=True)
    times.append(time.perf_counter() - t)
print("RESULT " + json.dumps({"file": txckpt.__file__, "times": times}))
"""


def _process(tree: str, root: str, size: int, first: int, saves: int) -> list[float]:
    """Seconds of each save of steps first .. first+saves-1, in a new process on ``root``."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, root, str(size), str(first), str(saves)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert result["file"].startswith(os.path.abspath(tree)), (result["file"], tree)
    return result["times"]


def _child(tree: str, size: int, saves: int) -> dict:
    """One process saving steps 1 .. saves+2, then a new one (a restart) saving 4 more."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = os.path.join(tmp, "root")
        times = _process(tree, root, size, 1, saves + 2)
        after = _process(tree, root, size, saves + 3, 4)
    return {"first_share": times[1], "steady": times[2:], "restart": after[0], "after": after[1:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--saves", type=int, default=8)
    args = ap.parse_args()
    this = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = os.path.abspath(args.other)
    size = args.size_mib << 20
    first, steady, restart = [], [], []
    for r in range(args.rounds):
        order = [this, other] if r % 2 == 0 else [other, this]
        got = {tree: _child(tree, size, args.saves) for tree in order}
        a, b = got[this], got[other]
        first.append(a["first_share"] / b["first_share"])
        steady.append(statistics.median(a["steady"]) / statistics.median(b["steady"]))
        restart.append(a["restart"] / b["restart"])
        print(
            f"round {r}: first share {a['first_share'] * 1e3:.0f} ms vs {b['first_share'] * 1e3:.0f} ms "
            f"({first[-1]:.3f}); steady median {statistics.median(a['steady']) * 1e3:.1f} ms vs "
            f"{statistics.median(b['steady']) * 1e3:.1f} ms ({steady[-1]:.3f}); first save after a restart "
            f"{a['restart'] * 1e3:.0f} ms vs {b['restart'] * 1e3:.0f} ms ({restart[-1]:.3f})",
            flush=True,
        )
    print(
        f"median of per-round ratios (this/other): first share {statistics.median(first):.3f}, "
        f"steady {statistics.median(steady):.3f}, first after a restart {statistics.median(restart):.3f}"
    )


if __name__ == "__main__":
    main()
