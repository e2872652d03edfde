"""A tiny Lightning run for tests/test_lightning*.py: a linear model on seeded random data, CPU,
no progress bar or logger, with one ModelCheckpoint. Imported in-process by the tests and run
in forked children (tests/harness/procs.run_child) where a crash must be a real SIGKILL."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import txckpt._save.transactions


class TinyModule(L.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val_loss", ((self.layer(x) - y) ** 2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StartStep(L.Callback):
    """Records the global step training starts at: what a resume restored."""

    step: int | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.step = trainer.global_step


def data(seed: int, n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


def trainer(dirpath: str, max_steps: int, plugins: list[Any], **checkpoint: Any) -> tuple[L.Trainer, ModelCheckpoint]:
    options = {"every_n_train_steps": 5, "save_top_k": -1, "save_last": True, **checkpoint}
    cb = ModelCheckpoint(dirpath=dirpath, **options)
    t = L.Trainer(
        max_steps=max_steps,
        callbacks=[cb],
        plugins=plugins,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
    )
    return t, cb


def fit(
    dirpath: str, *, seed: int, max_steps: int, ckpt_path: str | None, plugins: list[Any], **checkpoint: Any
) -> dict[str, Any]:
    """Train; return where it started, where it ended and what ModelCheckpoint recorded."""
    torch.manual_seed(0)
    t, cb = trainer(dirpath, max_steps, plugins, **checkpoint)
    start = StartStep()
    t.callbacks.append(start)
    model = TinyModule()
    t.fit(model, data(seed), ckpt_path=ckpt_path)
    return {
        "ckpt_path": t.ckpt_path and str(t.ckpt_path),
        "global_step": t.global_step,
        "resumed": start.step,
        "best": cb.best_model_path,
        "last": cb.last_model_path,
        "weight": model.layer.weight.detach().clone().flatten().tolist(),
    }


def die_committing(step: int) -> None:
    """SIGKILL this process inside the save of ``step``: its file staged and its manifest
    written, right before the commit entry (the commit point) is appended."""
    real = txckpt._save.transactions.append_commit

    def append_commit(root: Any, manifest: Any, *args: Any, **kwargs: Any) -> Any:
        if manifest.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(root, manifest, *args, **kwargs)

    txckpt._save.transactions.append_commit = append_commit  # type: ignore[assignment]
