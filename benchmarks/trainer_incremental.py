"""Incremental Trainer saves (issue 30, the Trainer; docs/incremental.md, "The Trainer"): a GPT-2
whose base is frozen, saved by ``Trainer._save_checkpoint`` with the mixin, with and without
``txckpt_incremental=True``.

The model is a GPT-2 built from a config (benchmarks/trainer.py's sizes) with every parameter
frozen except the last transformer block and ``ln_f`` (the stand-in for an adapter; the embedding
shared by ``wte`` and ``lm_head`` is frozen). ``save_pretrained`` writes it in shards of about an
eighth of the model, so that most shards hold frozen tensors only: what a big model's save looks
like, scaled down. Each round both Trainers (same model, same AdamW, roots of their own) take one
real optimizer step and save the next ``checkpoint-N``; the first round writes everything and is
the warm-up. This is the issue's must-show: a Trainer save sends the changed files to the disk
and no more, and stock transformers still loads every published checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import harness as h
from .trainer import quiet_durable_config, training_args

TITLE = "Incremental save: the Trainer, a frozen base (local disk, fsync on)"
INC, FULL = "Trainer + mixin, txckpt_incremental=True", "Trainer + mixin"
#: Shards per model: each holds ~1/8 of it, so every shard but the last one or two is frozen.
SHARDS = 8
BATCH = 2


def _device_bytes() -> int:
    """Bytes this process has sent to the block device so far. The kernel counts a page in
    ``write_bytes`` when it is dirtied and in ``cancelled_write_bytes`` when its file is truncated
    or unlinked while it is still dirty (an unchanged scratch copy replaced by a hard link before
    any fsync), so the difference is what reaches the disk, whenever write-back runs."""
    io: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            io[key] = int(value)
    return io["write_bytes"] - io["cancelled_write_bytes"]


def _frozen_gpt2(cfg: Any) -> Any:
    """A GPT-2 with a frozen base whose ``save_pretrained`` writes shards of ~1/SHARDS of it
    (transformers' default, 50 GB, would put a model this size in one file that changes every
    save)."""
    from transformers import GPT2LMHeadModel

    class FrozenBaseGPT2(GPT2LMHeadModel):
        shard_bytes = 0

        def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("max_shard_size", self.shard_bytes)  # the Trainer passes none
            return super().save_pretrained(*args, **kwargs)

    model = FrozenBaseGPT2(cfg)
    _freeze(model)
    # The bytes save_pretrained writes: every tensor once (lm_head.weight is wte's storage).
    model.shard_bytes = sum(p.nbytes for p in model.parameters()) // SHARDS
    return model


def _freeze(model: Any) -> None:
    model.requires_grad_(False)
    model.transformer.h[-1].requires_grad_(True)
    model.transformer.ln_f.requires_grad_(True)


def _changed(files: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """The files of a checkpoint's file table that are new since ``before`` (the previous
    checkpoint's of the same root) or whose checksum differs."""
    return sorted(n for n, e in files.items() if n not in before or before[n].checksum != e.checksum)


def _frozen_shards(path: str, trainable: set[str]) -> set[str]:
    """The shards of the checkpoint at ``path`` that hold no trainable tensor (from the index)."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = set(weight_map.values())
    return shards - {weight_map[n] for n in trainable if n in weight_map}


def _adam_step(optimizer: Any) -> float:
    """AdamW's step count (every trainable parameter has the same one)."""
    return float(next(iter(optimizer.state.values()))["step"])


def _check_loads(paths: list[str], saved: list[dict[str, Any]], model: Any) -> None:
    """Stock ``GPT2LMHeadModel.from_pretrained`` of every incremental checkpoint: each holds the
    trainable tensors as they were at its save and the frozen ones (hard links of the first
    checkpoint's shards after the first save) as the model holds them. Raises on any difference."""
    import torch
    from transformers import GPT2LMHeadModel

    current = model.state_dict()
    for path, trained in zip(paths, saved):
        loaded = GPT2LMHeadModel.from_pretrained(path).state_dict()
        for k, v in current.items():
            want = trained.get(k, v)
            if not torch.equal(loaded[k], want):
                raise AssertionError(f"{path}: {k} loaded by from_pretrained differs from the saved model")


