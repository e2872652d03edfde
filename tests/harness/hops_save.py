"""Module-to-module hops of one warm synchronous save (issue 28): a private measuring helper.

A *hop* is an executed call event whose callee frame's module is a txckpt module different from
the caller frame's txckpt module, counted over one ``txckpt.save_checkpoint`` (a small state dict,
a local temporary root) after one warm-up save of the same root. Calls into or out of code that is
not txckpt's (torch, the standard library) are not hops; a txckpt -> stdlib -> txckpt chain counts
as no hop either (the caller frame of the inner call is the stdlib's).

``python -m tests.harness.hops_save`` prints the hops, the modules visited and the busiest edges.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
from typing import Any


def _module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "txckpt" or name.startswith("txckpt.") else None


def trace_save(root: str | None = None) -> tuple[int, set[str], collections.Counter]:
    """(hops, modules visited, Counter of (caller module, callee module)) of one warm save."""
    import torch

    import txckpt

    os.environ.setdefault("TXCKPT_DURABLE", "1")
    state = {"w": torch.zeros(4, 4), "b": torch.ones(4)}
    with tempfile.TemporaryDirectory() as tmp:
        where = root or os.path.join(tmp, "root")
        txckpt.save_checkpoint(where, 1, {"model.safetensors": state})  # warm-up
        edges: collections.Counter = collections.Counter()
        visited: set[str] = set()

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event != "call":
                return
            callee = _module(frame)
            if callee is None:
                return
            visited.add(callee)
            back = frame.f_back
            caller = _module(back) if back is not None else None
            if caller is not None and caller != callee:
                edges[(caller, callee)] += 1

        sys.setprofile(profile)
        try:
            txckpt.save_checkpoint(where, 2, {"model.safetensors": state})
        finally:
            sys.setprofile(None)
    return sum(edges.values()), visited, edges


def main() -> None:
    hops, visited, edges = trace_save()
    print(f"hops {hops}, modules {len(visited)}")
    for (a, b), n in edges.most_common():
        print(f"{n:4d}  {a} -> {b}")
    print("modules:", ", ".join(sorted(visited)))


if __name__ == "__main__":
    main()
