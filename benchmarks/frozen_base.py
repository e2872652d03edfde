"""A frozen base in one file (issue 47, "frozen tensors are never rewritten"): the new user's case.

A GPT-2 (n_layer 4, n_embd 256) with every parameter frozen but the last block and ``ln_f``,
saved by the Trainer's default save (``save_pretrained`` writes one ``model.safetensors``: the
model is far below ``max_shard_size``) with ``TransactionalCheckpointMixin`` and
``txckpt_incremental=True``, one real optimizer step before each save. Measured:

- the disk's growth per save (every file under the root, a hard-linked inode counted once:
  st_size summed over unique (st_dev, st_ino)) against what a save has to hold (the trainable
  tensors' bytes plus every file of the checkpoint that is not a ``.safetensors`` file:
  optimizer, scheduler, RNG, trainer state, config, index, manifest), grouped (this version)
  and with the one file as before (the mixin's grouping switched off, which is the code of
  e1cc3b7), side by side;
- the whole root after 10 checkpoints against one base (the frozen tensors) + 10 deltas;
- stock ``GPT2LMHeadModel.from_pretrained`` of every grouped checkpoint, equal to the model as
  it was saved;
- a full fine-tune (nothing frozen): incremental save time against a non-incremental one, two
  Trainers on one model, alternating rounds, median of order-balanced per-round ratios.

``python -m benchmarks.frozen_base [--quick|--tiny]`` prints the table (``--quick``: a smaller
vocabulary and fewer saves, well under 20 s); ``python -m benchmarks run --cases frozen_base``
puts it in the report. Not in the smoke test's case list (its tiny run is at its time limit)."""

from __future__ import annotations

import contextlib
import os
from typing import Any
from unittest import mock

from . import harness as h
from .trainer import training_args
from .trainer_incremental import _check_loads, _freeze

TITLE = "Incremental save: a frozen base in one model.safetensors (Trainer)"
GROUPED, ONE_FILE = "grouped (this version)", "one file (as before)"
INC, FULL = "full fine-tune, txckpt_incremental=True", "full fine-tune, not incremental"
BATCH = 2


def _shape() -> tuple[int, int, int]:
    """(vocabulary, saves per root, timed rounds of the full fine-tune)."""
    s = h.settings()
    if s.tiny:
        return 512, 3, 2
    if s.quick:
        return 8000, 4, 4
    return 50257, 10, 10


def disk_bytes(root: str) -> int:
    """Bytes the files under ``root`` hold: st_size summed over unique (st_dev, st_ino)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(folder, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _gpt2(vocab: int, frozen: bool) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=vocab, n_positions=256, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    if frozen:
        _freeze(model)
    return model


def _trainer(model: Any, root: str, incremental: bool) -> Any:
    from transformers import Trainer

    from txckpt.integrations.transformers import TransactionalCheckpointMixin

    class TxTrainer(TransactionalCheckpointMixin, Trainer):
        pass

    t = TxTrainer(
        model=model, args=training_args(root, per_device_train_batch_size=BATCH), txckpt_incremental=incremental
    )
    t.create_optimizer_and_scheduler(num_training_steps=1000)
    t.state.train_batch_size = t.args.train_batch_size  # what train() records before a save
    return t


def _step(trainer: Any, g: Any) -> None:
    """One real optimizer step on a random batch, then the next checkpoint's step number."""
    import torch

    model = trainer.model
    ids = torch.randint(0, model.config.vocab_size, (BATCH, 32), generator=g)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1


