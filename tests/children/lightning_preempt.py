"""A preemptible Lightning run, a real process for tests/test_lightning_preempt.py (issue 48):
``Trainer(callbacks=[ModelCheckpoint(dirpath=DIR), SaveOnPreemption(...)],
plugins=[TransactionalCheckpointIO(...)])`` on CPU, a small model with dropout on shuffled data.

  lightning_preempt.py --dir DIR --hs HS [--mode save|stock] [--grace S] [--every K]
                       [--max-steps N] [--workers W] [--async] [--exact]
                       [--term-at K | --kill-at K | --die-committing K] [--rank R --world W --port P]

- ``--mode save``: SaveOnPreemption is a callback; ``stock``: it is not (Lightning's own SIGTERM
  handling: the run stops without a save).
- ``--exact``: ExactResume is a callback too (the resumed run continues bit for bit).
- ``--every K``: ModelCheckpoint(every_n_train_steps=K, save_top_k=-1); 0: no periodic save.
- ``--term-at K``: rank 0 sends itself SIGTERM right after step K (recorded by the handler, acted
  on at the step boundary); ``--kill-at K``: every rank SIGKILLs itself right after step K;
  ``--die-committing K``: rank 0 SIGKILLs itself inside the save of step K, its files staged and
  its manifest written, right before the commit entry is appended, after writing the name of
  the thread that was saving to ``HS/died-in`` (with ``--async``: the background saver's).
- every run is ``fit(ckpt_path="last")``, the same command for the first run and each restart
  (nothing committed yet: Lightning starts from scratch).
- ``--world 2``: one rank of a two-process gloo ``ddp`` run, launched by the test as torchrun
  would (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE), each rank its own process.

Handshakes are files in ``--hs`` (the test polls them with a deadline, never sleeps):
``step-rank{r}`` (the last step this rank finished, replaced atomically); ``result-rank{r}.json``
(the step the run stopped at, the signal this rank received, the exit status; written as the
SystemExit leaves fit); ``start-rank{r}.json`` (the global step training started at and the
checkpoint it loaded). Each rank appends ``[step, loss]`` to ``HS/losses-rank{r}`` (the loss
bit for bit, as a float's repr) and, at the end of a run that finished, rank 0 prints
``WEIGHTS <sha1>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from tests.harness.handshake import put  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--hs", required=True)
    p.add_argument("--mode", choices=["save", "stock"], default="save")
    p.add_argument("--grace", type=float, default=None)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--epochs", type=int, default=-1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--exact", action="store_true", help="with ExactResume")
    p.add_argument("--async", dest="use_async", action="store_true")
    p.add_argument("--iterable", action="store_true", help="an IterableDataset (no len()): shuffled in __iter__")
    p.add_argument("--term-at", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--die-committing", type=int, default=None)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    from tests.harness.procs import become_rank

    if a.world > 1:  # as torchrun starts a rank: Lightning's environment reads these
        become_rank(a.rank, a.world, a.port)

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from txckpt import preemption
    from txckpt.integrations.lightning import ExactResume, SaveOnPreemption, TransactionalCheckpointIO

    torch.set_num_threads(1)
    rank = a.rank
    if a.die_committing is not None and rank == 0:
        import threading

        import txckpt._save.transactions

        real = txckpt._save.transactions.append_commit

        def append_commit(root: Any, manifest: Any, *args: Any, **kwargs: Any) -> Any:
            if manifest.step == a.die_committing:
                put(os.path.join(a.hs, "died-in"), threading.current_thread().name)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(root, manifest, *args, **kwargs)

        txckpt._save.transactions.append_commit = append_commit  # type: ignore[assignment]
    losses = open(os.path.join(a.hs, f"losses-rank{rank}"), "a")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.drop = torch.nn.Dropout(0.3)
            self.b = torch.nn.Linear(16, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.b(self.drop(torch.relu(self.a(x)))).squeeze(-1), y)
            losses.write(json.dumps([self.trainer.global_step + 1, loss.item()]) + "\n")
            losses.flush()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Handshake(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            put(
                os.path.join(a.hs, f"start-rank{rank}.json"),
                json.dumps({"step": trainer.global_step, "ckpt_path": trainer.ckpt_path and str(trainer.ckpt_path)}),
            )

        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.received = preemption.received()  # before SaveOnPreemption (after this) exits

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
            step = trainer.global_step
            put(os.path.join(a.hs, f"step-rank{rank}"), str(step))
            if a.kill_at == step:
                os.kill(os.getpid(), signal.SIGKILL)
            if a.term_at == step and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded; acted on at this step's boundary

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, generator=g))
    handshake = Handshake()
    handshake.received = 0
    callbacks: list[Any] = [handshake]
    if a.mode == "save":
        callbacks.append(SaveOnPreemption(grace_s=a.grace))
    if a.exact:
        callbacks.append(ExactResume())
    every = {"every_n_train_steps": a.every} if a.every else {"every_n_train_steps": 10**9}
    callbacks.append(ModelCheckpoint(dirpath=a.dir, save_top_k=-1, save_last=False, **every))
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=a.max_steps,
        max_epochs=a.epochs,
        callbacks=callbacks,
        plugins=[TransactionalCheckpointIO(async_save=a.use_async)],
        strategy="ddp" if a.world > 1 else "auto",
        devices=a.world,
        accelerator="cpu",
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Net()
    if a.iterable:
        from torch.utils.data import IterableDataset, get_worker_info

        class Shuffled(IterableDataset):  # type: ignore[type-arg]
            """The same items, in an order drawn from torch's generator when iteration starts;
            in workers, from the base seed the DataLoader drew (one order), each its share."""

            def __iter__(self) -> Any:
                info = get_worker_info()
                if info is None:
                    order = torch.randperm(len(data)).tolist()
                else:
                    seeded = torch.Generator().manual_seed(info.seed - info.id)
                    order = torch.randperm(len(data), generator=seeded).tolist()[info.id :: info.num_workers]
                return (data[i] for i in order)

        loader = DataLoader(Shuffled(), batch_size=4, num_workers=a.workers)
    else:
        loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=a.workers)
    try:
        trainer.fit(model, loader, ckpt_path="last")  # the same command for every (re)start
    except SystemExit as e:
        result = {"stopped_at": trainer.global_step, "received": handshake.received, "status": e.code}
        put(os.path.join(a.hs, f"result-rank{rank}.json"), json.dumps(result))
        raise
    if rank == 0:
        state = model.state_dict()
        digest = hashlib.sha1(b"".join(state[k].detach().numpy().tobytes() for k in sorted(state)))
        print("WEIGHTS", digest.hexdigest(), flush=True)
    print(f"finished at step {trainer.global_step}; handlers installed after fit: {preemption.installed()}", flush=True)


if __name__ == "__main__":
    main()
