"""Rank targets of tests/test_async_save.py (started by tests/harness/launcher.launch)."""

from __future__ import annotations

from typing import Any


def async_saves_beside_training(rank: int, world: int, *, root: str, steps: list[int], lazy: bool = False) -> Any:
    """Each rank async-saves its own files; while each save runs in the background, the job
    runs its own collectives on the default group (an all_reduce and a barrier); at the end it
    waits for the saves. Returns the committed paths and the all_reduce results. ``lazy``: the
    tensor is an SGD optimizer's parameter, saved with ``optimizer=``, and the training step
    after the save is that optimizer's step (which waits for the background copy)."""
    import torch
    import torch.distributed as dist

    import txckpt

    futures, sums = [], []
    for step in steps:
        w = torch.full((256,), float(rank + step))
        files = {f"rank{rank}.safetensors": {"w": w}, f"rank{rank}.pt": {"step": step, "rank": rank}}
        if lazy:
            p = torch.nn.Parameter(w)
            opt = torch.optim.SGD([p], lr=1.0)
            futures.append(txckpt.async_save(root, step, files, optimizer=opt))
            p.grad = p.detach() + 1.0
            opt.step()  # p becomes -1, after the background copied it: never in the checkpoint
            assert float(w[0]) == -1.0
        else:
            futures.append(txckpt.async_save(root, step, files))
            w.fill_(-1.0)  # the training step after the snapshot: never in the checkpoint
        for _ in range(20):  # the job's own collectives, interleaved with the background save
            t = torch.ones(4) * (rank + 1)
            dist.all_reduce(t)
            sums.append(float(t[0]))
        dist.barrier()
    txckpt.wait_for_saves()
    return {"paths": [f.result() for f in futures], "sums": sorted(set(sums))}


def async_save_with_dead_rank(rank: int, world: int, *, root: str, victim: int) -> Any:
    """A first async save commits; then ``victim`` dies (SIGKILL) before its second save, and
    the survivors' background save must fail with a typed error, not hang."""
    import os
    import signal

    import torch

    import txckpt

    first = txckpt.async_save(root, 1, {f"rank{rank}.pt": {"w": torch.ones(8) * rank}}).result()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    f = txckpt.async_save(root, 2, {f"rank{rank}.pt": {"w": torch.ones(8) * rank}})
    try:
        txckpt.wait_for_saves()
    except Exception as e:
        if f.exception() is not e:
            raise AssertionError(f"wait_for_saves raised {e!r}, not the future's error") from e
        raise  # reported to the test (a rank whose peer died skips the group's teardown)
    return {"first": first}
