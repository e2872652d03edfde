"""A Trainer checkpoint: Trainer + TransactionalCheckpointMixin against the stock Trainer.

The model is a GPT-2 built from a config (random init, no download) with AdamW state
materialised by one optimizer step: ~110M parameters (~1.3 GB checkpoint), ~10M in quick mode.
"""

from __future__ import annotations

import os
from typing import Any

from . import harness as h
from . import profiling
from .state import fsync_tree

TITLE = "Trainer"

TX, STOCK, STOCK_ND = "Trainer + mixin", "stock Trainer + fsync", "stock Trainer"


def _config(s: h.Settings):
    from transformers import GPT2Config

    if s.tiny:
        dims = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
    elif s.quick:
        dims = dict(n_layer=6, n_embd=320, n_head=5, vocab_size=8000)
    else:
        dims = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=32000)
    return GPT2Config(n_positions=256, bos_token_id=0, eos_token_id=0, **dims)


def quiet_durable_config() -> Any:
    """What every Trainer benchmark starts from: transformers' logging and progress bars off,
    the mixin's root durable (it is unless TXCKPT_DURABLE=0, a test setting: measure it durable),
    torch seeded, and the GPT-2 config of the mode."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ["TXCKPT_DURABLE"] = "1"
    torch.manual_seed(0)
    return _config(h.settings())


def training_args(output_dir: str, **extra: Any) -> Any:
    """The TrainingArguments every Trainer benchmark uses: CPU, no saves of the Trainer's own
    schedule (the benchmark calls them), no logging or progress, seed 0; ``extra`` adds to them."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        **extra,
    )


def run(quick: bool) -> dict[str, Any]:
    try:
        from txckpt.integrations.transformers import TransactionalCheckpointMixin
    except ImportError as e:
        return {
            "id": "trainer",
            "title": "Trainer _save_checkpoint",
            "status": "pending",
            "reason": f"`from txckpt.integrations.transformers import TransactionalCheckpointMixin` "
            f"fails ({e}): the mixin is not written yet",
            "rows": [],
        }
    import torch
    from transformers import GPT2LMHeadModel, Trainer

    s = h.settings()
    cfg = quiet_durable_config()
    model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())

    class TxTrainer(TransactionalCheckpointMixin, Trainer):
        pass

    def make(cls, out: str, optimizers=(None, None)):
        return cls(model=model, args=training_args(out), optimizers=optimizers)

    # One optimizer step, so AdamW's exp_avg / exp_avg_sq exist (2x the weights).
    first = make(Trainer, h.fresh_dir("trainer-init"))
    first.create_optimizer_and_scheduler(num_training_steps=100)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    first.optimizer.step()
    first.lr_scheduler.step()
    first.optimizer.zero_grad()
    optimizers = (first.optimizer, first.lr_scheduler)
    h.remove(first.args.output_dir)
    step = 10

    def setup(cls):
        def inner():
            d = h.fresh_dir("trainer")
            t = make(cls, d, optimizers)
            t.state.global_step = step
            return d, t

        return inner

    def cleanup(ctx):
        h.remove(ctx[0])

    def save(ctx):
        ctx[1]._save_checkpoint(model, trial=None)

    def save_fsync(ctx):
        ctx[1]._save_checkpoint(model, trial=None)
        fsync_tree(os.path.join(ctx[0], f"checkpoint-{step}"))

    # The checkpoint's size, from one stock save.
    probe = setup(Trainer)()
    save(probe)
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(probe[0]) for f in fs)
    cleanup(probe)

    reps = 2 if s.tiny else (3 if s.quick else 5)
    h.log(f"trainer: {n_params / 1e6:.1f}M parameters, {h.fmt_size(size)} checkpoint, {reps} rounds")
    times = h.interleave(
        [
            h.Method(TX, save, setup(TxTrainer), cleanup),
            h.Method(STOCK, save_fsync, setup(Trainer), cleanup),
            h.Method(STOCK_ND, save, setup(Trainer), cleanup),
        ],
        reps,
        warmup=1,
    )
    profiles = []
    if h.median(times[TX]) > 1.05 * h.median(times[STOCK]) and not s.tiny:
        profiles.append(
            profiling.fsync_census(
                "one Trainer+mixin _save_checkpoint", save, setup(TxTrainer), cleanup, root_of=lambda ctx: ctx[0]
            )
        )
        profiles.append(profiling.profile_call("one Trainer+mixin _save_checkpoint", save, setup(TxTrainer), cleanup))
    label = f"{n_params / 1e6:.{0 if n_params >= 1e7 else 1}f}M params, {h.fmt_size(size)}"
    rows = [
        h.compare(
            "Trainer+mixin _save_checkpoint ÷ stock _save_checkpoint + fsync of every file",
            label,
            times,
            TX,
            STOCK,
            1.05,
        ),
        h.compare(
            "Trainer+mixin _save_checkpoint ÷ stock _save_checkpoint, no fsync",
            label,
            times,
            TX,
            STOCK_ND,
            None,
            "report only: what users have today",
        ),
    ]
    return {
        "id": "trainer",
        "title": "Trainer _save_checkpoint",
        "rows": rows,
        "about": (
            f"GPT-2 from a config (random init), {n_params / 1e6:.1f}M parameters, AdamW state "
            "materialised by one optimizer step. `_save_checkpoint(model, trial=None)` at global step "
            f"{step}, each into a fresh output_dir, the three methods interleaved. The stock side's "
            "fsync covers every file and directory it wrote (`checkpoint-N` and its parent)."
        ),
        "profiles": profiles,
        "series": {
            f"{TX} (GPT-2)": [[size, h.median(times[TX])]],
            f"{STOCK} (GPT-2)": [[size, h.median(times[STOCK])]],
            f"{STOCK_ND} (GPT-2)": [[size, h.median(times[STOCK_ND])]],
        },
    }
