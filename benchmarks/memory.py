"""Peak memory of a save: peak RSS above the process baseline, divided by the state's size.

Each measurement runs in its own subprocess: import everything, note VmRSS (the baseline),
create the state, reset the peak (``/proc/self/clear_refs`` = 5, so the peak starts at the
current RSS), save, read VmHWM. A streaming save peaks at about 1.0x (the state itself); a save
that serialises into memory first peaks near 2x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from . import harness as h

TITLE = "Memory"

METHODS = ["txckpt", "stock", "dcp"]


def child(size: int, method: str, directory: str) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from txckpt import CheckpointRoot

    from .state import files_of, make_state, state_bytes

    root = CheckpointRoot(os.path.join(directory, "tx"), durable=True)
    root.new_lineage()
    base = h.proc_status("VmRSS")
    weights, optim = make_state(size)
    nbytes = state_bytes(weights, optim)
    with_state = h.proc_status("VmRSS")
    reset = True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        reset = False
    before_peak = h.proc_status("VmHWM")
    if method == "txckpt":
        root.save(1, files_of(weights, optim))
    elif method == "stock":
        os.makedirs(os.path.join(directory, "stock"))
        save_file(weights, os.path.join(directory, "stock", "model.safetensors"))
        torch.save(optim, os.path.join(directory, "stock", "optimizer.pt"))
    elif method == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                {"model": weights, "optim": optim}, storage_writer=dcp.FileSystemWriter(os.path.join(directory, "dcp"))
            )
    else:
        raise ValueError(method)
    peak = h.proc_status("VmHWM")
    return {
        "base": base,
        "with_state": with_state,
        "peak": peak,
        "state": nbytes,
        "peak_reset": reset,
        "peak_before_save": before_peak,
    }


def measure(size: int, method: str) -> dict[str, Any]:
    d = h.fresh_dir("mem")
    try:
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory", str(size), method, d],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
            cwd=here,
        )
        if out.returncode != 0:
            raise RuntimeError(f"memory child {method} {size} failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        h.remove(d)


def run(quick: bool) -> dict[str, Any]:
    s = h.settings()
    rows = []
    for size in s.sizes:
        h.log(f"memory: {h.fmt_size(size)}")
        res = {m: measure(size, m) for m in METHODS}

        def over_base(r):  # peak above the interpreter's baseline, in units of the state
            return (r["peak"] - r["base"]) / r["state"]

        def extra(r):  # peak above the RSS that already holds the state
            return (r["peak"] - r["with_state"]) / r["state"]

        tx = res["txckpt"]
        note = "" if tx["peak_reset"] else "peak could not be reset; it includes creating the state"
        rows.append(
            {
                "size": size,
                "ratio": over_base(tx),
                "goal": 1.10,
                "reps": 1,
                "tx_extra": extra(tx),
                "stock": over_base(res["stock"]),
                "stock_extra": extra(res["stock"]),
                "dcp": over_base(res["dcp"]),
                "dcp_extra": extra(res["dcp"]),
                "tx_extra_mib": (tx["peak"] - tx["with_state"]) / h.MiB,
                "note": note,
            }
        )
    return {
        "id": "memory",
        "title": "Memory: peak RSS of a save ÷ state size",
        "rows": rows,
        "columns": [
            ["size", "size"],
            ["ratio", "txckpt peak − baseline, ÷ state"],
            ["tx_extra", "txckpt peak above state, ÷ state"],
            ["tx_extra_mib", "txckpt above state (MiB)"],
            ["stock", "save_file + torch.save, ÷ state"],
            ["dcp", "DCP, ÷ state"],
            ["goal", "goal"],
            ["verdict", "met?"],
        ],
        "about": __doc__.strip().split("\n\n", 1)[1].replace("\n", " ")
        + " Baseline: VmRSS after importing torch/txckpt and creating the root, before the state exists; "
        "1.0 is the state itself, so the goal ≤ 1.1 allows 10% of the state's size as buffers.",
    }


if __name__ == "__main__":
    print(json.dumps(child(int(sys.argv[1]), sys.argv[2], sys.argv[3])))
