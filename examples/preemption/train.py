"""A tiny training run that survives preemption: the command that sbatch.sh and pod.yaml both run.

Each start resumes from the newest committed checkpoint under --root (none: from scratch), trains
to --steps, saves every --save-every steps and, on SIGTERM or SIGUSR1 (txckpt.preemption), saves
the step it is at and exits with 128 + the signal's number (143 for SIGTERM). Run it again, the
same way, and it continues from that step. docs/preemption.md, "Schedulers", explains the two
launchers; tests/test_preemption_examples.py runs both commands.

    python train.py --root checkpoints/run --steps 200 --save-every 50 --grace 100
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

import txckpt


def _wait_for_a_signal_here(step: int) -> None:
    """For the tests only (TXCKPT_EXAMPLE_PAUSE_AT=STEP): at STEP, say so and block until a
    signal arrives, so a test signals the run at an exact step without sleeping. The wakeup fd
    is written by the interpreter when the signal lands, even before this line blocks."""
    if os.environ.get("TXCKPT_EXAMPLE_PAUSE_AT") != str(step):
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    print(f"paused at step {step}", flush=True)
    os.read(r, 1)
    signal.set_wakeup_fd(previous)
    os.close(r)
    os.close(w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="the checkpoint root (a directory or an s3:// URL)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds after the signal to exit anyway; a little less than the scheduler's grace",
    )
    args = p.parse_args()

    txckpt.preemption.install(grace_s=args.grace)  # SIGTERM / SIGUSR1: save at the step's end, then exit
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    path = txckpt.resume(args.root)  # the newest committed checkpoint of this run's lineage, or None
    if path is not None:
        saved = txckpt.load_checkpoint(path)
        model.load_state_dict(saved["model.safetensors"])
        opt.load_state_dict(saved["optimizer.pt"])
        txckpt.set_rng_state(saved["rng.pt"])
        start = saved["loop.json"]["step"]
        print(f"resumed from step {start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 8)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _wait_for_a_signal_here(step)
        stop = txckpt.preemption.requested()  # every rank, every step (one all-reduce under torchrun)
        if stop or step % args.save_every == 0 or step == args.steps:
            txckpt.save_checkpoint(
                args.root,
                step,
                {
                    "model.safetensors": model.state_dict(),
                    "optimizer.pt": opt.state_dict(),
                    "rng.pt": txckpt.rng_state(),
                    "loop.json": {"step": step, "loss": loss.item()},
                },
            )
        if stop:
            print(f"preempted at step {step}: saved, exiting with {txckpt.preemption.exit_status()}", flush=True)
            txckpt.preemption.exit()
    print(f"finished at step {args.steps}", flush=True)


if __name__ == "__main__":
    main()
