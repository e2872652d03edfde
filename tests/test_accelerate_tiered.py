"""``TransactionalAccelerator(tiered=TieredRoot(...))`` (docs/tiered.md): automatic naming saves
into the fast tier and each commit becomes durable; ``total_limit`` keeps what is not durable
yet; on a new node (the fast tier gone) ``load_state()`` restores the durable tier's newest
checkpoint onto the fast tier and loads exactly the state that was saved."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import txckpt

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from txckpt.integrations.accelerate import TransactionalAccelerator  # noqa: E402
from txckpt._root.root import forget_roots  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(tmp_path, tiered, **config):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = TransactionalAccelerator(
        cpu=True,
        tiered=tiered,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True, **config
        ),
    )
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def _tiered(tmp_path):
    forget_roots()
    return txckpt.TieredRoot(str(tmp_path / "fast"), str(tmp_path / "durable"))


def test_save_state_replicates_and_a_new_node_loads_the_durable_tip(tmp_path):
    tiered = _tiered(tmp_path)
    acc, model, opt = _accelerator(tmp_path, tiered)
    for _ in range(2):
        _step(acc, model, opt)
        path = acc.save_state()
    assert path.startswith(tiered.fast) and path.endswith("checkpoint_1")
    tiered.wait_durable()
    durable = txckpt.CheckpointRoot(tiered.durable)
    assert [c.step for c in durable.checkpoints("current")] == [0, 1]
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    shutil.rmtree(tiered.fast)  # a new node
    tiered = _tiered(tmp_path)
    acc, model, opt = _accelerator(tmp_path, tiered)
    where = acc.load_state()
    assert where.startswith(tiered.fast) and where.endswith("checkpoint_1")
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    _step(acc, model, opt)
    assert acc.save_state().endswith("checkpoint_2")
    tiered.wait_durable()
    assert [c.step for c in txckpt.CheckpointRoot(tiered.durable).checkpoints("current")] == [0, 1, 2]
    assert tiered.fast_root.state().head == txckpt.CheckpointRoot(tiered.durable).state().head


def test_total_limit_keeps_what_is_not_durable_yet(tmp_path, monkeypatch):
    monkeypatch.setattr(txckpt.TieredRoot, "_kick", lambda self: None)  # a durable tier that lags
    tiered = _tiered(tmp_path)
    acc, model, opt = _accelerator(tmp_path, tiered, total_limit=1)
    for _ in range(3):
        _step(acc, model, opt)
        acc.save_state()
    assert [c.step for c in tiered.fast_root.checkpoints("current")] == [0, 1, 2]
    tiered.wait_durable()
    acc.save_state()  # now the older ones are durable: total_limit applies
    assert [c.step for c in tiered.fast_root.checkpoints("current")] == [3]
