"""Lightning's ``CheckpointIO`` plugins: the time an async save blocks the training loop with
``TransactionalCheckpointIO(async_save=True)`` (copy-first) and ``async_save="lazy"`` against
Lightning's own ``AsyncCheckpointIO`` (over ``TorchCheckpointIO``: it clones every tensor on the
caller's thread, then writes in a thread), side by side in the same rounds (issue 48).

The checkpoint is the dict a Trainer hands the plugin: the synthetic state of the save
benchmarks, its weights as the parameters of a real ``torch.optim.AdamW`` holding the rest as
its state (1/3 ``state_dict``, 2/3 ``optimizer_states``), plus the step and epoch. A round of
each method is one training step as Lightning's automatic optimization runs it: the save, then
``optimizer.step(closure)`` whose closure is a forward and backward through every weight (one
torch thread, as a GPU job leaves the host's cores to the rest). *Blocked* is the time
``save_checkpoint`` takes plus the time the step waits for the save (only the lazy mode's step
waits: for the background's copy, after the closure); the forward, backward and update are the
training itself and count for no method. The lazy plugin learns the optimizer as the Trainer's
``dump_checkpoint`` tells it. One untimed warm-up round (txckpt's snapshot buffers exist from
then on), then rounds in an order rotated each round; each method's background write is waited
for, untimed, before the next method runs. txckpt writes into one root, fsync on (its default);
Lightning's plugin writes a ``.ckpt`` file per save (no fsync: stock ``torch.save``).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from . import harness as h
from .state import make_state

TITLE = "Lightning async save"

TX = "TransactionalCheckpointIO(async_save=True) (blocked)"
LAZY = 'TransactionalCheckpointIO(async_save="lazy") (blocked: call + the step\'s wait)'
LIGHTNING = "AsyncCheckpointIO(TorchCheckpointIO()) (blocked)"


def _sizes(s: h.Settings) -> list[int]:
    if s.tiny:
        return list(s.sizes)
    if s.quick:
        return [64 * h.MiB]
    return [512 * h.MiB]


def methods(
    weights: dict[str, Any], optim: dict[str, Any], root: str, lazy_root: str, plain: str
) -> tuple[list[h.Method], Any]:
    import torch
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from txckpt._async import asyncsave
    from txckpt.integrations.lightning import TransactionalCheckpointIO

    steps = itertools.count(1)
    lazy_parts: list[tuple[float, float, float]] = []  # the lazy rounds' call, wait, forward+backward
    tx_io = TransactionalCheckpointIO(async_save=True)
    lazy_io = TransactionalCheckpointIO(async_save="lazy")
    stock = AsyncCheckpointIO(TorchCheckpointIO())

    # The weights as parameters (the same storages) of an AdamW holding the optimizer state.
    names = list(weights)
    params = [torch.nn.Parameter(weights[n]) for n in names]
    opt = torch.optim.AdamW(params, lr=1e-9)
    opt.load_state_dict(optim)
    gate = asyncsave.step_gate(opt)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0))

    parts: dict[str, list[float]] = {"call": [], "wait": [], "closure": []}

    def closure() -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        try:
            opt.zero_grad(set_to_none=True)
            loss = sum(((x @ p.t()).square().mean() if p.dim() == 2 else p.square().sum()) for p in params)
            loss.backward()
            return loss
        finally:
            parts["closure"].append(time.perf_counter() - t0)
            torch.set_num_threads(threads)

    def checkpoint(step: int) -> dict[str, Any]:
        # What the Trainer's dump_checkpoint hands the plugin: state_dict() and optimizer
        # state_dict()s, whose tensors are the live parameters and optimizer state.
        return {
            "state_dict": {n: p.detach() for n, p in zip(names, params)},
            "optimizer_states": [opt.state_dict()],
            "global_step": step,
            "epoch": 0,
        }

    def training_step(save: Any) -> float:
        """The save, then the step; the seconds the save blocked the loop."""
        t0 = time.perf_counter()
        save()
        call = time.perf_counter() - t0
        n = len(gate.waits)
        opt.step(closure)
        wait = gate.waits[-1] if len(gate.waits) > n else 0.0
        parts["call"].append(call)
        parts["wait"].append(wait)
        return call + wait

    def tx(ctx):
        step = next(steps)
        return training_step(lambda: tx_io.save_checkpoint(checkpoint(step), os.path.join(root, f"step={step}.ckpt")))

    def lazy(ctx):
        step = next(steps)

        def save() -> None:
            lazy_io.trainer_optimizers = [opt]  # as the Trainer's dump_checkpoint sets it
            lazy_io.save_checkpoint(checkpoint(step), os.path.join(lazy_root, f"step={step}.ckpt"))

        blocked = training_step(save)
        lazy_parts.append((parts["call"][-1], parts["wait"][-1], parts["closure"][-1]))
        return blocked

    def lightning(ctx):
        return training_step(lambda: stock.save_checkpoint(checkpoint(0), os.path.join(plain, "last.ckpt")))

    def stock_done(ctx):
        stock.teardown()  # waits for its thread; a fresh one starts at the next save

    return [
        h.Method(LIGHTNING, lightning, dict, stock_done, self_timed=True),
        h.Method(TX, tx, dict, lambda ctx: tx_io.wait(), self_timed=True),
        h.Method(LAZY, lazy, dict, lambda ctx: lazy_io.wait(), self_timed=True),
    ], lazy_parts


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
    from txckpt._async import asyncsave

    s = h.settings()
    rows: list[dict[str, Any]] = []
    for size in _sizes(s):
        reps = s.reps.get(size, 2 if s.tiny else 5 if s.quick else 7)
        h.log(f"lightning: {h.fmt_size(size)}, {reps} rounds")
        weights, optim = make_state(size)
        root, lazy_root, plain = (
            h.fresh_dir("lightning-tx"),
            h.fresh_dir("lightning-lazy"),
            h.fresh_dir("lightning-stock"),
        )
        try:
            ms, lazy_parts = methods(weights, optim, root, lazy_root, plain)
            times = h.interleave(ms, reps, warmup=1)
        finally:
            for r in (root, lazy_root):  # one saver (snapshot buffers) per root
                asyncsave.release_buffers(r)
                h.remove(r)
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
                'TransactionalCheckpointIO(async_save="lazy") blocked ÷ AsyncCheckpointIO blocked',
                size,
                times,
                LAZY,
                LIGHTNING,
                0.3,
                "lazy: save_checkpoint %.1f ms + the step's wait %.1f ms, beside a forward and backward of %.0f ms "
                "(medians, warm-up included)" % tuple(1e3 * h.median([p[i] for p in lazy_parts]) for i in range(3)),
            )
        )
        del weights, optim, ms, lazy_parts
    return {
        "id": "lightning",
        "title": "Lightning: time a save blocks the loop",
        "rows": rows,
        "about": "The dict a Lightning Trainer hands its `CheckpointIO`: the synthetic state, its "
        "weights (1/3, `state_dict`) the parameters of a real AdamW holding the rest as its state "
        "(`optimizer_states`). Each round of each method is a training step as Lightning runs it: "
        "the save, then `optimizer.step(closure)`, the closure a forward and backward through every "
        "weight on one thread. *Blocked* is the time `save_checkpoint` takes plus the time the step "
        "waits for the save: Lightning's `AsyncCheckpointIO` clones every tensor on the caller's "
        "thread; txckpt's copy-first mode snapshots into reused buffers; its lazy mode copies the "
        "optimizer's tensors in the background and the step waits, after its closure, for what of "
        "the copy the forward and backward did not hide. One warm-up round, then rounds in a "
        "rotated order; each background write is waited for, untimed, before the next method runs.",
    }
