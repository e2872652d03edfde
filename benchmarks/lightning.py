"""Lightning's ``CheckpointIO`` plugins: the time a save blocks the training loop with
``TransactionalCheckpointIO(async_save=True)`` against Lightning's own ``AsyncCheckpointIO``
(over ``TorchCheckpointIO``: it clones every tensor on the caller's thread, then writes in a
thread), and against the synchronous ``TransactionalCheckpointIO`` save.

The checkpoint is the dict a Trainer hands the plugin: the synthetic state of the save
benchmarks as ``state_dict`` (weights) and ``optimizer_states`` (AdamW state), plus the step and
epoch. One untimed warm-up round (txckpt's snapshot buffers exist from then on), then
interleaved rounds; each method's background write is waited for, untimed, before the next
method runs. txckpt writes into one root, fsync on (its default); Lightning's plugin writes a
``.ckpt`` file per save (no fsync: stock ``torch.save``).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from . import harness as h
from .asyncsave import sizes
from .state import make_state

TITLE = "Lightning async save"

TX = "TransactionalCheckpointIO(async_save=True) (blocked)"
LIGHTNING = "AsyncCheckpointIO(TorchCheckpointIO()) (blocked)"
SYNC = "TransactionalCheckpointIO() (sync save)"


def methods(weights: dict[str, Any], optim: dict[str, Any], root: str, plain: str) -> tuple[list[h.Method], Any]:
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from txckpt.integrations.lightning import TransactionalCheckpointIO

    steps = itertools.count(1)
    tx_io = TransactionalCheckpointIO(async_save=True)
    sync_io = TransactionalCheckpointIO()
    stock = AsyncCheckpointIO(TorchCheckpointIO())

    def checkpoint(step: int) -> dict[str, Any]:
        return {"state_dict": weights, "optimizer_states": [optim], "global_step": step, "epoch": 0}

    def tx(ctx):
        step = next(steps)
        tx_io.save_checkpoint(checkpoint(step), os.path.join(root, f"step={step}.ckpt"))

    def tx_done(ctx):
        tx_io.wait()

    def sync(ctx):
        step = next(steps)
        sync_io.save_checkpoint(checkpoint(step), os.path.join(root, f"step={step}.ckpt"))

    def lightning(ctx):
        stock.save_checkpoint(checkpoint(0), os.path.join(plain, "last.ckpt"))

    def lightning_done(ctx):
        stock.teardown()  # waits for its thread; a fresh one starts at the next save

    return [
        h.Method(TX, tx, dict, tx_done),
        h.Method(LIGHTNING, lightning, dict, lightning_done),
        h.Method(SYNC, sync, dict),
    ], None


def run(quick: bool) -> dict[str, Any]:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return {
            "title": "Lightning: time a save blocks the loop",
            "status": "skipped",
            "reason": "lightning is not installed (pip install 'txckpt[lightning]')",
            "rows": [],
        }
    from txckpt import asyncsave

    s = h.settings()
    rows: list[dict[str, Any]] = []
    for size in sizes(s):
        reps = s.reps.get(size, 2 if s.tiny else 5)
        h.log(f"lightning: {h.fmt_size(size)}, {reps} rounds")
        weights, optim = make_state(size)
        root, plain = h.fresh_dir("lightning-tx"), h.fresh_dir("lightning-stock")
        try:
            ms, _ = methods(weights, optim, root, plain)
            times = h.interleave(ms, reps, warmup=1)
        finally:
            asyncsave.release_buffers(root)
            h.remove(root)
            h.remove(plain)
        rows.append(
            h.compare(
                "TransactionalCheckpointIO(async_save=True) blocked ÷ AsyncCheckpointIO blocked",
                size,
                times,
                TX,
                LIGHTNING,
                1.0,
            )
        )
        rows.append(
            h.compare(
                "TransactionalCheckpointIO(async_save=True) blocked ÷ its sync save (fsync on)",
                size,
                times,
                TX,
                SYNC,
                None,
            )
        )
        del weights, optim, ms
    return {
        "id": "lightning",
        "title": "Lightning: time a save blocks the loop",
        "rows": rows,
        "about": "The dict a Lightning Trainer hands its `CheckpointIO`: the synthetic state (1/3 "
        "weights as `state_dict`, 2/3 AdamW state as `optimizer_states`). *Blocked* is the "
        "time until `save_checkpoint` returns: txckpt's snapshot into reused buffers, "
        "Lightning's `AsyncCheckpointIO` cloning every tensor on the caller's thread. One "
        "warm-up round, then interleaved rounds; each background write is waited for, "
        "untimed, before the next method runs.",
    }
