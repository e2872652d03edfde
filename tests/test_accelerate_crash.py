"""SIGKILL a real process before and after every file operation of a
``TransactionalAccelerator.save_state`` (accelerate's own writes included: they are routed
through Python's ``open`` so the harness sees each one), after a rollback, with total_limit's
retention; after each crash a fresh process checks docs/protocol.md §12's invariants and that a
restart loads one whole checkpoint and saves past it.

In the campaign each sweep tries every point around an operation that flips what a reader sees
(a manifest, log entry or `latest` put in place, a publication) and a seeded 40% of the others;
the seed is in the summary line (`TXCKPT_SWEEP_SEED=<seed>` repeats a draw) and varies per run,
so the runs cover every point between them; `TXCKPT_FULL_SWEEP=1` tries every point
(tests/harness/sampling.py)."""

from __future__ import annotations

import io
import os

import pytest

pytest.importorskip("accelerate")

import txckpt  # noqa: E402
from tests.children.accelerate_workers import observe, prepare, train  # noqa: E402
from tests.harness.crash_sweep import report, sweep  # noqa: E402

pytestmark = pytest.mark.slow


def _accelerator(project: str):
    from accelerate.utils import ProjectConfiguration

    from txckpt.integrations.accelerate import TransactionalAccelerator

    return TransactionalAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2),
    )


def _route_writes_through_open() -> None:
    """torch.save to a path and safetensors' save_file write in C++; make them write through
    ``builtins.open`` (looked up at call time: the tracer's), byte for byte the same files, in
    one write each (a crash between two chunks of one file leaves what a crash between open
    and the write leaves: a partial file)."""
    import accelerate.utils.other as other
    import safetensors.torch
    import torch

    real_torch_save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            buf = io.BytesIO()
            real_torch_save(obj, buf, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(buf.getvalue())
            return None
        return real_torch_save(obj, f, *args, **kwargs)

    def save_file(tensors, filename, metadata=None):
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as out:
            out.write(data)

    torch.save = torch_save
    other.safe_save_file = save_file


def _committed(project: str) -> dict[str, str]:
    """txid -> manifest digest of every committed, non-retired checkpoint."""
    root = txckpt.CheckpointRoot(os.path.join(project, "checkpoints"))
    return {c.txid: txckpt.read_manifest(c.path).digest for c in root.checkpoints("all") if c.state != "retired"}


def test_sweep_save_state_after_rollback(tmp_path):
    template = str(tmp_path / "template")

    def make_template():
        acc = _accelerator(template)
        model, opt, counter = prepare(acc)
        for i in range(3):  # checkpoint_0..2 tagged 10..12; total_limit=2 retires checkpoint_0
            train(acc, model, opt, counter, 10.0 + i)
            acc.save_state()
        return _committed(template)

    from tests.harness.procs import run_child

    code, out = run_child(make_template)
    assert code == 0, out
    before = out["ok"]
    assert len(before) == 2

    def scenario(project: str):
        _route_writes_through_open()
        acc = _accelerator(project)
        model, opt, counter = prepare(acc)
        acc.load_state(os.path.join(project, "checkpoints", "checkpoint_1"))  # rollback: a fork
        train(acc, model, opt, counter, 22.0)
        acc.save_state()  # checkpoint_2 of the new lineage, over run A's published name

    def check(project: str, k: int, when: str) -> list[str]:
        v: list[str] = []
        now = _committed(project)
        for txid, digest in before.items():
            if now.get(txid) != digest:
                v.append(f"committed checkpoint {txid} is gone or changed")
        txckpt.forget_roots()
        acc = _accelerator(project)
        model, opt, counter = prepare(acc)
        path = acc.load_state()
        seen = observe(acc, model, opt, counter)
        tags = {seen["model"], seen["lr"], seen["custom"]}
        if len(tags) != 1 or not seen["uniform"]:
            v.append(f"{path} mixes saves: {seen}")
        elif tags.pop() not in (11.0, 12.0, 22.0):  # A-1 (forked), A-2 (not forked), B-2
            v.append(f"the restart loaded {path} with unexpected tag {seen}")
        for c in txckpt.CheckpointRoot(os.path.join(project, "checkpoints")).checkpoints("all"):
            if c.state != "retired":
                txckpt.verify_checkpoint(c.path)  # every committed checkpoint whole (IntegrityError)
        train(acc, model, opt, counter, 99.0)
        saved = acc.save_state()
        txckpt.forget_roots()
        if txckpt.get_last_checkpoint(os.path.join(project, "checkpoints")) != saved:
            v.append("the restart's save is not what lookup returns")
        return v

    result = sweep(
        "TransactionalAccelerator.save_state after a rollback",
        template,
        str(tmp_path / "work"),
        scenario,
        check,
        sampled=True,
    )
    assert any("optimizer.bin" in op for op in result.ops), result.ops  # accelerate's writes are crash points
    report(result)
