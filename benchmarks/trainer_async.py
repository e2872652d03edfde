"""The Trainer with ``txckpt_async_save=True``: what a save costs the training run, against the
synchronous save, and the memory of many async saves.

Overhead per save. Four ``Trainer.train()`` runs of the same length, interleaved: no saves,
synchronous saves, async saves (``True``: the lazy snapshot, as this model's AdamW allows),
async saves (``"copy"``: copy-first), every ``K`` steps. Each run's *window* goes from the end of step
2K (the first save, which allocates the snapshot buffers, is before it) to the moment the save
of the last step has waited for the one before it; it holds the saves of steps 2K .. S-K and
every step after them. ``(window of the method - window without saves) / saves in the window``
is the time a save costs the run: the time the loop is blocked plus the slowdown of the steps
that run while the background save competes with them (CPU, memory bandwidth, the disk).
Training uses one torch thread, as a GPU job leaves the host's cores to everything else.

Memory. In a subprocess, 100 ``txckpt.async_save`` calls of the synthetic state, changed in place
between saves: VmHWM (peak RSS) above the RSS holding the state, and the RSS growth between the
10th and the 100th save, both divided by the state's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from . import harness as h

TITLE = "Trainer async save"

NONE, SYNC, ASYNC, COPY = (
    "no saves",
    "Trainer + mixin, sync save",
    "Trainer + mixin, txckpt_async_save=True",
    'Trainer + mixin, txckpt_async_save="copy"',
)


def _config(s: h.Settings):
    from transformers import GPT2Config

    if s.tiny:
        dims = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
    elif s.quick:
        dims = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8000)
    else:  # ~100M parameters: a ~1.2 GiB checkpoint with AdamW's state
        dims = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=24000)
    return GPT2Config(n_positions=64, bos_token_id=0, eos_token_id=0, **dims)


def _overhead(s: h.Settings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch
    import transformers
    from transformers import GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from txckpt._async import asyncsave
    from txckpt.integrations.transformers import TransactionalTrainer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ["TXCKPT_DURABLE"] = "1"  # measured durable, as the mixin saves by default
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _config(s)
    model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    every = 2 if s.tiny else 3 if s.quick else 6
    steps = 4 * every
    seq = 16 if s.tiny else 32

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            ids = torch.randint(0, cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_end: dict[int, float] = {}

        def on_step_end(self, args, state, control, **kwargs):
            self.step_end[state.global_step] = time.perf_counter()

    class Timed(TransactionalTrainer):
        """Records, per save, when it began, when the previous save was settled, when it returned."""

        def _save_checkpoint(self, model, trial, *args, **kwargs):
            t0 = time.perf_counter()
            self._txckpt_async.settle()  # the wait for the previous save, timed apart
            t1 = time.perf_counter()
            super()._save_checkpoint(model, trial, *args, **kwargs)
            self.saves[int(self.state.global_step)] = (t0, t1, time.perf_counter())

    def setup(mode: str):
        def inner():
            out = h.fresh_dir("trainer-async")
            args = TrainingArguments(
                output_dir=out,
                report_to=[],
                use_cpu=True,
                max_steps=steps,
                save_strategy="no" if mode == NONE else "steps",
                save_steps=every,
                logging_strategy="no",
                disable_tqdm=True,
                seed=0,
                per_device_train_batch_size=1,
                dataloader_num_workers=0,
            )
            clock = Clock()
            t = Timed(
                model=model,
                args=args,
                train_dataset=Tokens(),
                callbacks=[clock],
                txckpt_async_save={ASYNC: True, COPY: "copy"}.get(mode, False),
            )
            t.saves = {}
            return {"out": out, "trainer": t, "clock": clock}

        return inner

    windows: dict[str, list[float]] = {NONE: [], SYNC: [], ASYNC: [], COPY: []}
    blocked: dict[str, list[float]] = {SYNC: [], ASYNC: [], COPY: []}
    waits: dict[str, list[float]] = {ASYNC: [], COPY: []}
    copy_waits: list[float] = []

    def run(mode: str):
        def inner(ctx):
            t = ctx["trainer"]
            t.train()
            start = ctx["clock"].step_end[2 * every]
            end = ctx["clock"].step_end[steps] if mode == NONE else t.saves[steps][1]
            windows[mode].append(end - start)
            if mode != NONE:
                mid = [t.saves[k] for k in range(2 * every, steps, every)]
                blocked[mode] += [c - b for _a, b, c in mid]
                if mode in waits:
                    waits[mode].extend(b - a for a, b, _c in mid)
                if mode == ASYNC:
                    copy_waits.extend(t._txckpt_async.copy_waits[1:])  # after the window's saves (2K .. S-K)

        return inner

    def cleanup(ctx):
        asyncsave.release_buffers(ctx["out"])
        h.remove(ctx["out"])

    reps = 1 if s.tiny else 2 if s.quick else 3
    probe = setup(SYNC)()
    try:
        probe["trainer"].train()
        last = os.path.join(probe["out"], f"checkpoint-{steps}")
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(last) for f in fs)
    finally:
        cleanup(probe)
    h.log(
        f"trainer_async: {n_params / 1e6:.1f}M parameters, {h.fmt_size(size)} checkpoint, save every "
        f"{every} of {steps} steps, {reps} rounds"
    )
    try:
        h.interleave([h.Method(m, run(m), setup(m), cleanup) for m in (NONE, SYNC, ASYNC, COPY)], reps, warmup=0)
    finally:
        torch.set_num_threads(threads)
    saves = steps // every - 2  # 2K .. S-K
    per_save = {m: [(w - b) / saves for w, b in zip(windows[m], windows[NONE])] for m in (SYNC, ASYNC, COPY)}
    label = f"{n_params / 1e6:.{0 if n_params >= 1e7 else 1}f}M params, {h.fmt_size(size)}"
    times = {m: [max(x, 0.0) for x in v] for m, v in per_save.items()}
    rows = [
        h.compare(
            "training-time overhead per save: async (True: lazy) ÷ sync",
            label,
            times,
            ASYNC,
            SYNC,
            0.3,
            f"{saves} saves per window; a negative overhead (noise) counts as 0",
        ),
        h.compare('training-time overhead per save: async ("copy": copy-first) ÷ sync', label, times, COPY, SYNC, None),
        h.compare(
            "time _save_checkpoint blocks: async (True: lazy) ÷ sync",
            label,
            blocked,
            ASYNC,
            SYNC,
            None,
            f"plus the next optimizer step's wait for the copy, median {h.median(copy_waits):.3f} s; "
            f"not counted: its wait for the previous save, median {h.median(waits[ASYNC]):.3f} s",
        ),
        h.compare(
            'time _save_checkpoint blocks: async ("copy": copy-first) ÷ sync',
            label,
            blocked,
            COPY,
            SYNC,
            None,
            f"not counted: its wait for the previous save, median {h.median(waits[COPY]):.3f} s",
        ),
    ]
    series = {f"{m} overhead per save": [[size, h.median(times[m])]] for m in (SYNC, ASYNC, COPY)}
    return rows, {
        "label": label,
        "size": size,
        "every": every,
        "steps": steps,
        "series": series,
        "step_time": h.median(windows[NONE]) / (steps - 2 * every),
        "windows": ", ".join(f"{m}: {' / '.join(f'{w:.1f}' for w in windows[m])} s" for m in windows),
    }


# ----- memory over 100 async saves (a subprocess) ----------------------------------------------


def child(size: int, saves: int, directory: str) -> dict[str, Any]:
    import torch

    import txckpt
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention

    from .state import files_of, make_state, state_bytes

    weights, optim = make_state(size)
    files = files_of(weights, optim)
    nbytes = state_bytes(weights, optim)
    with_state = h.proc_status("VmRSS")
    rss: dict[int, int] = {}
    first = next(iter(weights.values()))
    for i in range(1, saves + 1):
        txckpt.async_save(directory, i, files)
        with torch.no_grad():
            first.add_(1.0)  # training goes on: the live state changes while the save runs
        if i % 10 == 0:
            txckpt.wait_for_saves()
            apply_retention(txckpt.open_root(directory), RetentionPolicy(keep_last=2))
            rss[i] = h.proc_status("VmRSS")
    txckpt.wait_for_saves()
    return {"state": nbytes, "with_state": with_state, "peak": h.proc_status("VmHWM"), "rss": rss}


def _memory(s: h.Settings) -> list[dict[str, Any]]:
    size = list(s.sizes)[0] if s.tiny else 32 * h.MiB if s.quick else 128 * h.MiB
    saves = 20 if s.tiny else 100
    d = h.fresh_dir("trainer-async-mem")
    try:
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.run(
            [sys.executable, "-m", "benchmarks.trainer_async", str(size), str(saves), d],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
            cwd=here,
        )
        if p.returncode != 0:
            raise RuntimeError(f"memory child failed: {p.stderr[-2000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        h.remove(d)
    rss = {int(k): v for k, v in r["rss"].items()}
    peak = (r["peak"] - r["with_state"]) / r["state"]
    growth = (rss[max(rss)] - rss[min(rss)]) / r["state"]
    return [
        {
            "case": f"peak RSS above the state ÷ state, over {saves} async saves",
            "size": size,
            "ratio": peak,
            "goal": 1.10,
            "reps": 1,
            "note": "one snapshot copy is 1.0",
        },
        {
            "case": f"RSS growth from save {min(rss)} to save {max(rss)} ÷ state",
            "size": size,
            "ratio": growth,
            "goal": 0.05,
            "reps": 1,
            "note": "growth would mean snapshot buffers are not reused",
        },
    ]


def run(quick: bool) -> dict[str, Any]:
    s = h.settings()
    rows, info = _overhead(s)
    rows += _memory(s)
    return {
        "id": "trainer-async",
        "title": "Trainer with txckpt_async_save: overhead per save",
        "rows": rows,
        "about": (
            f"GPT-2 from a config (random init), {info['label']}, AdamW, batch 1, one torch thread "
            f"(step ≈ {info['step_time']:.2f} s). `Trainer.train()` for {info['steps']} steps, a save every "
            f"{info['every']}, four runs interleaved per round: no saves, synchronous saves, async "
            "saves with `txckpt_async_save=True` (the lazy snapshot: the parameters and AdamW "
            "state copied by the background, the next optimizer step waiting for it), async "
            'saves with `"copy"` (copy-first). '
            "The overhead of a save is the run's window (from the end of step "
            f"{2 * info['every']} to the settling of the last save) minus the same window without "
            "saves, divided by the saves in it: the time the loop is blocked plus the slowdown of "
            "the steps the background save runs beside. The last row: 100 `txckpt.async_save` "
            "calls of the synthetic state in a subprocess (VmHWM, RSS)."
        ),
        "notes": [f"Windows per round: {info['windows']}."],
        "series": info["series"],
    }


if __name__ == "__main__":
    print(json.dumps(child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])))
