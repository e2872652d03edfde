"""Module-to-module hops of one warm save or verified load: how many rooms an operation passes through.

    python -m benchmarks.hops load          # a verified txckpt.load_checkpoint on a local root
    python -m benchmarks.hops save          # a synchronous txckpt.save_checkpoint on a local root
    python -m benchmarks.hops incremental   # an incremental save of an unchanged state (all shared)
    python -m benchmarks.hops load --edges  # and the table of edges (caller -> callee: count)

A **hop** is one Python call executed, in the calling thread, from a frame of one txckpt module
into a frame of another txckpt module (``frame.f_globals["__name__"]``, ``txckpt`` or
``txckpt.*``; the storage backends ``txckpt._storage.*`` count like any other module and are also
reported apart). The caller is the nearest txckpt frame below the callee on the stack, so a call
that goes through the standard library or torch (a callback, a ``sorted`` key, a ``with``
block's ``__exit__``) still counts as the edge between the two txckpt modules; a call within one
module is no hop. A generator resumed counts as a call, as ``sys.setprofile`` reports it. Only
the operation is traced (not the setup), after one identical operation to warm the process's
caches (the root cache, the log's state), the way a training loop saves and loads.

**Storage opens**: the ``Storage`` objects constructed during the operation (calls of
``txckpt._storage.base.Storage.__init__``, whatever built them; ``open_storage`` is the factory,
its calls are reported too).

The state saved and loaded is small (a 16-float safetensors file and a JSON file), so the
counts are the code's structure, not its data. docs/architecture.md records the counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

FILES_NAMES = ("model.safetensors", "trainer_state.json")


@dataclass
class Trace:
    """What one traced operation did."""

    hops: int = 0
    edges: collections.Counter = field(default_factory=collections.Counter)
    storage_opens: int = 0  # Storage objects constructed
    open_storage_calls: int = 0  # calls of the factory txckpt._storage.open_storage
    into_storage: int = 0  # hops whose callee is a txckpt._storage.* module

    def summary(self, what: str) -> str:
        return (
            f"{what}: {self.hops} hops, {self.into_storage} of them into txckpt._storage.*; "
            f"storage opened {self.storage_opens} times ({self.open_storage_calls} open_storage calls)"
        )


def _txckpt_module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "txckpt" or name.startswith("txckpt.") else None


def trace(operation: Callable[[], Any]) -> Trace:
    """Run ``operation()`` once under ``sys.setprofile`` and count its hops (module docstring)."""
    from txckpt import _storage as storage_pkg
    from txckpt._storage.base import Storage

    init_code = Storage.__init__.__code__
    factory_code = storage_pkg.open_storage.__code__
    me = threading.get_ident()
    out = Trace()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or threading.get_ident() != me:
            return
        code = frame.f_code
        if code is init_code:
            out.storage_opens += 1
        elif code is factory_code:
            out.open_storage_calls += 1
        callee = _txckpt_module(frame)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None:
            caller = _txckpt_module(caller_frame)
            if caller is not None:
                break
            caller_frame = caller_frame.f_back
        else:
            return  # the operation's entry from the outside: no hop
        if caller != callee:
            out.hops += 1
            out.edges[(caller, callee)] += 1
            if callee.startswith("txckpt._storage"):
                out.into_storage += 1

    sys.setprofile(profile)
    try:
        operation()
    finally:
        sys.setprofile(None)
    return out


def _state(step: int) -> dict[str, Any]:
    from txckpt._base import deps

    return {
        FILES_NAMES[0]: {"weight": deps.torch.arange(16, dtype=deps.torch.float32) + step},
        FILES_NAMES[1]: {"global_step": step},
    }


def trace_save(root: str) -> Trace:
    """A warm ``txckpt.save_checkpoint`` of a small state on the local ``root``."""
    import txckpt

    txckpt.save_checkpoint(root, 1, _state(1))  # warm-up: the root cache, the first entry
    files = _state(2)
    return trace(lambda: txckpt.save_checkpoint(root, 2, files))


def trace_load(root: str) -> Trace:
    """A warm verified ``txckpt.load_checkpoint`` of the newest checkpoint of the local ``root``."""
    import txckpt

    txckpt.save_checkpoint(root, 1, _state(1))
    path = txckpt.save_checkpoint(root, 2, _state(2))
    txckpt.load_checkpoint(path)  # warm-up
    return trace(lambda: txckpt.load_checkpoint(path))


def trace_incremental(root: str) -> Trace:
    """A warm incremental ``txckpt.save_checkpoint`` of an unchanged state: every file shared."""
    import txckpt

    files = _state(1)
    txckpt.save_checkpoint(root, 1, files, incremental=True)
    txckpt.save_checkpoint(root, 2, files, incremental=True)  # warm-up: the sources are checked
    return trace(lambda: txckpt.save_checkpoint(root, 3, files, incremental=True))


MODES = {"save": trace_save, "load": trace_load, "incremental": trace_incremental}


def measure(mode: str) -> Trace:
    """Trace ``mode`` on a fresh root in a scratch directory (this process's root cache is
    forgotten first and after, so the count does not depend on what ran before)."""
    import txckpt

    txckpt.forget_roots()
    try:
        with tempfile.TemporaryDirectory(prefix="txckpt-hops-") as scratch:
            return MODES[mode](os.path.join(scratch, "out"))
    finally:
        txckpt.forget_roots()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hops", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=sorted(MODES) + ["both"])
    p.add_argument("--edges", action="store_true", help="print each edge (caller -> callee) with its count")
    args = p.parse_args(argv)
    for mode in ["save", "load", "incremental"] if args.mode == "both" else [args.mode]:
        t = measure(mode)
        print(t.summary(mode))
        if args.edges:
            for (a, b), n in sorted(t.edges.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"  {n:4d}  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
