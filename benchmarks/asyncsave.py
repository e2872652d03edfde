"""The time ``txckpt.async_save`` blocks the training loop, against a plain copy of the state into
preallocated, already-touched buffers (the floor of any copy-first snapshot) and against
``torch.distributed.checkpoint.async_save`` with its staging buffers reused (its steady state).

Steady state for every method: one untimed warm-up round first (txckpt's snapshot buffers and
DCP's stager exist from then on), then interleaved rounds. The background part of each save is
waited for, untimed, before the next method runs, so it never overlaps a measured call. txckpt
saves into one root per size (step 1, 2, ...), fsync on, as ``save_checkpoint`` does by default.
A second table: the blocked time against the whole synchronous save on the moto S3 server.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

from . import harness as h
from .state import files_of, make_state, state_bytes, tensors_of

TITLE = "Async save"

TX = "txckpt.async_save (blocked)"
DCP = "dcp.async_save (blocked)"
COPY = "copy into preallocated buffers"
SYNC = "txckpt.save_checkpoint"


def _sizes(s: h.Settings) -> list[int]:
    if s.tiny:
        return list(s.sizes)
    if s.quick:
        return [64 * h.MiB]
    return [512 * h.MiB, 2 * h.GiB]


def methods(weights: dict[str, Any], optim: dict[str, Any], root: str) -> list[h.Method]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import txckpt

    files = files_of(weights, optim)
    tensors = tensors_of(weights, optim)
    steps = itertools.count(1)
    # No pinned or shared memory (no accelerator here), staging in the calling thread: the
    # stager keeps its buffers from one call to the next.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    floor = [torch.empty_like(t) for t in tensors]
    for b, t in zip(floor, tensors):
        b.copy_(t)  # touched: no page fault inside the timed copy

    def tx(ctx):
        ctx["future"] = txckpt.async_save(root, next(steps), files)

    def tx_done(ctx):
        ctx["future"].result()

    def sync(ctx):
        txckpt.save_checkpoint(root, next(steps), files)

    def dcp_setup():
        return {"dir": h.fresh_dir("dcp")}

    def dcp_run(ctx):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx["future"] = dcp.async_save({"model": weights, "optim": optim},
                                           storage_writer=dcp.FileSystemWriter(ctx["dir"]), async_stager=stager)

    def dcp_done(ctx):
        ctx["future"].result()
        h.remove(ctx["dir"])

    def copy(ctx):
        for b, t in zip(floor, tensors):
            b.copy_(t)

    return [
        h.Method(TX, tx, dict, tx_done),
        h.Method(DCP, dcp_run, dcp_setup, dcp_done),
        h.Method(COPY, copy),
        h.Method(SYNC, sync, dict),
    ]


def _s3_table() -> dict[str, Any]:
    """Blocked time of async_save ÷ a full save_checkpoint to the moto S3 server (256 MiB)."""
    title = "Async save on S3: blocked time against the synchronous save"
    import importlib.util

    missing = [m for m in ("moto", "s3fs") if importlib.util.find_spec(m) is None]
    if missing:
        return {"title": title, "status": "skipped", "reason": f"needs s3fs and moto[server] ({missing})",
                "rows": []}
    import txckpt
    from txckpt import asyncsave

    from .s3 import BUCKET, _server_module

    s = h.settings()
    size = list(s.sizes)[0] if s.tiny else 64 * h.MiB if s.quick else 256 * h.MiB
    reps = 2 if s.tiny else 3 if s.quick else 5
    weights, optim = make_state(size)
    files = files_of(weights, optim)
    steps = itertools.count(1)
    with _server_module().running_s3_server() as server:
        server.create_bucket(BUCKET)
        so = server.storage_options()
        url = f"s3://{BUCKET}/async"

        def tx(ctx):
            ctx["future"] = txckpt.async_save(url, next(steps), files, storage_options=so)

        def sync(ctx):
            txckpt.save_checkpoint(url, next(steps), files, storage_options=so)

        try:
            times = h.interleave([h.Method(TX, tx, dict, lambda ctx: ctx["future"].result()),
                                  h.Method(SYNC, sync, dict)], reps, warmup=1)
        finally:
            asyncsave.release_buffers(url, so)
    row = h.compare("txckpt.async_save blocked ÷ txckpt.save_checkpoint (moto S3)", size, times, TX, SYNC, 0.10)
    return {"id": "asyncsave-s3", "title": title, "rows": [row],
            "about": "The same state saved to an S3 root on the local moto server "
                     "(`emulators/s3.py`): the time `async_save` blocks against the whole synchronous "
                     "save (the upload). One warm-up round, then interleaved rounds; each async save is "
                     "waited for, untimed, before the next method runs."}


def run(quick: bool) -> dict[str, Any]:
    from txckpt import asyncsave

    s = h.settings()
    rows: list[dict[str, Any]] = []
    for size in _sizes(s):
        reps = s.reps.get(size, 2 if s.tiny else 5)
        h.log(f"asyncsave: {h.fmt_size(size)}, {reps} rounds")
        weights, optim = make_state(size)
        root = h.fresh_dir("async")
        try:
            times = h.interleave(methods(weights, optim, root), reps, warmup=1)
        finally:
            asyncsave.release_buffers(root)
            h.remove(root)
        note = f"{h.fmt_size(state_bytes(weights, optim))} of tensors"
        rows.append(h.compare("txckpt.async_save blocked ÷ a plain copy into preallocated buffers", size,
                              times, TX, COPY, 1.5, note))
        rows.append(h.compare("txckpt.async_save blocked ÷ dcp.async_save blocked (stager reused)", size,
                              times, TX, DCP, 0.6))
        rows.append(h.compare("txckpt.async_save blocked ÷ txckpt.save_checkpoint (local, fsync on)", size,
                              times, TX, SYNC, None))
        del weights, optim
    local = {"id": "asyncsave", "title": "Async save: time the training loop is blocked", "rows": rows,
            "about": "State: the synthetic state of the save benchmarks (1/3 weights in "
                     "`model.safetensors`, 2/3 AdamW state in `optimizer.pt`). *Blocked* is the time "
                     "until the call returns (txckpt: the snapshot; DCP: its staging). One warm-up "
                     "round, then interleaved rounds; each save's background work is waited for, "
                     "untimed, before the next method runs. The floor copies every tensor into "
                     "buffers allocated and touched beforehand. "}
    return {"tables": [local, _s3_table()]}
