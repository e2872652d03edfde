"""``TransactionalAccelerator(incremental=True)`` (issue 30): a model prepared beside the trained
one and never changed (a frozen encoder) is saved by accelerate as a file of its own
(``model_1.safetensors``); an incremental save keeps it once, as a hard link of the committed
copy, while the trained model's file is written. Every checkpoint verifies and loads."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import txckpt

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from txckpt.integrations.accelerate import TransactionalAccelerator  # noqa: E402


@pytest.fixture
def fresh_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run(project: str, incremental: bool):
    torch.manual_seed(0)
    acc = TransactionalAccelerator(
        cpu=True,
        incremental=incremental,
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True),
    )
    head, encoder = nn.Linear(8, 1), nn.Linear(512, 512)  # the encoder: 1 MiB, never trained
    encoder.requires_grad_(False)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    head, encoder, opt = acc.prepare(head, encoder, opt)
    paths = []
    for _ in range(3):
        x = torch.randn(4, 8)
        loss = head(x + 0 * encoder.weight[:4, :8]).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        paths.append(acc.save_state())
    return acc, head, paths


def _ino(path: str, name: str) -> int:
    return os.stat(os.path.join(path, name)).st_ino


def test_the_frozen_models_file_is_kept_once(tmp_path, fresh_state):
    acc, head, paths = _run(str(tmp_path / "run"), True)
    assert len({_ino(p, "model_1.safetensors") for p in paths}) == 1  # the frozen encoder, once
    assert len({_ino(p, "model.safetensors") for p in paths}) == 3  # the trained head, each save
    for p in paths:
        txckpt.verify_checkpoint(p)
    trained = {k: v.clone() for k, v in head.state_dict().items()}
    with torch.no_grad():
        for v in head.parameters():
            v.zero_()
    acc.load_state(paths[-1])
    for k, v in head.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_without_incremental_every_file_is_written(tmp_path, fresh_state):
    _, _, paths = _run(str(tmp_path / "run"), False)
    assert len({_ino(p, "model_1.safetensors") for p in paths}) == 3
