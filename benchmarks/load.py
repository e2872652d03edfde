"""load_checkpoint with verification against the same load without it, warm and cold cache."""

from __future__ import annotations

import os
from typing import Any

from . import devlimit as dl
from . import harness as h
from . import profiling
from .state import evict, files_of, make_state

TITLE = "Load"

V_WARM, N_WARM, STOCK_WARM = "verify, warm", "no verify, warm", "stock, warm"
V_COLD, N_COLD = "verify, cold", "no verify, cold"
READ_LIMIT = "device read limit"


def run(quick: bool) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    import txckpt
    from txckpt import CheckpointRoot

    s = h.settings()
    warm_rows, cold_rows, stock_rows, limit_rows = [], [], [], []
    limit_notes: list[str] = []
    profiles: list[str] = []
    for size in s.sizes:
        h.log(f"load: {h.fmt_size(size)}, {s.reps[size]} rounds")
        d = h.fresh_dir("load")
        weights, optim = make_state(size)
        path = CheckpointRoot(d, durable=True).save(1, files_of(weights, optim))
        del weights, optim

        def load(verify: bool):
            return lambda _ctx: txckpt.load_checkpoint(path, verify=verify)

        def stock(_ctx):
            load_file(os.path.join(path, "model.safetensors"))
            torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)

        def cold():
            evict(path)

        warm = [h.Method(V_WARM, load(True), settle=False), h.Method(N_WARM, load(False), settle=False),
                h.Method(STOCK_WARM, stock, settle=False)]
        colds = [h.Method(V_COLD, load(True), cold, settle=False), h.Method(N_COLD, load(False), cold, settle=False)]
        # The device's read limit: every variant in the same cold rounds (each cheap next to a
        # save); per round the fastest of them.
        readers, read_buf = dl.read_variants(path)
        colds += [h.Method(name, lambda _ctx, fn=fn: fn(), cold, settle=False) for name, fn in readers.items()]
        # Loads are cheap next to saves: twice the rounds (the warm/cold pairs are noisy).
        reps = 2 if s.tiny else (2 * s.reps[size] - 1 if size <= h.GiB else s.reps[size])
        times = h.interleave(warm, reps, warmup=1)
        times.update(h.interleave(colds, reps, warmup=0))
        times[READ_LIMIT] = dl.elementwise_min(*(times[name] for name in readers))
        nbytes = sum(os.path.getsize(os.path.join(dp, n)) for dp, _d, ns in os.walk(path) for n in ns)
        limit_notes.append(f"{h.fmt_size(size)} ({nbytes:,} bytes of files): " + dl.sweep_note(
            {name: h.median(times[name]) for name in readers}, nbytes))
        for name, verify in ((V_COLD, "True"), (N_COLD, "False")):
            limit_rows.append(h.compare(f"load_checkpoint(verify={verify}), cold ÷ the device's read limit",
                                        size, times, name, READ_LIMIT, None))
        read_buf.close()
        warm_rows.append(h.compare("load_checkpoint(verify=True) ÷ (verify=False), warm cache", size, times,
                                   V_WARM, N_WARM, 1.03))
        cold_rows.append(h.compare("load_checkpoint(verify=True) ÷ (verify=False), cold cache", size, times,
                                   V_COLD, N_COLD, 1.03))
        stock_rows.append(h.compare("load_checkpoint(verify=True) ÷ safetensors load_file + torch.load, warm",
                                    size, times, V_WARM, STOCK_WARM, None))
        missed = [r for r in (warm_rows[-1], cold_rows[-1]) if r["ratio"] > r["goal"]]
        if (missed or stock_rows[-1]["ratio"] > 1.5) and size == s.sizes[-1] and not s.tiny:
            profiles.append(profiling.profile_call(f"one load_checkpoint(verify=True) of {h.fmt_size(size)}, warm",
                                                   load(True)))
        h.remove(d)
    about = ("A checkpoint written by `txckpt.save_checkpoint` (1/3 safetensors weights, 2/3 torch.save "
             "optimizer state), loaded with `txckpt.load_checkpoint(path, verify=...)`. Warm: the files are "
             "in the page cache (the worst case for the ratio: hashing is all the difference). Cold: every "
             "file's pages are dropped (`posix_fadvise(DONTNEED)`, untimed) before each load.")
    return {"tables": [
        {"id": "load-warm", "title": "Load with verification, warm cache", "rows": warm_rows, "about": about,
         "profiles": profiles},
        {"id": "load-cold", "title": "Load with verification, cold cache", "rows": cold_rows, "about": about},
        {"id": "load-stock", "title": "Load: txckpt vs the stock readers (report)", "rows": stock_rows,
         "about": "`load_checkpoint(verify=True)` against `safetensors.torch.load_file` + "
                  "`torch.load(weights_only=True)` of the same files, warm cache."},
        {"id": "load-device", "title": "Load, cold cache: txckpt vs the device's read limit (report)",
         "rows": limit_rows,
         "about": "The cold loads above against the device's read limit in the same rounds "
                  "(`benchmarks/devlimit.py`): every file of the checkpoint read in order into one "
                  "page-aligned buffer, with O_DIRECT reads of 16 or 64 MiB, and buffered with "
                  "`readinto` of 8 MiB chunks after the same untimed `posix_fadvise(DONTNEED)`; per "
                  "round the fastest of the three. The limit neither decodes nor hashes: what is "
                  "left is txckpt's (and torch's) own cost.",
         "notes": ["Read limits in this run (medians): " + "; ".join(limit_notes)] if limit_notes else []},
    ]}