def _growth_run(vocab: int, saves: int, grouped: bool) -> dict[str, Any]:
    """``saves`` incremental Trainer saves of the frozen GPT-2 into a fresh root: the disk's growth
    and the reference bytes of each, the root's final size, the paths and the trainable tensors
    saved (for the from_pretrained check)."""
    import torch

    from txckpt.integrations._trainer import mixin

    model = _gpt2(vocab, frozen=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    trainable_bytes = sum(p.nbytes for n, p in model.named_parameters() if n in trainable)
    frozen_bytes = sum(p.nbytes for n, p in model.named_parameters() if n not in trainable)
    root = h.fresh_dir("frozen-base")
    trainer = _trainer(model, root, incremental=True)
    g = torch.Generator().manual_seed(0)
    # create=True: the same script runs against a txckpt from before the grouping (a baseline).
    off = mock.patch.object(mixin, "grouped_weights_through", lambda tx, m: contextlib.nullcontext(), create=True)
    growth, reference, paths, saved = [], [], [], []
    try:
        with contextlib.nullcontext() if grouped else off:
            for _ in range(saves):
                _step(trainer, g)
                before = disk_bytes(root)
                trainer._save_checkpoint(model, trial=None)
                growth.append(disk_bytes(root) - before)
                path = os.path.join(root, f"checkpoint-{trainer.state.global_step}")
                small = sum(
                    os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if not n.endswith(".safetensors")
                )
                reference.append(trainable_bytes + small)
                paths.append(path)
                saved.append({n: p.detach().clone() for n, p in model.named_parameters() if n in trainable})
        total = disk_bytes(root)
        if grouped:
            _check_loads(paths, saved, model)
    finally:
        h.remove(root)
    return {
        "growth": growth,
        "reference": reference,
        "total": total,
        "frozen_bytes": frozen_bytes,
        "trainable_bytes": trainable_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "checked": len(paths) if grouped else 0,
    }


def _full_finetune_times(vocab: int, rounds: int) -> dict[str, list[float]]:
    """Alternating rounds of one optimizer step and one save per Trainer (one model, every
    parameter trained), incremental and not, each into its own root."""
    import torch

    model = _gpt2(vocab, frozen=False)
    roots = {INC: h.fresh_dir("ff-inc"), FULL: h.fresh_dir("ff-full")}
    trainers = {INC: _trainer(model, roots[INC], True), FULL: _trainer(model, roots[FULL], False)}
    trainers[FULL].optimizer, trainers[FULL].lr_scheduler = trainers[INC].optimizer, trainers[INC].lr_scheduler
    g = torch.Generator().manual_seed(0)

    def method(name: str) -> h.Method:
        trainer = trainers[name]
        return h.Method(
            name,
            lambda ctx: trainer._save_checkpoint(model, trial=None),
            setup=lambda: _step(trainer, g),
        )

    try:
        return h.interleave([method(INC), method(FULL)], rounds, warmup=1)
    finally:
        for r in roots.values():
            h.remove(r)


def run(quick: bool) -> dict[str, Any]:
    from .trainer import quiet_durable_config

    quiet_durable_config()
    vocab, saves, rounds = _shape()
    h.log(f"frozen-base: vocab {vocab}, {saves} saves per root, {rounds} timed rounds")
    runs = {GROUPED: _growth_run(vocab, saves, True), ONE_FILE: _growth_run(vocab, saves, False)}
    times = _full_finetune_times(vocab, rounds)
    g = runs[GROUPED]
    label = f"{g['params'] / 1e6:.1f}M params, {g['trainable_bytes'] / max(1, g['frozen_bytes'] + g['trainable_bytes']):.0%} trainable"
    rows = []
    for name, r in runs.items():
        per_save = [a / b for a, b in zip(r["growth"][1:], r["reference"][1:])]
        rows.append(
            {
                "case": f"disk growth per save ÷ (trainable tensors + optimizer + small files), {name}",
                "size": label,
                "txckpt": h.median([float(x) for x in r["growth"][1:]]),
                "other": h.median([float(x) for x in r["reference"][1:]]),
                "ratio": h.median(per_save),
                "goal": 1.10 if name == GROUPED else None,
                "reps": len(per_save),
                "paired": per_save,
                "unit": "bytes",
                "note": f"saves 2..{saves}; the first save grew the disk by {h.fmt_size(r['growth'][0])}",
            }
        )
    for name, r in runs.items():
        ideal = r["frozen_bytes"] + sum(r["reference"])
        rows.append(
            {
                "case": f"the root after {saves} checkpoints ÷ (one base + {saves} deltas), {name}",
                "size": label,
                "txckpt": float(r["total"]),
                "other": float(ideal),
                "ratio": r["total"] / ideal,
                "goal": 1.2 if name == GROUPED else None,
                "reps": 1,
                "unit": "bytes",
                "note": "every file under the root (log, manifests included), a hard-linked inode once",
            }
        )
    rows.append(
        {
            "case": "stock GPT2LMHeadModel.from_pretrained of every grouped checkpoint equals the model as saved",
            "size": label,
            "txckpt": f"{g['checked']}/{saves}",
            "other": None,
            "ratio": None,
            "goal": None,
            "reps": g["checked"],
            "note": "",
        }
    )
    rows.append(
        h.compare(
            "full fine-tune: incremental ÷ non-incremental Trainer _save_checkpoint time",
            f"{g['params'] / 1e6:.1f}M params, all trained",
            times,
            INC,
            FULL,
            1.03,
            "trained parameters are assumed changed: neither hashed nor grouped",
            alternating=True,
        )
    )
    about = (
        "GPT-2 (n_layer 4, n_embd 256, random init) with every parameter frozen but the last block and `ln_f`; "
        "the Trainer's default save (one `model.safetensors`) through `TransactionalCheckpointMixin` with "
        "`txckpt_incremental=True`, fsync on, one real AdamW step before each save. Growth: st_size summed over "
        "unique (st_dev, st_ino) of every file under the root, before and after the save. The full fine-tune "
        "rows: the same model with every parameter trained, two Trainers (one optimizer), alternating order."
    )
    return {"id": "frozen-base", "title": TITLE, "rows": rows, "about": about}


def _show(r: dict[str, Any]) -> str:
    ratio = "" if r["ratio"] is None else f", ratio {r['ratio']:.3f} (goal {r['goal']})"
    paired = r.get("paired")
    spread = f" [{min(paired):.3f}..{max(paired):.3f}]" if paired else ""
    return f"{r['case']}\n    {r['txckpt']} vs {r['other']}{ratio}{spread}; {r['note']}"


def main(argv: list[str] | None = None) -> int:
    return h.module_main("python -m benchmarks.frozen_base", run, _show, argv)


if __name__ == "__main__":
    raise SystemExit(main())
