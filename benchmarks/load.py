"""load_checkpoint with verification against the same load without it, warm and cold cache, and
against the stock readers; where a verified load's time goes; and its peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from . import devlimit as dl
from . import harness as h
from . import profiling
from .state import evict, files_of, make_state

TITLE = "Load"

V_WARM, N_WARM, STOCK_WARM = "verify, warm", "no verify, warm", "stock, warm"
V_COLD, N_COLD = "verify, cold", "no verify, cold"
M_WARM, M_COLD = "verify, mmap, warm", "verify, mmap, cold"
READ_LIMIT = "device read limit"
#: The unverified load once more in the same rounds: verify=False ÷ verify=False, the A/A control.
#: Its spread around 1.0 is what this machine can resolve; a V/N ratio inside it says nothing.
N_WARM_AA, N_COLD_AA = "no verify again, warm", "no verify again, cold"

#: Kernel counters that explain a slow round: direct compaction and reclaim stalls (a fresh
#: buffer on transparent huge pages faults in 2 MiB pages; with THP defrag "madvise" a fault
#: that finds no free huge page compacts memory synchronously), and huge-page faults that fell
#: back to small pages.
_VMSTAT = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback", "allocstall_normal", "allocstall_movable")


def _vmstat() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k in _VMSTAT:
                    out[k] = int(v)
    except OSError:
        pass
    return out


def _steal_ticks() -> int:
    """Clock ticks (USER_HZ) the hypervisor ran something else while this guest's vCPUs had
    work (``steal`` in /proc/stat); 0 where there is no such counter."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if len(fields) > 8 else 0
    except (OSError, ValueError):
        return 0


def _counted(fn, into: dict[str, list[dict[str, int]]], name: str):
    """``fn`` that records the kernel counters' change over each call under ``name``, with its
    CPU time and the hypervisor's steal ticks."""

    def run(ctx):
        before, cpu, steal = _vmstat(), time.process_time(), _steal_ticks()
        try:
            return fn(ctx)
        finally:
            cpu = time.process_time() - cpu
            steal = _steal_ticks() - steal
            after = _vmstat()
            into.setdefault(name, []).append(
                {**{k: after[k] - before.get(k, 0) for k in after}, "cpu_us": int(cpu * 1e6), "steal": steal}
            )

    return run


def _stalls(rounds: list[dict[str, int]], warmup: int) -> str:
    """Compaction and direct-reclaim stalls per timed round (the warm-up rounds dropped)."""
    per = [
        r.get("compact_stall", 0) + r.get("allocstall_normal", 0) + r.get("allocstall_movable", 0)
        for r in rounds[warmup:]
    ]
    return "/".join(str(x) for x in per)


def _steal(rounds: list[dict[str, int]], warmup: int) -> str:
    """Steal ticks per timed round: a round whose fresh pages the host had to find shows here."""
    return "/".join(str(r.get("steal", 0)) for r in rounds[warmup:])


def _cpu(rounds: list[dict[str, int]], warmup: int) -> float:
    """Median CPU seconds (every thread of the process, user + system) of the timed rounds."""
    import statistics

    return statistics.median(r["cpu_us"] for r in rounds[warmup:]) / 1e6


