"""One rank of a 2-rank gloo CPU Lightning run with ModelParallelStrategy (FSDP2's fully_shard)
saving through TransactionalCheckpointIO, for tests/test_lightning_sharded.py. Started as torchrun would start
a rank (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE), each rank its own process.

``--kill-step K --victim R``: rank R traces its file operations during the save of step K
(tests/harness/tracer.py, as the crash sweeps do) and SIGKILLs itself before the first write of
its own DCP shard file: a real crash inside the save, after the coordinator planned it and before
every rank's shards are durable. The traced op it died at is written to ``--label``.
``--async``: the plugin saves with ``async_save=True`` (each sharded save in the background, on
a gloo group of its own); the kill then happens in that background save.
``--root URL --storage-options JSON``: the plugin's root is that URL (an object store: s3 on
the suite's moto server), ``--dir`` only ModelCheckpoint's dirpath (no file lands there).
At the end (no kill) each rank writes its shards' weights and optimizer state, the step it
started at and the step it ended at to ``<out>/rank<R>.pt``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--label", default=None)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--root", default=None)
    p.add_argument("--storage-options", default=None, help="JSON")
    p.add_argument("--async", dest="async_save", action="store_true")
    a = p.parse_args()
    from tests.harness.procs import become_rank

    become_rank(a.rank, a.world, a.port)

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from tests.harness.tracer import Tracer
    from txckpt.integrations.lightning import TransactionalCheckpointIO

    torch.set_num_threads(1)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 1)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            # Each layer its own unit: training_step calls them, not the module's forward
            # (whose hooks a root unit would need).
            fully_shard(self.a, mesh=self.device_mesh)
            fully_shard(self.b, mesh=self.device_mesh)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))).squeeze(-1), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    shard = f"__{a.victim}_0.distcp"

    class KillAtShard(Tracer):
        """The suite's tracer, killing before the first op on this rank's shard file (its
        name, with the transaction's random ids, is only known when it is seen)."""

        def _record(self, name: str, mut: bool, write_key: str | None, inject: bool) -> tuple[int, int]:
            k, nth = super()._record(name, mut, write_key, inject)
            if shard in name and self.kill_at == (shard, 0):
                self.kill_at = (name, nth)
            return k, nth

    class KillInSave(L.Callback):
        """Arms the tracer on the victim just before ModelCheckpoint (which runs after the
        user's callbacks) saves step K."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == a.kill_step and trainer.global_rank == a.victim:
                KillAtShard((shard, 0), "before", by_occurrence=True, root=a.dir, label_file=a.label).install()

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, generator=g)), batch_size=4)
    strategy = ModelParallelStrategy(data_parallel_size=a.world, tensor_parallel_size=1)
    cb = ModelCheckpoint(dirpath=a.dir, every_n_train_steps=a.every, save_top_k=a.top_k, save_last=True)
    trainer = L.Trainer(
        max_steps=a.max_steps,
        accelerator="cpu",
        devices=a.world,
        strategy=strategy,
        callbacks=[KillInSave(), cb] if a.kill_step is not None else [cb],
        plugins=[
            TransactionalCheckpointIO(
                a.root,
                storage_options=json.loads(a.storage_options) if a.storage_options else None,
                async_save=a.async_save,
            )
        ],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    torch.manual_seed(0)
    model = Net()
    start: list[int] = []

    class Start(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            start.append(trainer.global_step)

    trainer.callbacks.append(Start())
    trainer.fit(model, data, ckpt_path="last" if a.resume else a.ckpt_path)
    strategy = trainer.strategy
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = strategy.model
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    weights = {k: local(v).clone() for k, v in get_model_state_dict(module).items()}
    optim = get_optimizer_state_dict(module, trainer.optimizers[0])
    state = {k: {n: local(v).clone() for n, v in s.items()} for k, s in optim["state"].items()}
    torch.save(
        {"start": start[0], "end": trainer.global_step, "weights": weights, "optim": state},
        os.path.join(a.out, f"rank{a.rank}.pt"),
    )


if __name__ == "__main__":
    main()
