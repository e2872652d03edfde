"""torch.distributed.checkpoint through txckpt against plain DCP, 2 ranks, same state.

Two real processes with a gloo process group on 127.0.0.1 (CPU). Each rank holds ``size``
bytes of float32 under keys of its own (so each rank writes its own shard, as FSDP2 ranks do).
Every round runs both sides of each comparison, in an order that alternates between rounds,
each from a barrier after the dirty pages of the previous phase were synced (untimed); the time
is the slowest rank's:

* save: ``dcp.save(state, storage_writer=TransactionalWriter(root, step))`` (fsync on: every
  shard, ``.metadata``, the manifest and the commit entry) ÷ ``dcp.save(state,
  storage_writer=FileSystemWriter(dir, sync_files=True))`` into a new directory;
* load: ``dcp.load`` through ``TransactionalReader(path)`` (default ``verify="full"``: the
  manifest checked against the log, every shard read whole and hashed before use) ÷ ``dcp.load``
  through ``FileSystemReader`` of the plain save, both into preallocated tensors, both from the
  page cache: rank 0 reads both sides' files once, untimed, after the saves (a durable txckpt
  save drops what is on the disk from the cache, txckpt/_storage/local/store.py ``_CACHE_BUDGET``;
  DCP's writer leaves it cached).

Reported: the median over rounds of the per-round ratios, against the goals of issue 17 (save
≤ 1.05, load ≤ 1.10), with the medians of both sides.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any

TITLE = "DCP: TransactionalWriter / TransactionalReader vs plain torch DCP, 2 ranks"
SAVE_GOAL, LOAD_GOAL = 1.05, 1.10
WORLD = 2
MiB = 1 << 20

TX_SAVE, DCP_SAVE = "dcp.save via TransactionalWriter", "dcp.save via FileSystemWriter"
TX_LOAD, DCP_LOAD = "dcp.load via TransactionalReader", "dcp.load via FileSystemReader"


def _scratch() -> str:
    try:
        from . import harness

        return harness.settings().scratch
    except Exception:  # run on its own
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return os.environ.get("TXCKPT_BENCH_DIR") or os.path.join(here, ".bench-tmp")


def _read_through(path: str) -> None:
    """Read every file under ``path`` once, so that the next load finds it in the page cache."""
    buf = bytearray(8 * MiB)
    for dirpath, _d, filenames in os.walk(path):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def _state(rank: int, size: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rank)
    out, left, i = {}, max(1, size // 4), 0
    while left > 0:
        n = min(left, 4 << 20)  # tensors of at most 16 MiB, as a model's layers
        out[f"rank{rank}.layer{i}"] = torch.empty(n).uniform_(-1, 1, generator=g)
        left -= n
        i += 1
    return out


def _worker(rank: int, port: int, base: str, size: int, rounds: int, warmup: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from txckpt.integrations.dcp import TransactionalReader, TransactionalWriter
    from . import harness as h

    os.environ["TXCKPT_DURABLE"] = "1"  # as FileSystemWriter's sync_files=True
    with h.gloo_rank(rank, WORLD, port, queue, timeout_s=600):
        state = _state(rank, size)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        root = os.path.join(base, "root")
        times: dict[str, list[float]] = {TX_SAVE: [], DCP_SAVE: [], TX_LOAD: [], DCP_LOAD: []}
        tx_path = plain_dir = None

        def timed(what: str, r: int, fn: Any) -> Any:
            if rank == 0:
                os.sync()  # untimed: no write-back of the previous phase is charged to this one
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            every: list[Any] = [None] * WORLD
            dist.all_gather_object(every, dt)
            if r >= warmup:
                times[what].append(max(every))
            return out

        for r in range(warmup + rounds):
            plain = os.path.join(base, f"plain-{r}")
            for method in ["tx", "plain"] if r % 2 == 0 else ["plain", "tx"]:
                if method == "tx":
                    w = TransactionalWriter(root, r + 1)
                    timed(TX_SAVE, r, lambda: dcp.save(state, storage_writer=w))
                    tx_path = w.path if rank == 0 else None
                else:
                    timed(DCP_SAVE, r, lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(plain)))
            paths: list[Any] = [tx_path]
            dist.broadcast_object_list(paths, src=0)
            if rank == 0:  # untimed: both sides load from the page cache
                _read_through(paths[0])
                _read_through(plain)
            dist.barrier()
            for method in ["plain", "tx"] if r % 2 == 0 else ["tx", "plain"]:
                if method == "tx":
                    timed(TX_LOAD, r, lambda: dcp.load(target, storage_reader=TransactionalReader(paths[0])))
                else:
                    timed(DCP_LOAD, r, lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(plain)))
            if not all(torch.equal(target[k], state[k]) for k in state):
                raise AssertionError("a load returned other tensors than were saved")
            dist.barrier()
            if rank == 0:  # untimed cleanup: keep the disk use at one round
                if plain_dir is not None:
                    shutil.rmtree(plain_dir, ignore_errors=True)
                plain_dir = plain
                if r > 0:
                    shutil.rmtree(os.path.join(root, f"checkpoint-{r}"), ignore_errors=True)
        if rank == 0:
            queue.put({"times": times})


def measure(size: int, rounds: int, warmup: int = 1, deadline: float = 1800.0) -> dict[str, Any]:
    from .ranks import launch_ranks

    return launch_ranks(_worker, "dcp", WORLD, size, rounds, warmup, deadline)


def _row(times: dict[str, list[float]], tx: str, other: str, size: int, goal: float, note: str) -> dict[str, Any]:
    paired = [a / b for a, b in zip(times[tx], times[other]) if b > 0]
    a, b = statistics.median(times[tx]), statistics.median(times[other])
    return {
        "case": f"{tx} ÷ {other}",
        "size": size,
        "txckpt": a,
        "other": b,
        "ratio": statistics.median(paired),
        "goal": goal,
        "reps": len(paired),
        "paired": paired,
        "note": f"{WORLD} ranks × {size // MiB} MiB; ratio = median of per-round ratios (ratio of medians "
        f"{a / b:.2f}){note}",
    }


def run(quick: bool) -> dict[str, Any]:
    from . import harness

    tiny = harness.settings().tiny
    size = (1 if tiny else 64 if quick else 256) * MiB
    rounds = 1 if tiny else 5 if quick else 7
    result = measure(size, rounds, warmup=0 if tiny else 1)
    times = result["times"]
    rows = [
        _row(times, TX_SAVE, DCP_SAVE, size, SAVE_GOAL, ""),
        _row(times, TX_LOAD, DCP_LOAD, size, LOAD_GOAL, '; verify="full" (every shard hashed before use)'),
    ]
    return {
        "id": "dcp",
        "title": TITLE,
        "rows": rows,
        "about": __doc__.split("\n\n", 1)[1].strip(),
        "save_ratio": rows[0]["ratio"],
        "load_ratio": rows[1]["ratio"],
    }


if __name__ == "__main__":  # python -m benchmarks.dcp [--quick]
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=1, default=str))