def _stock_resume(path: str, step: int, opt_step: float, cfg: Any) -> None:
    """A stock ``Trainer`` (no mixin) resumes from the checkpoint at ``path`` and trains one more
    step: weights, optimizer, scheduler, RNG and trainer state all read from it."""
    import torch
    from transformers import GPT2LMHeadModel, PrinterCallback, Trainer

    model = GPT2LMHeadModel.from_pretrained(path)
    _freeze(model)  # the same trainable set, so the optimizer's saved param groups fit
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2 * BATCH, 16), generator=g)
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(len(ids))]
    out = h.fresh_dir("trinc-resume")
    try:
        args = training_args(out, max_steps=step + 1, per_device_train_batch_size=BATCH)
        stock = Trainer(model=model, args=args, train_dataset=data)
        stock.remove_callback(PrinterCallback)  # it prints the run's metrics to stdout
        stock.train(resume_from_checkpoint=path)
        if stock.state.global_step != step + 1:
            raise AssertionError(f"stock resume from {path} ended at step {stock.state.global_step}, not {step + 1}")
        if _adam_step(stock.optimizer) != opt_step + 1:  # AdamW's state came from optimizer.pt
            raise AssertionError(
                f"stock resume from {path}: AdamW at step {_adam_step(stock.optimizer)}, saved at {opt_step}"
            )
    finally:
        h.remove(out)


