"""save_checkpoint against the physical limit, torch DCP and the stock writers, per size."""

from __future__ import annotations

import os
import warnings
from typing import Any

from . import harness as h
from . import profiling
from .state import files_of, fsync_tree, make_state, state_bytes, tensors_of, write_raw

TITLE = "Save"

RAW = "raw write + fsync"
TX = "txckpt, fsync on"
DCP = "torch DCP FileSystemWriter"
TX_ND = "txckpt, fsync off"
STOCK_ND = "safetensors + torch.save"
STOCK = "safetensors + torch.save + fsync"


def _checkpoint_bytes(path: str) -> int:
    total = 0
    for dirpath, _d, files in os.walk(path):
        for n in files:
            if n != "txckpt-manifest.json":
                total += os.path.getsize(os.path.join(dirpath, n))
    return total


def methods(weights: dict[str, Any], optim: dict[str, Any], nbytes: int) -> list[h.Method]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from txckpt import CheckpointRoot

    files = files_of(weights, optim)
    tensors = tensors_of(weights, optim)

    def tx_setup(durable: bool):
        def setup():
            d = h.fresh_dir("tx")
            root = CheckpointRoot(d, durable=durable)
            assert root.durable is durable
            root.new_lineage()  # what the first save of a run does; a steady-state save finds it
            return d, root
        return setup

    def dir_setup():
        return h.fresh_dir("other"), None

    def cleanup(ctx):
        h.remove(ctx[0])

    def raw(ctx):
        write_raw(os.path.join(ctx[0], "raw.bin"), tensors, nbytes=nbytes, fsync=True)

    def tx(ctx):
        ctx[1].save(1, files)

    def dcp_save(ctx):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": weights, "optim": optim}, storage_writer=dcp.FileSystemWriter(ctx[0]))

    def stock(ctx, fsync: bool):
        out = os.path.join(ctx[0], "checkpoint-1")
        os.makedirs(out)
        save_file(weights, os.path.join(out, "model.safetensors"))
        torch.save(optim, os.path.join(out, "optimizer.pt"))
        if fsync:
            fsync_tree(out)

    return [
        h.Method(RAW, raw, dir_setup, cleanup),
        h.Method(TX, tx, tx_setup(True), cleanup),
        h.Method(DCP, dcp_save, dir_setup, cleanup),
        h.Method(TX_ND, tx, tx_setup(False), cleanup),
        h.Method(STOCK_ND, lambda c: stock(c, False), dir_setup, cleanup),
        h.Method(STOCK, lambda c: stock(c, True), dir_setup, cleanup),
    ]


def run(quick: bool) -> dict[str, Any]:
    from txckpt import CheckpointRoot

    s = h.settings()
    rows: dict[str, list[dict[str, Any]]] = {"fsync": [], "dcp": [], "nofsync": [], "stock": []}
    series: dict[str, list[list[float]]] = {}
    profiles: list[str] = []
    for i, size in enumerate(s.sizes):
        h.log(f"save: {h.fmt_size(size)}, {s.reps[size]} rounds")
        weights, optim = make_state(size)
        # The raw write moves exactly as many bytes as txckpt's data files hold.
        probe = h.fresh_dir("probe")
        root = CheckpointRoot(probe, durable=False)
        nbytes = _checkpoint_bytes(root.save(1, files_of(weights, optim)))
        h.remove(probe)
        ms = methods(weights, optim, nbytes)
        times = h.interleave(ms, s.reps[size], warmup=1 if i == 0 else 0)
        for name, ts in times.items():
            series.setdefault(name, []).append([size, h.median(ts)])
        label = size
        note = f"{nbytes / size:.3f}x state bytes on disk" if i == 0 else ""
        rows["fsync"].append(h.compare("txckpt ÷ one sequential write + fsync", label, times, TX, RAW, 1.10, note))
        rows["dcp"].append(h.compare("txckpt ÷ torch.distributed.checkpoint.save", label, times, TX, DCP, 1.0))
        rows["nofsync"].append(h.compare("txckpt (durable=False) ÷ save_file + torch.save", label, times, TX_ND, STOCK_ND, 1.05))
        rows["stock"].append(h.compare("txckpt ÷ save_file + torch.save + fsync", label, times, TX, STOCK, None))
        missed = [r for k, r in ((k, v[-1]) for k, v in rows.items()) if r["goal"] is not None and r["ratio"] > r["goal"]]
        if not s.tiny and (size == s.sizes[0] or (missed and size == s.sizes[-1])):
            profiles.append(profiling.fsync_census(
                f"one txckpt save (fsync on) of {h.fmt_size(size)}",
                lambda ctx: ctx[1].save(1, files_of(weights, optim)), *_profile_root(True),
                root_of=lambda ctx: ctx[0]))
        if missed and size == s.sizes[-1] and not s.tiny:
            profiles.append(profiling.profile_call(
                f"one txckpt save (fsync on) of {h.fmt_size(size)}",
                lambda ctx: ctx[1].save(1, files_of(weights, optim)), *_profile_root(True)))
        del weights, optim, ms
    about_common = (
        "State: float32 tensors, 1/3 model weights (`model.safetensors`), 2/3 AdamW state "
        "(`exp_avg`, `exp_avg_sq`; `optimizer.pt` via torch.save). Every save goes to a fresh "
        "directory; dirty pages are synced (untimed) before each timed save; methods run "
        "interleaved, the order rotated every round. txckpt runs through `CheckpointRoot.save` "
        "(what `txckpt.save_checkpoint` calls) on a root whose lineage exists (created untimed)."
    )
    tables = [
        {"id": "save-fsync", "title": "Save, fsync on: txckpt vs the physical limit", "rows": rows["fsync"],
         "about": about_common + " The physical limit writes the same number of bytes as txckpt's data "
                  "files in one sequential `os.write` stream to one new file, then one `fsync`.",
         "series": series, "profiles": profiles},
        {"id": "save-dcp", "title": "Save, fsync on: txckpt vs torch DCP", "rows": rows["dcp"],
         "about": "`torch.distributed.checkpoint.save({'model': weights, 'optim': optimizer_state}, "
                  "storage_writer=FileSystemWriter(dir))`, single process without a process group, "
                  "defaults (`sync_files=True`, one thread)."},
        {"id": "save-nofsync", "title": "Save, durability off: txckpt vs the stock writers", "rows": rows["nofsync"],
         "about": "`CheckpointRoot(root, durable=False)` against `safetensors.torch.save_file` + "
                  "`torch.save`, neither fsyncing."},
        {"id": "save-stock-fsync", "title": "Save, fsync on: txckpt vs the stock writers + fsync (report)",
         "rows": rows["stock"],
         "about": "The stock writers followed by an fsync of each file and directory: what a "
                  "user would have to add to get txckpt's durability (no atomicity, no checksums)."},
    ]
    return {"tables": tables}


def _profile_root(durable: bool):
    from txckpt import CheckpointRoot

    def setup():
        d = h.fresh_dir("profile")
        root = CheckpointRoot(d, durable=durable)
        root.new_lineage()
        return d, root

    return setup, lambda ctx: h.remove(ctx[0])
