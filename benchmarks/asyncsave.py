"""The time ``txckpt.async_save`` blocks the training loop, against a plain copy of the state into
preallocated, already-touched buffers (the floor of any copy-first snapshot) and against
``torch.distributed.checkpoint.async_save`` with its staging buffers reused (its steady state).

Steady state for every method: one untimed warm-up round first (txckpt's snapshot buffers and
DCP's stager exist from then on), then interleaved rounds. The background part of each save is
waited for, untimed, before the next method runs, so it never overlaps a measured call. txckpt
saves into one root per size (step 1, 2, ...), fsync on, as ``save_checkpoint`` does by default.
A second table: the blocked time against the whole synchronous save on the moto S3 server.

The lazy mode (``async_save(..., optimizer=)``) runs in the same rounds on the same tensors,
with a real ``torch.optim.AdamW`` over the weights holding the optimizer state: a training step
is the save, a forward and backward of every weight (one torch thread, as a GPU job leaves the
host's cores to the rest), then ``optimizer.step()``. Its blocked time is the call plus the
step's wait for the background copy (the forward and backward are not blocked: they are the
training the copy runs beside); the note compares them with the same forward and backward run
with no save in flight.
"""

from __future__ import annotations

import itertools
import time
import warnings
from typing import Any

from . import harness as h
from .state import files_of, make_state, state_bytes, tensors_of

TITLE = "Async save"

TX = "txckpt.async_save (blocked)"
LAZY = "txckpt.async_save(optimizer=) (blocked: call + the step's wait)"
STEP = "forward + backward, no save in flight"
DCP = "dcp.async_save (blocked)"
COPY = "copy into preallocated buffers"
SYNC = "txckpt.save_checkpoint"


def sizes(s: h.Settings) -> list[int]:
    """The state sizes an async-save benchmark runs (benchmarks/lightning.py's too, so that their rows compare)."""
    if s.tiny:
        return list(s.sizes)
    if s.quick:
        return [64 * h.MiB]
    return [512 * h.MiB, 2 * h.GiB]


