"""One run of a job on one node of a tiered root, in a process of its own (tests/test_tiered_requeue.py):
``python -m tests.children.tiered_node FAST DURABLE STEPS [ROLLBACK_STEP]``. It resumes (or rolls
back to ROLLBACK_STEP), loads what it resumed, saves each step of STEPS (comma-separated) that is
newer than it, waits until they are durable, and prints one JSON line: the step it resumed, the
steps it saved, and a refused save's error class (it first tries to save the step it resumed again,
as a script retraining from a stale step would)."""

import json
import sys

import torch

import txckpt


def main() -> None:
    fast, durable, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    rollback = int(sys.argv[4]) if len(sys.argv) > 4 else None
    root = txckpt.TieredRoot(fast, durable)
    start = txckpt.resume(root, step=rollback) if rollback is not None else txckpt.resume(root)
    resumed = txckpt.load_checkpoint(start)["state.json"]["step"] if start else 0
    refused = None
    if resumed:
        try:
            txckpt.save_checkpoint(root, resumed, {"state.json": {"step": resumed}})
        except txckpt.errors.TxckptError as e:
            refused = type(e).__name__
    saved = []
    for step in steps:
        if step > resumed:
            txckpt.save_checkpoint(
                root, step, {"state.json": {"step": step}, "w.safetensors": {"w": torch.full((64,), float(step))}}
            )
            saved.append(step)
    root.wait_durable()
    print(json.dumps({"resumed": resumed, "saved": saved, "refused": refused, "pending": len(root.pending())}))


if __name__ == "__main__":
    main()
