"""An accelerate training loop for the resume-equivalence matrix
(tests/test_resume_equivalence_accelerate.py, issue 32): the loop accelerate's documentation
shows, with nothing of its own to make the resume exact.

  accelerate_equivalence.py OUT WORKERS STOP [resume] [--stock] [--seedable] [--rank R --world W --store FILE]

* ``acc.prepare(model, optimizer, dataloader)``: a model with dropout, a DataLoader with
  ``shuffle=True`` (no generator of its own) and WORKERS workers; 3 epochs of 48 rows in
  batches of 4 (12 steps an epoch on one process, 6 on two: the loader is sharded);
* ``save_state(OUT/project/step_<step>)`` every 2 steps (synchronous: TransactionalAccelerator
  has no asynchronous save_state);
* STOP ``kill:K``: every process SIGKILLs itself right after step K; ``term:K``: the last
  process alone sends itself SIGTERM after step K, and ``save_state_if_preempted`` at the step
  boundary makes every process save step K and exit 143 (``save_on_preemption=True``); ``0``:
  run to the end;
* ``resume``: ``acc.load_state()`` (the newest committed checkpoint of the project), the step is
  ``project_configuration.iteration - 1``; the epoch's remaining batches come from
  ``acc.skip_first_batches(dataloader, done)``;
* ``--stock``: the same loop with ``accelerate.Accelerator``: it resumes from the newest
  ``step_<n>`` directory (``load_state(path)``), and SIGTERM kills it (no preemption save);
* ``--seedable``: ``DataLoaderConfiguration(use_seedable_sampler=True)``: accelerate's sampler
  reseeds every epoch from its epoch number (``set_epoch``) instead of drawing a seed.

Each process appends ``[step, loss]`` to ``OUT.losses.r{R}``; every process prints
``WEIGHTS <sha1>`` at the end. With ``--world 2`` the processes rendezvous on ``--store`` (a
FileStore, gloo) before the accelerator, as tests/children/accelerate_preempt.py's.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

EPOCHS, EVERY, N, BATCH = 3, 2, 48, 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("workers", type=int)
    p.add_argument("stop")
    p.add_argument("resume", nargs="?", default="")
    p.add_argument("--stock", action="store_true")
    p.add_argument("--seedable", action="store_true", help="DataLoaderConfiguration(use_seedable_sampler=True)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store", default=None)
    a = p.parse_args()
    import torch
    from torch import nn

    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    if world > 1:  # one process: no group, no variables
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{a.store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    from txckpt.integrations.accelerate import TransactionalAccelerator

    kind, _, at = a.stop.partition(":")
    stop_step = int(at) if at else None
    project = os.path.join(a.out, "project")
    config = ProjectConfiguration(project_dir=project)
    loading = DataLoaderConfiguration(use_seedable_sampler=a.seedable)
    acc = (
        Accelerator(cpu=True, project_config=config, dataloader_config=loading)
        if a.stock
        else TransactionalAccelerator(
            cpu=True, project_config=config, dataloader_config=loading, save_on_preemption=kind == "term"
        )
    )
    assert acc.num_processes == world, (acc.num_processes, world)

    torch.manual_seed(0)  # the same initial weights and data on every process
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g), torch.randn(N, generator=g))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=a.workers)
    model, opt, loader = acc.prepare(model, opt, loader)
    per_epoch = len(loader)
    torch.manual_seed(100 + rank)  # dropout differs per process, as in real data parallelism

    step = 0
    if a.resume:
        if a.stock:  # the newest step directory stock save_state left (a SIGKILL between saves leaves it whole)
            steps = sorted(int(m.group(1)) for m in (re.fullmatch(r"step_(\d+)", n) for n in os.listdir(project)) if m)
            if steps:
                acc.load_state(os.path.join(project, f"step_{steps[-1]}"))
                step = steps[-1]
        else:
            acc.load_state()
            step = int(acc.project_configuration.iteration) - 1
    epoch, done = divmod(step, per_epoch)

    losses = open(f"{a.out}.losses.r{rank}", "a")
    while epoch < EPOCHS:
        batches = acc.skip_first_batches(loader, done) if done else loader
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            step += 1
            losses.write(json.dumps([step, loss.item()]) + "\n")
            losses.flush()
            if kind == "kill" and step == stop_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "term" and step == stop_step and rank == world - 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the stock run dies here; txckpt's saves at the boundary
            out = os.path.join(project, f"step_{step}")
            if not a.stock:
                acc.save_state_if_preempted(out)  # every process, every step: one all-reduce
            if step % EVERY == 0:
                acc.save_state(out)
        epoch, done = epoch + 1, 0
    digest = hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in acc.unwrap_model(model).state_dict().values()))
    print(f"WEIGHTS {digest.hexdigest()}", flush=True)
    acc.end_training()  # also ends the process group


if __name__ == "__main__":
    main()
