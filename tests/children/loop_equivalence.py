"""A plain training loop (no Trainer, no Accelerate) that checkpoints with txckpt's functions and
resumes exactly, run by tests/test_resume_equivalence_loop.py (issue 32). It is the recipe of
docs/preemption.md, "A plain loop": what a loop must save to continue as if it had never stopped.

Usage: loop_equivalence.py OUT WORKERS ASYNC STOP [resume | resume-without-rng] [--rank R --world W --store PATH]

* the model has dropout, the data is shuffled by the DataLoader's own generator (one rank) or a
  DistributedSampler (two ranks, gloo DDP), with WORKERS loader workers;
* every ``EVERY`` steps (and at a preemption) it saves, with ``txckpt.save_checkpoint`` (ASYNC 0)
  or ``txckpt.async_save`` (ASYNC 1): the weights and the optimizer (rank 0), and per rank
  ``txckpt.rng_state()``, the loader generator's state at the start of the epoch, and the
  position (epoch, batches done);
* STOP ``kill:K`` SIGKILLs every rank right after step K (nothing pending is finished);
  ``term:K`` makes rank 0 send itself SIGTERM after step K: ``txckpt.preemption`` agrees on it at
  the step boundary (one all-reduce), every rank saves step K and exits with 143; ``0`` runs to
  the end;
* ``resume``: ``txckpt.resume(OUT/ckpt)`` names the newest committed checkpoint of the run's
  lineage; the loop restores it, rebuilds the epoch's loader from the saved generator state,
  skips the batches done, restores the RNGs and goes on.

Each rank appends ``[step, loss]`` to ``OUT.losses.r{R}``; rank 0 prints ``WEIGHTS <sha1>`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys

import torch
from torch import nn

import txckpt
from txckpt import preemption

EPOCHS, EVERY, N, BATCH = 3, 3, 48, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x)))).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("workers", type=int)
    p.add_argument("use_async", type=int)
    p.add_argument("stop")
    p.add_argument("resume", nargs="?", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{a.store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    root = os.path.join(a.out, "ckpt")
    kind, _, at = a.stop.partition(":")
    stop_step = int(at) if at else None
    if kind == "term":
        preemption.install()

    torch.manual_seed(0)  # the same initial weights on every rank
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g), torch.randn(N, generator=g))
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if world > 1:
        ddp = nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    else:
        ddp, sampler = model, None
    loader_gen = torch.Generator().manual_seed(2)
    torch.manual_seed(100 + rank)  # dropout differs per rank, as in real data parallelism

    epoch, done, step = 0, 0, 0
    restore = None
    path = txckpt.resume(root) if a.resume else None
    if path is not None:  # None: the stop came before any save committed; start again
        saved = txckpt.load_checkpoint(path, files=["model.safetensors", "optimizer.pt", "loop.json", f"rng_{rank}.pt"])
        model.load_state_dict(saved["model.safetensors"])
        opt.load_state_dict(saved["optimizer.pt"])
        pos = saved["loop.json"]
        epoch, done, step = pos["epoch"], pos["done"], pos["step"]
        loader_gen.set_state(saved[f"rng_{rank}.pt"]["loader_at_epoch_start"])
        restore = saved[f"rng_{rank}.pt"]["rng"]

    losses = open(f"{a.out}.losses.r{rank}", "a")
    while epoch < EPOCHS:
        if sampler is not None:
            sampler.set_epoch(epoch)
        at_epoch_start = loader_gen.get_state()  # what rebuilds this epoch's order on a resume
        loader = torch.utils.data.DataLoader(
            data,
            batch_size=BATCH,
            shuffle=sampler is None,
            sampler=sampler,
            num_workers=a.workers,
            generator=loader_gen,
        )
        it = iter(loader)
        for _ in range(done):  # a resume skips the batches this epoch already trained on
            next(it)
        if restore is not None:  # after the loader drew its order and worker seeds, as the run did
            if a.resume != "resume-without-rng":  # the control: what a loop that forgets it gets
                txckpt.set_rng_state(restore)
            restore = None
        for x, y in it:
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step, done = step + 1, done + 1
            losses.write(json.dumps([step, loss.item()]) + "\n")
            losses.flush()
            if kind == "kill" and step == stop_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "term" and step == stop_step and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded; acted on at the boundary below
            stop = kind == "term" and preemption.requested()
            if step % EVERY == 0 or stop:
                files = {f"rng_{rank}.pt": {"rng": txckpt.rng_state(), "loader_at_epoch_start": at_epoch_start}}
                if rank == 0:
                    files.update(
                        {
                            "model.safetensors": dict(model.state_dict()),
                            "optimizer.pt": opt.state_dict(),
                            "loop.json": {"epoch": epoch, "done": done, "step": step},
                        }
                    )
                if a.use_async:
                    txckpt.async_save(root, step, files)
                else:
                    txckpt.save_checkpoint(root, step, files)
            if stop:
                preemption.exit()  # finishes the pending async save first
        epoch, done = epoch + 1, 0
    txckpt.wait_for_saves()
    if rank == 0:
        digest = hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
        print("WEIGHTS", digest.hexdigest(), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
