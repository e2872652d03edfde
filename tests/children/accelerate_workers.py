"""Accelerate jobs for tests/test_accelerate.py, run on real processes by tests/harness/launcher.py
(gloo, 1 or 2 ranks): stock ``accelerate.Accelerator`` or ``TransactionalAccelerator``.

A job runs a list of operations on a fresh accelerator (a fresh process: a new run or a
restart) and returns what each one observed. Every checkpoint's model and optimizer carry a
*tag* (the model's weights and the optimizer's lr hold the same number), so a load that mixes
two saves, or picks another run's checkpoint, is seen.

Mainly rank targets (``job``); tests/test_accelerate_crash.py also imports its helpers
(``prepare``, ``train``, ``observe``) to build its in-process scenarios.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any


def _kill_job(pid_dir: str) -> None:
    """SIGKILL every rank of this job (their pids are in ``pid_dir``), this one last."""
    me = os.getpid()
    for name in sorted(os.listdir(pid_dir)):
        if name.startswith("pid"):
            pid = int(open(os.path.join(pid_dir, name)).read())
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    os.kill(me, signal.SIGKILL)


def make_accelerator(
    kind: str,
    project: str | None,
    *,
    total_limit: int | None,
    auto: bool,
    storage_options: dict | None,
    local_dir: str | None,
):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=auto, total_limit=total_limit)
    if kind == "stock":
        return Accelerator(cpu=True, project_config=config)
    from txckpt.integrations.accelerate import TransactionalAccelerator

    return TransactionalAccelerator(
        cpu=True, project_config=config, txckpt_storage_options=storage_options, txckpt_local_dir=local_dir
    )


class Counter:
    """A ``register_for_checkpointing`` object (custom_checkpoint_0.pkl)."""

    def __init__(self) -> None:
        self.tag = -1.0

    def state_dict(self) -> dict:
        return {"tag": self.tag}

    def load_state_dict(self, state: dict) -> None:
        self.tag = state["tag"]


def job(
    rank: int,
    world: int,
    *,
    kind: str,
    project: str | None,
    ops: list,
    pid_dir: str,
    total_limit: int | None = None,
    auto: bool = True,
    storage_options: dict | None = None,
    local_dir: str | None = None,
    crash_file: str | None = None,
) -> list:
    """Run ``ops`` and return one observation per op:

    * ``["train", tag]``: set the model's weights and the optimizer's lr (and the custom object)
      to ``tag``; observes None.
    * ``["save", dir_or_None]``: ``save_state``; observes the returned path, or the error.
    * ``["load", path_or_None]``: ``load_state``; observes ``{"model", "lr", "custom"}`` tags, or
      the error as ``{"error": type, "message": ...}``.
    * ``["iteration", n]``: ``project_configuration.iteration = n``.
    * ``["chdir", dir]``: change the working directory of every rank.
    * ``["crash"]``: SIGKILL every rank now.
    * ``crash_file``: SIGKILL every rank while the save writes the file of that name (just before).
    """
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    with open(os.path.join(pid_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    import torch

    torch.manual_seed(0)
    acc = make_accelerator(
        kind, project, total_limit=total_limit, auto=auto, storage_options=storage_options, local_dir=local_dir
    )
    assert acc.num_processes == world, (acc.num_processes, world)
    model, opt, counter = prepare(acc)
    if crash_file:
        _arm_crash(crash_file, pid_dir)
    out: list[Any] = []
    for op in ops:
        what = op[0]
        if what == "train":
            train(acc, model, opt, counter, float(op[1]))
            out.append(None)
        elif what == "iteration":
            acc.project_configuration.iteration = int(op[1])
            out.append(None)
        elif what == "chdir":  # relative save_state/load_state paths, as a script run from there
            os.chdir(op[1])
            out.append(None)
        elif what == "crash":
            acc.wait_for_everyone()
            _kill_job(pid_dir)
        elif what == "save":
            try:
                out.append(str(acc.save_state(op[1])))
            except Exception as e:  # noqa: BLE001 - observed
                out.append({"error": type(e).__name__, "message": str(e)})
        elif what == "load":
            try:
                acc.load_state(op[1])
                out.append(observe(acc, model, opt, counter))
            except Exception as e:  # noqa: BLE001 - observed
                out.append({"error": type(e).__name__, "message": str(e)})
        else:
            raise ValueError(op)
    acc.wait_for_everyone()
    return json.loads(json.dumps(out))


def prepare(acc):
    """A model, an optimizer and a registered custom object, prepared."""
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return model, opt, counter


def train(acc, model, opt, counter, tag: float) -> None:
    """Stand-in for training: every tagged value becomes ``tag``."""
    import torch

    with torch.no_grad():
        for p in acc.unwrap_model(model).parameters():
            p.fill_(tag)
    for g in opt.param_groups:
        g["lr"] = tag
    counter.tag = tag


def observe(acc, model, opt, counter) -> dict:
    w = acc.unwrap_model(model).weight.detach().flatten()
    return {
        "model": float(w[0]),
        "uniform": bool((w == w[0]).all()),
        "lr": float(opt.param_groups[0]["lr"]),
        "custom": counter.tag,
    }


def _arm_crash(name: str, pid_dir: str) -> None:
    """SIGKILL the job when rank 0 starts writing file ``name`` (accelerate's ``save`` and
    ``torch.save`` calls): the files before it are written, it and the rest are not."""
    import accelerate.checkpointing as ck
    import torch

    real_save, real_torch_save = ck.save, torch.save

    def hit(f) -> None:
        # Rank 0 only: accelerate calls save() on every rank and writes on the main one alone,
        # so another rank reaches the name before rank 0 wrote the files before it.
        if os.environ.get("RANK") == "0" and os.path.basename(os.fspath(f)) == name:
            _kill_job(pid_dir)

    def save(obj, f, *a, **kw):
        hit(f)
        return real_save(obj, f, *a, **kw)

    def torch_save(obj, f, *a, **kw):
        if isinstance(f, (str, os.PathLike)):
            hit(f)
        return real_torch_save(obj, f, *a, **kw)

    ck.save = save
    torch.save = torch_save