def run(quick: bool) -> dict[str, Any]:
    import torch
    from transformers import Trainer

    import txckpt
    from txckpt.integrations.transformers import TransactionalCheckpointMixin

    s = h.settings()
    cfg = quiet_durable_config()
    model = _frozen_gpt2(cfg)
    shard_bytes = model.shard_bytes
    n_params = sum(p.numel() for p in model.parameters())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    class TxTrainer(TransactionalCheckpointMixin, Trainer):
        pass

    def args(out: str) -> Any:
        return training_args(out, per_device_train_batch_size=BATCH)

    # AdamW over the trainable parameters, as the Trainer builds it, shared by both Trainers: each
    # saves the same optimizer state, only the txckpt setting differs.
    init_dir = h.fresh_dir("trinc-init")
    first = Trainer(model=model, args=args(init_dir))
    first.create_optimizer_and_scheduler(num_training_steps=1000)
    optimizer, scheduler = first.optimizer, first.lr_scheduler
    assert optimizer is not None and scheduler is not None
    h.remove(init_dir)
    roots = {INC: h.fresh_dir("trinc-inc"), FULL: h.fresh_dir("trinc-full")}
    trainers = {
        INC: TxTrainer(model=model, args=args(roots[INC]), optimizers=(optimizer, scheduler), txckpt_incremental=True),
        FULL: TxTrainer(model=model, args=args(roots[FULL]), optimizers=(optimizer, scheduler)),
    }
    for t in trainers.values():
        # What train() records before its first save: a stock resume reads it back.
        t.state.train_batch_size = t.args.train_batch_size
    g = torch.Generator().manual_seed(0)

    def train_step() -> None:
        """One real step: the trainable block and ln_f, their AdamW moments, the scheduler, the
        RNG (dropout) change; the frozen tensors do not."""
        ids = torch.randint(0, cfg.vocab_size, (BATCH, 32), generator=g)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    sent: dict[str, list[float]] = {INC: [], FULL: []}  # bytes (h.median takes floats)
    changed: dict[str, list[float]] = {INC: [], FULL: []}
    tables: dict[str, dict[str, Any]] = {INC: {}, FULL: {}}
    paths: list[str] = []  # the incremental root's checkpoints
    saved: list[dict[str, Any]] = []  # the trainable tensors at each incremental save
    opt_steps: list[float] = []
    frozen_changed: set[str] = set()  # frozen-only shards whose bytes changed between saves
    last_changed: list[str] = []

    def method(name: str) -> h.Method:
        trainer = trainers[name]

        def setup() -> dict[str, Any]:
            train_step()
            trainer.state.global_step += 1  # a new checkpoint-N each save
            return {}

        def save(ctx: dict[str, Any]) -> None:
            before = _device_bytes()
            trainer._save_checkpoint(model, trial=None)  # commits and fsyncs before it returns
            ctx["sent"] = _device_bytes() - before

        def done(ctx: dict[str, Any]) -> None:
            if "sent" not in ctx:
                return  # the save raised: interleave re-raises it
            path = os.path.join(roots[name], f"checkpoint-{trainer.state.global_step}")
            files = txckpt.read_manifest(path).files
            before = tables[name]
            now = _changed(files, before)
            sent[name].append(ctx["sent"])
            changed[name].append(sum(files[n].size for n in now))
            tables[name] = files
            if name == INC:
                if before:  # the first save writes every shard
                    frozen_changed.update(set(now) & _frozen_shards(path, trainable))
                last_changed[:] = now
                paths.append(path)
                saved.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
                opt_steps.append(_adam_step(optimizer))

        return h.Method(name, save, setup, done)

    rounds = 2 if s.tiny else 4 if s.quick else 8  # even: as many rounds in each order
    h.log(
        f"trainer-incremental: {n_params / 1e6:.1f}M parameters ({n_trainable / 1e6:.2f}M trainable), "
        f"shards of {h.fmt_size(shard_bytes)}, {rounds} rounds"
    )
    try:
        # Round 0 (warm-up) is each root's first save, which writes every file.
        times = h.interleave([method(INC), method(FULL)], rounds, warmup=1)
        ckpt_bytes = sum(e.size for e in tables[INC].values())
        n_shards = sum(1 for n in tables[INC] if n.endswith(".safetensors"))
        n_frozen = len(_frozen_shards(paths[-1], trainable))
        _check_loads(paths, saved, model)
        last_step = int(trainers[INC].state.global_step)
        _stock_resume(paths[-1], last_step, opt_steps[-1], cfg)
    finally:
        for r in roots.values():
            h.remove(r)

    per_save = [w / c for w, c in zip(sent[INC][1:], changed[INC][1:]) if c > 0]
    inc_sent, full_sent = h.median(sent[INC][1:]), h.median(sent[FULL][1:])
    delta = h.median(changed[INC][1:])
    label = f"{n_params / 1e6:.{0 if n_params >= 1e7 else 1}f}M params, {h.fmt_size(ckpt_bytes)}"
    odd = (
        f"; frozen-only shards that changed: {', '.join(sorted(frozen_changed))}"
        if frozen_changed
        else "; no frozen-only shard changed"
    )
    rows = [
        {
            "case": "bytes sent to the disk per incremental Trainer save ÷ the changed files' bytes",
            "size": label,
            "txckpt": inc_sent,
            "other": delta,
            "ratio": h.median(per_save),
            "goal": 1.05,
            "reps": len(per_save),
            "unit": "bytes",
            "paired": per_save,
            "note": f"a full save sends {h.fmt_size(full_sent)} ({full_sent / max(inc_sent, 1):.0f}x); changed "
            f"in the last save: {', '.join(last_changed)} of {n_shards} shards ({n_frozen} frozen-only){odd}",
        },
        h.compare(
            "incremental ÷ full Trainer _save_checkpoint time",
            label,
            times,
            INC,
            FULL,
            None,
            "report only: the incremental save hashes the frozen shards it does not write",
            alternating=True,
        ),
        {
            "case": "stock transformers loads every incremental checkpoint-N",
            "size": label,
            "txckpt": f"{len(paths)}/{len(paths)}",
            "other": None,
            "ratio": None,
            "goal": None,
            "reps": len(paths),
            "note": f"GPT2LMHeadModel.from_pretrained of each, equal to the model as saved; a stock Trainer "
            f"resumed from checkpoint-{last_step} and trained step {last_step + 1}",
        },
    ]
    about = (
        f"GPT-2 from a config (random init), {n_params / 1e6:.1f}M parameters, every one frozen except the "
        f"last transformer block and `ln_f` ({n_trainable / 1e6:.2f}M, the adapter's stand-in; the embedding "
        f"tied to `lm_head` is frozen), saved by `save_pretrained` in shards of at most "
        f"{h.fmt_size(shard_bytes)} (~1/{SHARDS} of the model). Two `TransactionalCheckpointMixin` Trainers on "
        "the same model and the same AdamW (created by the Trainer), each with a root of its own, one with "
        "`txckpt_incremental=True`, fsync on; each round each takes one real optimizer step on a random batch "
        "and `_save_checkpoint(model, trial=None)` saves the next `checkpoint-N`, the two interleaved, "
        f"{rounds} rounds after a warm-up round (each root's first save, which writes every file). *Bytes "
        "sent to the disk*: `write_bytes - cancelled_write_bytes` of `/proc/self/io` across the save (a page "
        "counts when dirtied and is cancelled when its file is unlinked before write-back). *Changed files*: "
        "the files of the checkpoint's manifest that are new or whose checksum differs from the previous "
        "checkpoint's of the same root. After the rounds, stock `GPT2LMHeadModel.from_pretrained` loads every "
        "checkpoint of the incremental root and each equals the model as it was saved, and a stock `Trainer` "
        "(no mixin) resumes from the last one and trains one more step (weights, AdamW state, scheduler, RNG "
        "and trainer state read from it); any failure fails the table."
    )
    return {"id": "trainer-incremental", "title": TITLE, "rows": rows, "about": about}
