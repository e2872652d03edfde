"""A training loop under txckpt.preemption, run as a real process by tests/test_preemption_procs.py
(issue 32). It saves every ``--every`` steps with txckpt.async_save, polls requested() at each
step boundary, and at a preemption saves that step (unless ``--no-final-save``) and calls
txckpt.preemption.exit(). Handshakes are files in ``--hs`` (never sleeps):

- ``step-rank{r}``: the last step this rank finished (replaced atomically each step);
- ``final-rank{r}``: written just before the final async_save (its step inside);
- ``inside-{step}-rank{r}``: the background save of ``step`` has begun (CheckpointRoot.save);
- ``blocked-rank{r}``: the save of ``--block-step`` waits for ``release`` to appear;
- ``result-rank{r}.json``: written when requested() returned True, before exit().

For the preemption campaign (tests/test_preemption_campaign.py):

- ``--sync`` saves with txckpt.save_checkpoint (in the loop's thread) instead of async_save;
- ``--hold-step N``: inside step N (after its update, before requested()) the loop writes
  ``instep-rank{r}`` and waits for ``release``: a signal sent then arrives *during a step*;
- ``signalled-rank{r}``: written while the loop waits for ``release`` (a held step or save) once
  this process has handled a signal: Python runs the handler in the main thread at its next
  bytecode, which may come after the release if another thread took the signal, so the parent
  waits for this file before it releases a held step or sync save;
- ``done-{step}-rank{r}``: the save of ``step`` returned (sync) or its future finished (async):
  ``ok <path>`` or ``error <what>``; a step reported ``ok`` must stay committed whatever follows;
- ``--resume``: txckpt.resume(root) first (every rank), check the loaded state is that step's,
  go on from it; ``resumed-rank{r}.json`` says from which step (0: nothing committed);
- ``--finish-at N``: at step N (no signal) save N, wait for the saves and exit 0;
- ``--storage-options JSON``: the root's (an S3 root on moto).

With ``--world 2`` it is one rank of a gloo group rendezvousing on ``--store`` (a FileStore).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import time

import torch

import txckpt
from tests.harness.handshake import put
from txckpt import preemption


def _wait_for(path: str, deadline_s: float = 120.0, ack: str | None = None) -> None:
    """Poll for ``path`` with a deadline; with ``ack``, write that file once this process has
    handled a signal (the parent knows then that the signal came while the loop waited here)."""
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if ack is not None and preemption.received() and not os.path.exists(ack):
            put(ack, str(preemption.received()))
        if time.monotonic() > end:
            raise TimeoutError(path)
        time.sleep(0.01)  # polling a file with a deadline: the parent's release


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--hs", required=True)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--grace", type=float, default=None)
    p.add_argument("--block-step", type=int, default=None)
    p.add_argument("--no-final-save", action="store_true")
    p.add_argument(
        "--last-periodic",
        type=int,
        default=None,
        help="no periodic save after this step (so a held save never blocks the loop)",
    )
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store", default=None)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--hold-step", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--finish-at", type=int, default=None)
    p.add_argument("--storage-options", default=None)
    a = p.parse_args()
    so = json.loads(a.storage_options) if a.storage_options else None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    r = a.rank
    if a.world > 1:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{a.store}", rank=r, world_size=a.world, timeout=datetime.timedelta(seconds=60)
        )

    real_save = txckpt.CheckpointRoot.save

    def save(root, step, *args, **kwargs):  # the background's save: mark it, hold it if asked
        put(os.path.join(a.hs, f"inside-{step}-rank{r}"), str(step))
        if step == a.block_step:
            put(os.path.join(a.hs, f"blocked-rank{r}"), str(step))
            _wait_for(os.path.join(a.hs, "release"), ack=os.path.join(a.hs, f"signalled-rank{r}"))
        return real_save(root, step, *args, **kwargs)

    txckpt.CheckpointRoot.save = save  # type: ignore[method-assign]

    def saved(step: int, outcome: str) -> None:
        put(os.path.join(a.hs, f"done-{step}-rank{r}"), outcome)

    def on_done(step: int):
        def report(f) -> None:  # the base class's: the outcome stays unretrieved for exit() to report
            e = concurrent.futures.Future.exception(f)
            path = None if e is not None else concurrent.futures.Future.result(f)
            saved(step, f"error {type(e).__name__}: {e}" if e is not None else f"ok {path}")

        return report

    def save_step(step: int, w: torch.Tensor) -> None:
        files = {f"rank{r}.pt": {"w": w, "step": step}}
        if a.sync:
            saved(step, "ok " + txckpt.save_checkpoint(a.root, step, files, storage_options=so))
        else:
            txckpt.async_save(a.root, step, files, storage_options=so).add_done_callback(on_done(step))

    preemption.install(grace_s=a.grace)
    w, start = torch.zeros(8), 0
    if a.resume:
        path = txckpt.resume(a.root, storage_options=so)
        if path is not None:
            start = txckpt.read_manifest(path, storage_options=so).step
            state = txckpt.load_checkpoint(path, files=[f"rank{r}.pt"], storage_options=so)[f"rank{r}.pt"]
            if state["step"] != start or not state["w"].eq(start).all():
                raise SystemExit(f"resumed {path} (step {start}) holds the state of step {state['step']}")
            w = state["w"].clone()
        put(os.path.join(a.hs, f"resumed-rank{r}.json"), json.dumps({"from": start, "path": path}))
    for step in range(start + 1, a.max_steps + 1):
        w += 1  # the "training step": w == step
        if step == a.hold_step:
            put(os.path.join(a.hs, f"instep-rank{r}"), str(step))
            _wait_for(os.path.join(a.hs, "release"), ack=os.path.join(a.hs, f"signalled-rank{r}"))
        stop = preemption.requested()
        if stop and not a.no_final_save:
            put(os.path.join(a.hs, f"final-rank{r}"), str(step))
        periodic = step % a.every == 0 and (a.last_periodic is None or step <= a.last_periodic)
        if (stop and not a.no_final_save) or periodic or step == a.finish_at:
            save_step(step, w)
        put(os.path.join(a.hs, f"step-rank{r}"), str(step))
        if step == a.finish_at and not stop:
            txckpt.wait_for_saves()
            put(os.path.join(a.hs, f"result-rank{r}.json"), json.dumps({"stopped_at": step, "finished": True}))
            preemption.uninstall()
            return
        if stop:
            put(
                os.path.join(a.hs, f"result-rank{r}.json"),
                json.dumps({"stopped_at": step, "received": preemption.received(), "status": preemption.exit_status()}),
            )
            preemption.exit()
    raise SystemExit("the loop ran out of steps: no signal came")


if __name__ == "__main__":
    main()