def trace_load(path: str) -> str:
    """One verified warm load with every file's steps timed in the thread that ran them: the
    read (hashing on the way), the decode that overlaps the rest of the hash, the wait for the
    digest, and the kernel's stall counters. cProfile sees only the calling thread, which waits
    on the readers' lock the whole time; this shows what the readers do."""
    import txckpt
    from txckpt import _api as api
    from txckpt._base import fileio
    from txckpt._manifest import verify

    events: list[tuple[float, float, str, str, str]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def timed(label, fn, name_of):
        def wrapper(*a, **kw):
            s = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                e = time.perf_counter()
                with lock:
                    events.append((s - t0, e - t0, threading.current_thread().name, label, name_of(a)))

        return wrapper

    real = (fileio.start_read_into_buffer, api.read_object, verify.Deferred.check)
    fileio.start_read_into_buffer = timed("read (+ hash on the way)", real[0], lambda a: os.path.basename(a[0]))
    api.read_object = timed("decode", real[1], lambda a: a[0])
    setattr(verify.Deferred, "check", timed("wait for the hash, compare", real[2], lambda a: ""))
    before = _vmstat()
    try:
        s = time.perf_counter()
        txckpt.load_checkpoint(path, verify=True)
        wall = time.perf_counter() - s
    finally:
        fileio.start_read_into_buffer, api.read_object = real[0], real[1]
        setattr(verify.Deferred, "check", real[2])
    after = _vmstat()
    counters = ", ".join(f"{k} {after[k] - before.get(k, 0)}" for k in after)
    lines = [
        f"Where the time goes: one load_checkpoint(verify=True) of {path.rsplit('/', 2)[-2]}, warm — "
        f"{wall:.3f} s wall; kernel counters over it: {counters}",
        "",
        "| thread | step | file | start s | end s | seconds |",
        "|---|---|---|---:|---:|---:|",
    ]
    last_file = {}
    for s_, e_, thread, label, name in sorted(events):
        name = name or last_file.get(thread, "")
        last_file[thread] = name or last_file.get(thread, "")
        lines.append(f"| {thread} | {label} | `{name}` | {s_:.3f} | {e_:.3f} | {e_ - s_:.3f} |")
    return "\n".join(lines)


def memory_child(path: str, verify: bool) -> dict[str, Any]:
    """Peak RSS of one load in a fresh process: baseline after the imports, the peak reset
    (``/proc/self/clear_refs`` = 5), the load, VmHWM while its result is still held."""
    __import__("torch")  # before the baseline, as a training script has it

    import txckpt
    from txckpt._base.layout import MANIFEST_NAME
    from txckpt._manifest.manifest import Manifest

    nbytes = Manifest.decode(open(os.path.join(path, MANIFEST_NAME), "rb").read()).total_bytes
    base = h.proc_status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    out = txckpt.load_checkpoint(path, verify=verify)
    peak = h.proc_status("VmHWM")
    del out
    return {"base": base, "peak": peak, "bytes": nbytes, "peak_reset": reset}


def _memory(path: str, verify: bool) -> dict[str, Any]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.load", path, "1" if verify else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=here,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load memory child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    import txckpt
    from txckpt import CheckpointRoot

    s = h.settings()
    warm_rows, cold_rows, stock_rows, limit_rows, mem_rows = [], [], [], [], []
    limit_notes: list[str] = []
    profiles: list[str] = []
    for size in s.sizes:
        h.log(f"load: {h.fmt_size(size)}, {s.reps[size]} rounds")
        d = h.fresh_dir("load")
        weights, optim = make_state(size)
        path = CheckpointRoot(d, durable=True).save(1, files_of(weights, optim))
        del weights, optim

        def load(verify: bool, mmap: bool = False):
            return lambda _ctx: txckpt.load_checkpoint(path, verify=verify, mmap=mmap)

        def stock(_ctx):
            load_file(os.path.join(path, "model.safetensors"))
            torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)

        def cold():
            evict(path)

        counters: dict[str, list[dict[str, int]]] = {}
        warm = [
            h.Method(V_WARM, _counted(load(True), counters, V_WARM), settle=False),
            h.Method(N_WARM, _counted(load(False), counters, N_WARM), settle=False),
            h.Method(STOCK_WARM, _counted(stock, counters, STOCK_WARM), settle=False),
            h.Method(M_WARM, _counted(load(True, True), counters, M_WARM), settle=False),
            h.Method(N_WARM_AA, _counted(load(False), counters, N_WARM_AA), settle=False),
        ]
        colds = [
            h.Method(V_COLD, _counted(load(True), counters, V_COLD), cold, settle=False),
            h.Method(N_COLD, _counted(load(False), counters, N_COLD), cold, settle=False),
            h.Method(M_COLD, _counted(load(True, True), counters, M_COLD), cold, settle=False),
            h.Method(N_COLD_AA, _counted(load(False), counters, N_COLD_AA), cold, settle=False),
        ]
        # The device's read limit: every variant in the same cold rounds (each cheap next to a
        # save); per round the fastest of them.
        readers, read_buf = dl.read_variants(path)
        colds += [h.Method(name, lambda _ctx, fn=fn: fn(), cold, settle=False) for name, fn in readers.items()]
        # Loads are cheap next to saves: twice the rounds (the warm/cold pairs are noisy; at
        # 4 GiB one round in a few draws pages the host must find, on either side).
        reps = 2 if s.tiny else 2 * s.reps[size] - 1
        times = h.interleave(warm, reps, warmup=1)
        times.update(h.interleave(colds, reps, warmup=0))
        times[READ_LIMIT] = dl.elementwise_min(*(times[name] for name in readers))
        nbytes = sum(os.path.getsize(os.path.join(dp, n)) for dp, _d, ns in os.walk(path) for n in ns)
        limit_notes.append(
            f"{h.fmt_size(size)} ({nbytes:,} bytes of files): "
            + dl.sweep_note({name: h.median(times[name]) for name in readers}, nbytes)
        )
        for name, verify in ((V_COLD, "True"), (N_COLD, "False"), (M_COLD, "True, mmap=True")):
            limit_rows.append(
                h.compare(
                    f"load_checkpoint(verify={verify}), cold ÷ the device's read limit",
                    size,
                    times,
                    name,
                    READ_LIMIT,
                    None,
                )
            )
        read_buf.close()

        cold_names = {m.name for m in colds}

        def note(a: str, b: str) -> str:
            # CPU time is what the hash adds whether or not a core was free for it: on a busy
            # machine the wall-clock ratio approaches the CPU ratio, on a quiet one it hides.
            w = 0 if a in cold_names else 1  # the cold rounds have no warm-up round
            ca, cb = _cpu(counters[a], w), _cpu(counters[b], w)
            return (
                f"CPU (all threads, median): {a} {ca:.3f} s, {b} {cb:.3f} s, ratio {ca / cb:.2f}; "
                f"memory-compaction/reclaim stalls per round: {a} {_stalls(counters[a], w)}, "
                f"{b} {_stalls(counters[b], w)}; hypervisor steal ticks per round: "
                f"{a} {_steal(counters[a], w)}, {b} {_steal(counters[b], w)}"
            )

        v_warm = h.compare(
            "load_checkpoint(verify=True) ÷ (verify=False), warm cache",
            size,
            times,
            V_WARM,
            N_WARM,
            1.05,
            note=note(V_WARM, N_WARM),
        )
        v_cold = h.compare(
            "load_checkpoint(verify=True) ÷ (verify=False), cold cache",
            size,
            times,
            V_COLD,
            N_COLD,
            1.05,
            note=note(V_COLD, N_COLD),
        )
        v_stock = h.compare(
            "load_checkpoint(verify=True) ÷ safetensors load_file + torch.load, warm",
            size,
            times,
            V_WARM,
            STOCK_WARM,
            1.10,
            note=note(V_WARM, STOCK_WARM),
        )
        warm_rows.append(v_warm)
        cold_rows.append(v_cold)
        warm_rows.append(
            h.compare(
                "A/A control: load_checkpoint(verify=False) ÷ the same call, warm (report)",
                size,
                times,
                N_WARM_AA,
                N_WARM,
                None,
                note=note(N_WARM_AA, N_WARM),
            )
        )
        cold_rows.append(
            h.compare(
                "A/A control: load_checkpoint(verify=False) ÷ the same call, cold (report)",
                size,
                times,
                N_COLD_AA,
                N_COLD,
                None,
                note=note(N_COLD_AA, N_COLD),
            )
        )
        warm_rows.append(
            h.compare(
                "load_checkpoint(verify=True, mmap=True) ÷ (verify=False), warm (report)",
                size,
                times,
                M_WARM,
                N_WARM,
                None,
                note=note(M_WARM, N_WARM),
            )
        )
        cold_rows.append(
            h.compare(
                "load_checkpoint(verify=True, mmap=True) ÷ (verify=False), cold (report)",
                size,
                times,
                M_COLD,
                N_COLD,
                None,
                note=note(M_COLD, N_COLD),
            )
        )
        stock_rows.append(v_stock)
        stock_rows.append(
            h.compare(
                "load_checkpoint(verify=True, mmap=True) ÷ safetensors load_file + torch.load, warm",
                size,
                times,
                M_WARM,
                STOCK_WARM,
                1.10,
                note=note(M_WARM, STOCK_WARM),
            )
        )
        if size == s.sizes[-1] and not s.tiny:
            profiles.append(trace_load(path))
            missed = [r for r in (v_warm, v_cold, v_stock) if r["ratio"] > r["goal"]]
            if missed:
                profiles.append(
                    profiling.profile_call(f"one load_checkpoint(verify=True) of {h.fmt_size(size)}, warm", load(True))
                )
        if size >= h.GiB or size == s.sizes[-1]:
            v, n = _memory(path, True), _memory(path, False)
            mem_rows.append(
                {
                    "size": size,
                    "ratio": (v["peak"] - v["base"]) / v["bytes"],
                    "goal": 1.10,
                    "reps": 1,
                    "unverified": (n["peak"] - n["base"]) / n["bytes"],
                    "v_over_n": (v["peak"] - v["base"]) / max(1, n["peak"] - n["base"]),
                    "extra_mib": (v["peak"] - v["base"] - v["bytes"]) / h.MiB,
                    "note": "" if v["peak_reset"] else "peak could not be reset: it includes the imports",
                }
            )
        h.remove(d)
    about = (
        "A checkpoint written by `txckpt.save_checkpoint` (1/3 safetensors weights, 2/3 torch.save "
        "optimizer state), loaded with `txckpt.load_checkpoint(path, verify=...)`. Warm: the files are "
        "in the page cache (the worst case for the ratio: hashing is all the difference). Cold: every "
        "file's pages are dropped (`posix_fadvise(DONTNEED)`, untimed) before each load. The note "
        "gives, per timed round, the kernel's memory-compaction and direct-reclaim stalls during each "
        "side (`/proc/vmstat`): a fresh buffer on transparent huge pages that finds no free huge page "
        "compacts memory synchronously (the multi-second outliers of an earlier run); and the "
        "hypervisor's steal ticks (`/proc/stat`): on this KVM guest a fresh page the host has "
        "taken back (free page reporting) is found again by the host, and a load that draws many "
        "such pages is slower whichever side of the comparison it is."
    )
    return {
        "tables": [
            {
                "id": "load-warm",
                "title": "Load with verification, warm cache",
                "rows": warm_rows,
                "about": about,
                "profiles": profiles,
            },
            {"id": "load-cold", "title": "Load with verification, cold cache", "rows": cold_rows, "about": about},
            {
                "id": "load-stock",
                "title": "Load: txckpt vs the stock readers",
                "rows": stock_rows,
                "about": "`load_checkpoint(verify=True)` against `safetensors.torch.load_file` + "
                "`torch.load(weights_only=True)` of the same files, warm cache (the stock readers verify "
                "nothing). `load_file` maps the file (safetensors' default `mmap` backend): it returns "
                "before a byte of tensor data is read, and its tensors are the page cache's pages. "
                "`load_checkpoint(mmap=True)` does the same with txckpt's check: each file mapped "
                "copy-on-write and every page hashed before anything is returned; the default "
                "(`mmap=False`) reads each file into memory of the process's own.",
            },
            {
                "id": "load-memory",
                "title": "Memory: peak RSS of a verified load ÷ checkpoint size",
                "rows": mem_rows,
                "columns": [
                    ["size", "size"],
                    ["ratio", "verify=True: peak − baseline, ÷ checkpoint bytes"],
                    ["unverified", "verify=False, ÷ checkpoint bytes"],
                    ["v_over_n", "verified ÷ unverified peak"],
                    ["extra_mib", "verified above one copy (MiB)"],
                    ["goal", "goal"],
                    ["verdict", "met?"],
                    ["note", "note"],
                ],
                "about": "Each load runs in a fresh subprocess: import torch and txckpt, note VmRSS (the baseline), "
                "reset the peak (`/proc/self/clear_refs` = 5), load, read VmHWM while the result is held. "
                "1.0 is one copy of the checkpoint (the loaded tensors are views of the buffer each file is "
                "read into, so that copy is the result itself); the goal ≤ 1.10 allows no second copy.",
            },
            {
                "id": "load-device",
                "title": "Load, cold cache: txckpt vs the device's read limit (report)",
                "rows": limit_rows,
                "about": "The cold loads above against the device's read limit in the same rounds "
                "(`benchmarks/devlimit.py`): every file of the checkpoint read in order into one "
                "page-aligned buffer, with O_DIRECT reads of 16 or 64 MiB, and buffered with "
                "`readinto` of 8 MiB chunks after the same untimed `posix_fadvise(DONTNEED)`; per "
                "round the fastest of the three. The limit neither decodes nor hashes: what is "
                "left is txckpt's (and torch's) own cost.",
                "notes": ["Read limits in this run (medians): " + "; ".join(limit_notes)] if limit_notes else [],
            },
        ]
    }


if __name__ == "__main__":
    print(json.dumps(memory_child(sys.argv[1], sys.argv[2] == "1")))
