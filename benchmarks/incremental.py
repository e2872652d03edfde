"""Incremental saves (issue 30, files; docs/incremental.md): a frozen base beside a trained adapter.

State: a frozen base of S bytes in ``base.safetensors``, an adapter of S/64 in
``adapter.safetensors`` and its Adam state (2x the adapter) in ``optimizer.pt``, a small
``config.json``. Each round every method saves the next step of its own root (fsync on): the
adapter and its optimizer state change every step, the base never does.

* *frozen base*: ``save_checkpoint(incremental=True)`` against ``save_checkpoint()``: time per
  save, and the bytes each save puts on disk (a file whose inode is new) against the bytes that
  changed;
* *full fine-tune*: every tensor changes every step (the base too): the incremental save must
  cost what a plain save costs (it tells a changed file within its first MiB);
* after the rounds: what the incremental root's checkpoints occupy on disk (each inode counted
  once) against one base plus one delta per checkpoint.

The same frozen base saved through DCP by 2 ranks (``TransactionalWriter(incremental=True)``) is
a second table, from benchmarks/dcp_incremental.py; a Trainer saving a GPT-2 with a frozen base in
shards (``txckpt_incremental=True``) a third, from benchmarks/trainer_incremental.py.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from . import dcp_incremental  # the same frozen base through DCP, 2 ranks: a table of its own
from . import harness as h
from . import trainer_incremental  # a Trainer's save_pretrained shards, a frozen base: a third table

TITLE = "Incremental save"
INC = "save_checkpoint(incremental=True)"
FULL = "save_checkpoint()"


def _state(size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    base = {f"layer{i}.w": torch.randn(size // 4 // 8, generator=g) for i in range(8)}
    adapter = {"lora.a": torch.randn(max(size // 64 // 4, 64), generator=g)}
    return base, adapter


def _files(base: dict[str, Any], adapter: dict[str, Any], step: int) -> dict[str, Any]:
    a = {k: v + step for k, v in adapter.items()}
    return {
        "base.safetensors": base,
        "adapter.safetensors": a,
        "optimizer.pt": {
            "exp_avg": {k: v * 0.5 for k, v in a.items()},
            "exp_avg_sq": {k: v * v for k, v in a.items()},
            "step": step,
        },
        "config.json": {"layers": 8, "frozen": True},
    }


def _new_bytes(path: str, before: set[int]) -> int:
    """Bytes of the files of checkpoint ``path`` whose inode no earlier checkpoint holds."""
    total = 0
    for name in os.listdir(path):
        st = os.stat(os.path.join(path, name))
        if name != "txckpt-manifest.json" and st.st_ino not in before:
            total += st.st_size
    return total


def _inodes(root: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for dirpath, _, names in os.walk(root):
        if "/.txckpt" in dirpath:
            continue
        for n in names:
            if n != "txckpt-manifest.json":
                st = os.stat(os.path.join(dirpath, n))
                out[st.st_ino] = st.st_size
    return out


def _frozen_table(size: int, reps: int) -> list[dict[str, Any]]:
    import txckpt

    base, adapter = _state(size)
    roots = {INC: h.fresh_dir("inc"), FULL: h.fresh_dir("full")}
    steps = {INC: itertools.count(1), FULL: itertools.count(1)}
    written: dict[str, list[int]] = {INC: [], FULL: []}
    changed: list[int] = []

    def method(name: str, incremental: bool) -> h.Method:
        def setup():  # untimed: the step's state exists before a save is asked for
            step = next(steps[name])
            return {"step": step, "files": _files(base, adapter, step), "before": set(_inodes(roots[name]))}

        def run(ctx):
            ctx["path"] = txckpt.save_checkpoint(roots[name], ctx["step"], ctx["files"], incremental=incremental)

        def done(ctx):
            written[name].append(_new_bytes(ctx["path"], ctx["before"]))
            if name == INC:
                m = txckpt.read_manifest(ctx["path"]).files
                changed.append(sum(m[n].size for n in ("adapter.safetensors", "optimizer.pt")))

        return h.Method(name, run, setup, done)

    try:
        times = h.interleave([method(INC, True), method(FULL, False)], reps, warmup=1)
        saves = len(written[INC])
        on_disk = sum(_inodes(roots[INC]).values())
        full_one = written[FULL][-1]
        delta = h.median(changed)
        one_plus_deltas = full_one + (saves - 1) * delta
    finally:
        for r in roots.values():
            h.remove(r)
    inc_written = h.median(written[INC][1:])  # the first save writes the base
    rows = [
        h.compare(
            "incremental ÷ full save time, frozen base + adapter", size, times, INC, FULL, 0.15, alternating=True
        ),
        {
            "case": "bytes written per incremental save ÷ bytes that changed",
            "size": size,
            "txckpt": inc_written,
            "other": delta,
            "ratio": inc_written / delta if delta else float("nan"),
            "goal": 1.05,
            "reps": saves - 1,
            "unit": "bytes",
            "note": f"a full save writes {h.fmt_size(full_one)} ({full_one / max(inc_written, 1):.0f}x)",
        },
        {
            "case": f"disk use of the incremental root's {saves} checkpoints ÷ (one full + {saves - 1} deltas)",
            "size": size,
            "txckpt": on_disk,
            "other": one_plus_deltas,
            "ratio": on_disk / one_plus_deltas if one_plus_deltas else float("nan"),
            "goal": 1.2,
            "reps": 1,
            "unit": "bytes",
        },
    ]
    return rows


def one_file_row(size: int, reps: int) -> dict[str, Any]:
    """The frozen base in one file (issue 47's "frozen-base probe <= 0.15x a full save"): one
    ``model.safetensors`` of the base's 8 tensors and a small tensor (1/256 of it) that changes
    every step, saved with ``incremental=True`` (grouped: the frozen tensors' file is shared,
    proven unchanged from their digests, protocol §3c) against a save without it, fsync on,
    each into its own root, alternating rounds after two warm-up rounds (the incremental root's
    first save writes the one file, its second the frozen file)."""
    import torch

    base, _ = _state(size)

    head = torch.randn(max(size // 256 // 4, 64), generator=torch.Generator().manual_seed(1))
    return _incremental_against_full(
        "incremental ÷ full save time, frozen base + a changed tensor in one model.safetensors",
        "one",
        size,
        reps,
        2,
        0.15,
        lambda step: {"model.safetensors": {**base, "head": head + step}},
    )


def _finetune_row(size: int, reps: int) -> dict[str, Any]:
    base, adapter = _state(size)
    return _incremental_against_full(
        "incremental ÷ full save time, full fine-tune (every byte changes)",
        "ft",
        size,
        reps,
        1,
        1.03,
        lambda step: _files({k: v + step for k, v in base.items()}, adapter, step),  # everything changes
    )


def _incremental_against_full(
    case: str, tag: str, size: int, reps: int, warmup: int, goal: float, files_at: Any
) -> dict[str, Any]:
    """Saves of ``files_at(step)`` with and without ``incremental=True``, each into a root of
    its own, in alternating rounds after ``warmup`` (h.interleave alternates the order): the
    time ratio as a row of ``case``."""
    import txckpt

    roots = {INC: h.fresh_dir(f"inc-{tag}"), FULL: h.fresh_dir(f"full-{tag}")}
    steps = {INC: itertools.count(1), FULL: itertools.count(1)}

    def method(name: str, incremental: bool) -> h.Method:
        def setup():  # untimed: the step's state exists before a save is asked for
            step = next(steps[name])
            return {"step": step, "files": files_at(step)}

        def run(ctx):
            txckpt.save_checkpoint(roots[name], ctx["step"], ctx["files"], incremental=incremental)

        return h.Method(name, run, setup)

    try:
        times = h.interleave([method(INC, True), method(FULL, False)], reps, warmup=warmup)
    finally:
        for r in roots.values():
            h.remove(r)
    return h.compare(case, size, times, INC, FULL, goal, alternating=True)


def run(quick: bool) -> dict[str, Any]:
    s = h.settings()
    size = list(s.sizes)[-1] if s.tiny else 256 * h.MiB if s.quick else 1 * h.GiB
    reps = 2 if s.tiny else 6 if s.quick else 10  # even: as many rounds in each order
    h.log(f"incremental: {h.fmt_size(size)}, {reps} rounds")
    rows = _frozen_table(size, reps) + [one_file_row(size, reps), _finetune_row(size, reps)]
    return {"tables": [_files_table(rows), dcp_incremental.run(quick), _trainer_table(quick)]}


def _trainer_table(quick: bool) -> dict[str, Any]:
    """The Trainer's table, or a failed table saying why: its checks raise (a checkpoint stock
    transformers cannot load), and that must not take the two tables above with it."""
    try:
        return trainer_incremental.run(quick)
    except Exception as e:
        return h._failed(trainer_incremental.TITLE, e)


def _files_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": "incremental",
        "title": "Incremental save: frozen base + adapter (local disk, fsync on)",
        "rows": rows,
        "about": "A frozen base (8 tensors, the size column) in `base.safetensors`, an adapter of 1/64 of "
        "it in `adapter.safetensors` and its Adam state in `optimizer.pt`, and a small "
        "`config.json`; each method saves the next step of its own root, interleaved rounds "
        "after one warm-up round. The adapter and its state change every step. *Bytes written*: "
        "the files of a checkpoint whose inode no earlier checkpoint holds. The full fine-tune "
        "row changes every tensor every step. docs/incremental.md explains the method.",
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.incremental [--quick|--tiny]``: the one-file row alone (1 GiB base,
    10 rounds; ``--quick`` 256 MiB, 6), printed with the load average it ran under."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    s = h.configure(quick=args.quick or args.tiny, tiny=args.tiny)
    size = list(s.sizes)[-1] if s.tiny else 256 * h.MiB if s.quick else 1 * h.GiB
    reps = 2 if s.tiny else 6 if s.quick else 10
    load = os.getloadavg()
    row = one_file_row(size, reps)
    print(
        f"{row['case']}: {h.fmt_size(size)}, {row['reps']} rounds, load average before {load[0]:.2f}, after "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"  incremental median {row['txckpt']:.3f} s, full median {row['other']:.3f} s")
    print(
        f"  ratio (median of order-balanced round ratios) {row['ratio']:.3f}x (goal 0.15x); "
        f"ratio of medians {row['ratio_of_medians']:.3f}x"
    )
    print("  per-round ratios " + " ".join(f"{r:.3f}" for r in row["paired"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
