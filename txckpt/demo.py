"""The rollback story of the transformers bug report, told with txckpt on a local directory.

    python -m txckpt.demo [ROOT]

1. Save steps 2, 4 and 6.  2. Roll back: resume(step=2); the warning names 4 and 6.
3. A real child process crashes (SIGKILL) while saving step 4 of the new lineage.
4. Restart: get_last_checkpoint gives 2.  5. Save 4 and 6.  6. The old 4 and 6 are intact.
7. `txckpt log ROOT`: the lineage graph of what it wrote.

It needs torch only (``make demo`` installs nothing else).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile

import torch

import txckpt
from txckpt.cli import main as cli


def state(step: int, run: str) -> dict:
    g = torch.Generator().manual_seed(step * 100 + ord(run))
    return {
        "model.safetensors": {"weight": torch.randn(256, 256, generator=g)},
        "optimizer.pt": {"exp_avg": torch.randn(256, 256, generator=g), "run": run, "step": step},
        "trainer_state.json": {"global_step": step, "run": run},
    }


def found(path: str | None, what: str) -> str:
    """The demo's story needs each of these paths; a None is a broken story, said by name."""
    if path is None:
        raise AssertionError(f"the demo expected {what}, and txckpt found none")
    return path


def run_of(path: str) -> str:
    data = txckpt.load_checkpoint(path)  # verifies every file against the manifest
    runs = {data["optimizer.pt"]["run"], data["trainer_state.json"]["run"]}
    assert len(runs) == 1, f"mixed checkpoint: {runs}"
    return runs.pop()


def crash_while_saving(root: str, step: int) -> int:
    """Run B's process: resume at 2 and die (SIGKILL) after writing the weights of ``step``."""
    code = f"""
import os, signal, torch, txckpt
from txckpt.demo import state
txckpt.resume({root!r})
with txckpt.transaction({root!r}, {step}) as tx:
    files = state({step}, "B")
    tx.save("model.safetensors", files["model.safetensors"])
    os.kill(os.getpid(), signal.SIGKILL)  # the machine dies here
"""
    return subprocess.run([sys.executable, "-c", code]).returncode


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m txckpt.demo",
        description="The rollback story of the transformers bug report, told with txckpt: save, roll "
        "back, crash a real process mid-save, restart, and check that nothing was mixed "
        "or overwritten. Ends with `txckpt log ROOT`.",
    )
    p.add_argument(
        "root",
        nargs="?",
        default=None,
        help="a new (or empty) directory to write to; default: a fresh temporary directory",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # a real console or pipe; not a test's capture
        sys.stdout.reconfigure(line_buffering=True)
    logging.basicConfig(level=logging.WARNING, format="   [warning] %(message)s", stream=sys.stdout)
    root = args.root or os.path.join(tempfile.mkdtemp(prefix="txckpt-demo-"), "output")
    if os.path.exists(root) and (not os.path.isdir(root) or os.listdir(root)):
        print(
            f"txckpt demo: {root} exists and is not an empty directory; the demo tells its story on "
            "a fresh root: pass a new directory (or remove this one)",
            file=sys.stderr,
        )
        return 2
    where = root if os.path.isabs(root) else f"{root} ({os.path.abspath(root)})"  # each path once
    print(f"txckpt demo: a rollback in {where}\n")

    print("1. Run A saves steps 2, 4 and 6.")
    for step in (2, 4, 6):
        path = txckpt.save_checkpoint(root, step, state(step, "A"))
        print(f"   committed {path}")
    run_a = {c.step: c for c in txckpt.CheckpointRoot(root).checkpoints()}
    digests_a = {s: txckpt.read_manifest(found(c.path, f"run A's step {s}")).digest for s, c in run_a.items()}

    print("\n2. A loss spike: roll back to step 2 (run B). txckpt forks a new lineage and warns:")
    txckpt.forget_roots()
    print(f"   resume(step=2) -> {txckpt.resume(root, step=2)}")

    print("\n3. Run B crashes (SIGKILL) halfway through saving step 4.")
    rc = crash_while_saving(root, 4)
    print(f"   run B's process died with {'SIGKILL' if rc == -signal.SIGKILL else rc}")

    print("\n4. Restart with 'resume the latest' (resume_from_checkpoint=True):")
    txckpt.forget_roots()
    last = found(txckpt.get_last_checkpoint(root), "a last checkpoint after the crash")
    print(
        f"   get_last_checkpoint -> {last} (step {txckpt.read_manifest(last).step}, the fork point "
        f"written by run {run_of(last)}; run B continues from it, not from run A's step 6)"
    )
    assert last == os.path.join(root, txckpt.open_root(root).publication.naming.public(2)), (
        "the restart must continue run B from step 2"
    )
    txckpt.resume(root)

    print("\n5. Run B saves steps 4 and 6.")
    for step in (4, 6):
        path = txckpt.save_checkpoint(root, step, state(step, "B"))
        print(f"   committed {path} (run {run_of(path)})")

    print("\n6. Run A's checkpoints 4 and 6 are intact, under names of their own:")
    for c in txckpt.CheckpointRoot(root).checkpoints("all"):
        if c.state != "abandoned":
            continue
        path = found(c.path, f"a path for run A's step {c.step}")
        same = txckpt.read_manifest(path).digest == digests_a[c.step]
        print(f"   step {c.step}: run {run_of(path)}, verified, manifest unchanged: {same}\n      at {path}")
        assert same and run_of(path) == "A"
    print("\n   Every committed checkpoint (`txckpt ls`):")
    for c in txckpt.CheckpointRoot(root).checkpoints("all"):
        print(f"   step {c.step:>2}  lineage {c.lineage}  {c.state:<9}  {c.path}")
    last = found(txckpt.get_last_checkpoint(root), "a last checkpoint at the end")
    print(f"\n   get_last_checkpoint -> {last} (run {run_of(last)})")
    print("\nNothing was mixed, nothing was overwritten, and the rollback was announced.")
    print(f"\n7. The demo wrote to {os.path.abspath(root)}. Its lineage graph, `txckpt log {root}`:\n")
    return cli(["log", root])


if __name__ == "__main__":
    sys.exit(main())