def methods(weights: dict[str, Any], optim: dict[str, Any], root: str) -> tuple[list[h.Method], Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import txckpt
    from txckpt._async import asyncsave

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
            ctx["future"] = dcp.async_save(
                {"model": weights, "optim": optim}, storage_writer=dcp.FileSystemWriter(ctx["dir"]), async_stager=stager
            )

    def dcp_done(ctx):
        ctx["future"].result()
        h.remove(ctx["dir"])

    def copy(ctx):
        for b, t in zip(floor, tensors):
            b.copy_(t)

    # The lazy mode's training step: the weights as parameters (the same storages), an AdamW
    # holding the optimizer state, every weight in the forward pass.
    names = list(weights)
    params = [torch.nn.Parameter(weights[n]) for n in names]
    opt = torch.optim.AdamW(params, lr=1e-9)
    opt.load_state_dict(optim)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0))
    fb: dict[str, list[float]] = {LAZY: [], STEP: []}

    def forward_backward(into: str) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        try:
            loss = sum(((x @ p.t()).square().mean() if p.dim() == 2 else p.square().sum()) for p in params)
            loss.backward()
        finally:
            torch.set_num_threads(threads)
        fb[into].append(time.perf_counter() - t0)

    def lazy(ctx):
        files = {"model.safetensors": {n: p.detach() for n, p in zip(names, params)}, "optimizer.pt": opt.state_dict()}
        gate = asyncsave.step_gate(opt)
        t0 = time.perf_counter()
        ctx["future"] = txckpt.async_save(root, next(steps), files, optimizer=opt)
        call = time.perf_counter() - t0
        forward_backward(LAZY)
        n = len(gate.waits)
        opt.step()
        wait = gate.waits[-1] if len(gate.waits) > n else 0.0
        opt.zero_grad(set_to_none=True)
        ctx["parts"] = (call, wait)
        return call + wait

    def lazy_done(ctx):
        ctx["future"].result()
        calls.append(ctx["parts"])

    def step_only(ctx):
        forward_backward(STEP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return 0.0

    calls: list[tuple[float, float]] = []
    return [
        h.Method(TX, tx, dict, tx_done),
        h.Method(DCP, dcp_run, dcp_setup, dcp_done),
        h.Method(COPY, copy),
        h.Method(SYNC, sync, dict),
        h.Method(LAZY, lazy, dict, lazy_done, self_timed=True),
        h.Method(STEP, step_only, self_timed=True),
    ], (fb, calls)


def _s3_table() -> dict[str, Any]:
    """Blocked time of async_save ÷ a full save_checkpoint to the moto S3 server (256 MiB)."""
    title = "Async save on S3: blocked time against the synchronous save"
    import importlib.util

    missing = [m for m in ("moto", "s3fs") if importlib.util.find_spec(m) is None]
    if missing:
        return {"title": title, "status": "skipped", "reason": f"needs s3fs and moto[server] ({missing})", "rows": []}
    import txckpt
    from txckpt._async import asyncsave

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
            times = h.interleave(
                [h.Method(TX, tx, dict, lambda ctx: ctx["future"].result()), h.Method(SYNC, sync, dict)], reps, warmup=1
            )
        finally:
            asyncsave.release_buffers(url, so)
    row = h.compare("txckpt.async_save blocked ÷ txckpt.save_checkpoint (moto S3)", size, times, TX, SYNC, 0.10)
    return {
        "id": "asyncsave-s3",
        "title": title,
        "rows": [row],
        "about": "The same state saved to an S3 root on the local moto server "
        "(`emulators/s3.py`): the time `async_save` blocks against the whole synchronous "
        "save (the upload). One warm-up round, then interleaved rounds; each async save is "
        "waited for, untimed, before the next method runs.",
    }


def run(quick: bool) -> dict[str, Any]:
    from txckpt._async import asyncsave

    s = h.settings()
    rows: list[dict[str, Any]] = []
    for size in sizes(s):
        reps = s.reps.get(size, 2 if s.tiny else 5)
        h.log(f"asyncsave: {h.fmt_size(size)}, {reps} rounds")
        weights, optim = make_state(size)
        root = h.fresh_dir("async")
        try:
            ms, (fb, calls) = methods(weights, optim, root)
            times = h.interleave(ms, reps, warmup=1)
        finally:
            asyncsave.release_buffers(root)
            h.remove(root)
        note = f"{h.fmt_size(state_bytes(weights, optim))} of tensors"
        rows.append(
            h.compare(
                "txckpt.async_save blocked ÷ a plain copy into preallocated buffers", size, times, TX, COPY, 1.5, note
            )
        )
        rows.append(
            h.compare("txckpt.async_save blocked ÷ dcp.async_save blocked (stager reused)", size, times, TX, DCP, 0.6)
        )
        rows.append(
            h.compare(
                "txckpt.async_save blocked ÷ txckpt.save_checkpoint (local, fsync on)", size, times, TX, SYNC, None
            )
        )
        timed = calls[-reps:]  # the warm-up round's first
        lazy_fb, plain_fb = fb[LAZY][-reps:], fb[STEP][-reps:]
        lazy_note = (
            f"the call {h.median([c for c, _ in timed]):.4f} s, the next step's wait for the copy "
            f"{h.median([w for _, w in timed]):.4f} s (medians); the forward and backward beside the "
            f"background copy {h.median(lazy_fb):.3f} s, with no save in flight {h.median(plain_fb):.3f} s "
            f"(slowdown {h.median(lazy_fb) - h.median(plain_fb):+.3f} s)"
        )
        rows.append(
            h.compare(
                "txckpt.async_save(optimizer=) blocked ÷ a plain copy into preallocated buffers",
                size,
                times,
                LAZY,
                COPY,
                1.5,
                lazy_note,
            )
        )
        rows.append(
            h.compare(
                "txckpt.async_save(optimizer=) blocked ÷ dcp.async_save blocked (stager reused)",
                size,
                times,
                LAZY,
                DCP,
                0.6,
            )
        )
        del weights, optim, ms
    local = {
        "id": "asyncsave",
        "title": "Async save: time the training loop is blocked",
        "rows": rows,
        "about": "State: the synthetic state of the save benchmarks (1/3 weights in "
        "`model.safetensors`, 2/3 AdamW state in `optimizer.pt`). *Blocked* is the time "
        "until the call returns (txckpt: the snapshot; DCP: its staging). One warm-up "
        "round, then interleaved rounds; each save's background work is waited for, "
        "untimed, before the next method runs. The floor copies every tensor into "
        "buffers allocated and touched beforehand. The `optimizer=` rows: the same "
        "tensors as the parameters of a `torch.optim.AdamW` that holds the optimizer "
        "state; each round saves lazily, runs a forward and backward through every "
        "weight (one torch thread), then `optimizer.step()`; blocked is the call plus "
        "the step's wait for the background copy (the note has both, and the forward "
        "and backward with and without the copy beside them).",
    }
    return {"tables": [local, _s3_table()]}
