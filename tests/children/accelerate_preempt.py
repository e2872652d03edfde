"""A preemptible accelerate training loop, run as a real process by tests/test_accelerate_preempt.py
(issue 32): ``TransactionalAccelerator(save_on_preemption=...)``, explicit step directories
(``save_state(f"{project}/step_{step}")``: txckpt step == the loop's step), a periodic save every
``--every`` steps, and ``save_state_if_preempted`` at every step boundary.

  accelerate_preempt.py --project P --hs HS [--mode save|stock] [--grace S] [--every K]
                        [--block-preempted-save] [--resume --max-steps N]
                        [--rank R --world W --store FILE]

The "training step" makes every tagged value the step: the model's weights, the optimizer's lr,
and a ``register_for_checkpointing`` object, so a checkpoint's content names its step. A
``register_save_state_pre_hook`` writes ``loop_step_rank{r}.json`` into each save (every rank's
own loop step: the checkpoint shows which step each rank saved).

Handshakes are files in ``--hs`` (never sleeps):

- ``step-rank{r}``: the last step this rank finished (replaced atomically, after its saves);
- ``result-rank{r}.json``: the step whose boundary ended the loop (written as SystemExit passes);
- ``blocked-rank{r}``: with ``--block-preempted-save``, a save that began after this rank
  received its signal waits inside accelerate's save (the transaction open, its files not all
  written) for ``release``,
  which the test never writes: only a second signal ends the process;
- ``resumed-rank{r}.json``: ``--resume``: what ``load_state()`` restored.

With ``--world 2`` it is one rank of a gloo group rendezvousing on ``--store`` (a FileStore),
initialised before the accelerator as tests/children/accelerate_workers.py's ranks are (the
launcher's group, then RANK / WORLD_SIZE / LOCAL_RANK for accelerate).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from tests.harness.handshake import put  # noqa: E402


def _wait_for(path: str, deadline_s: float = 300.0) -> None:
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(path)
        time.sleep(0.01)  # polling a file with a deadline: the parent's release


class Tag:
    """A ``register_for_checkpointing`` object (custom_checkpoint_0.pkl)."""

    def __init__(self) -> None:
        self.tag = -1.0

    def state_dict(self) -> dict:
        return {"tag": self.tag}

    def load_state_dict(self, state: dict) -> None:
        self.tag = state["tag"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project", required=True)
    p.add_argument("--hs", required=True)
    p.add_argument("--mode", choices=["save", "stock"], default="save")
    p.add_argument("--grace", type=float, default=None)
    p.add_argument("--every", type=int, default=0, help="periodic save every K steps (0: none)")
    p.add_argument("--block-preempted-save", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store", default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    r = a.rank
    import torch

    if a.world > 1:  # one process: no group, no variables (accelerate would rendezvous by env://)
        os.environ.update(RANK=str(r), WORLD_SIZE=str(a.world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(a.world))
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{a.store}", rank=r, world_size=a.world, timeout=datetime.timedelta(seconds=120)
        )
    from accelerate.utils import ProjectConfiguration

    from txckpt import preemption
    from txckpt.integrations.accelerate import TransactionalAccelerator

    torch.manual_seed(0)
    save_on_preemption = False if a.mode == "stock" else (True if a.grace is None else a.grace)
    acc = TransactionalAccelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=a.project), save_on_preemption=save_on_preemption
    )
    assert acc.num_processes == a.world, (acc.num_processes, a.world)
    assert preemption.installed() == (a.mode == "save")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    tag = Tag()
    acc.register_for_checkpointing(tag)
    current = {"step": -1}

    def pre_hook(models, weights, output_dir):
        put(os.path.join(output_dir, f"loop_step_rank{r}.json"), json.dumps(current["step"]))
        if a.block_preempted_save and preemption.received():
            put(os.path.join(a.hs, f"blocked-rank{r}"), str(current["step"]))
            _wait_for(os.path.join(a.hs, "release"))

    acc.register_save_state_pre_hook(pre_hook)

    start = 1
    if a.resume:
        loaded = acc.load_state()
        w = acc.unwrap_model(model).weight.detach().flatten()
        put(
            os.path.join(a.hs, f"resumed-rank{r}.json"),
            json.dumps(
                {
                    "path": loaded,
                    "model": float(w[0]),
                    "uniform": bool((w == w[0]).all()),
                    "lr": float(opt.param_groups[0]["lr"]),
                    "tag": tag.tag,
                    "iteration": int(acc.project_configuration.iteration),
                }
            ),
        )
        start = int(acc.project_configuration.iteration)  # one past the step loaded
    for step in range(start, a.max_steps + 1):
        current["step"] = step
        with torch.no_grad():  # the "training step": every tagged value becomes the step
            for param in acc.unwrap_model(model).parameters():
                param.fill_(float(step))
        for g in opt.param_groups:
            g["lr"] = float(step)
        tag.tag = float(step)
        out = os.path.join(a.project, f"step_{step}")
        try:
            acc.save_state_if_preempted(out)  # every rank, every step: one all-reduce
        except SystemExit as e:
            put(
                os.path.join(a.hs, f"result-rank{r}.json"),
                json.dumps({"stopped_at": step, "received": preemption.received(), "status": e.code}),
            )
            raise
        if a.every and step % a.every == 0:
            acc.save_state(out)
        put(os.path.join(a.hs, f"step-rank{r}"), str(step))
    acc.end_training()  # a run that ends without a signal: the handlers the accelerator installed go back
    print(
        f"finished at step {a.max_steps}; handlers installed after end_training: {preemption.installed()}", flush=True
    )


if __name__ == "__main__":
    main()
