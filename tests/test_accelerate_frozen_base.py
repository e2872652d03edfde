"""``TransactionalAccelerator(incremental=True)`` with a frozen base inside the one trained model
(issue 47): accelerate's ``model.safetensors`` is saved grouped, the frozen tensors in a stock
shard of their own that every later checkpoint shares (one inode), so the root grows per save by
the trained tensors, the optimizer and the small files only; ``load_state`` restores the model
exactly; a stock ``Accelerator.load_state`` cannot read the layout (docs/incremental.md,
"Accelerate" says why)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import txckpt

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from txckpt.integrations.accelerate import TransactionalAccelerator  # noqa: E402

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
INDEX = "model.safetensors.index.json"


@pytest.fixture
def fresh_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 8))  # base: 2 MiB
    for layer in model[:2]:
        layer.requires_grad_(False)
    return model


def _accelerator(project: str, incremental: bool = True) -> TransactionalAccelerator:
    return TransactionalAccelerator(
        cpu=True,
        incremental=incremental,
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True),
    )


def _train_step(acc, model, opt) -> None:
    loss = model(torch.randn(4, 512)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def _disk_bytes(root: str) -> int:
    """The bytes the files under ``root`` take, a hard-linked inode counted once."""
    sizes: dict[int, int] = {}
    for top, _, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(top, f))
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


def _run(project: str, saves: int = 3):
    acc = _accelerator(project)
    model = _model()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    paths, growth = [], []
    for _ in range(saves):
        _train_step(acc, model, opt)
        before = _disk_bytes(acc.txckpt_root())
        paths.append(acc.save_state())
        growth.append(_disk_bytes(acc.txckpt_root()) - before)
    return acc, model, opt, paths, growth


def test_frozen_base_is_written_once_and_loads_exactly(tmp_path, fresh_state):
    acc, model, opt, paths, growth = _run(str(tmp_path / "run"))
    frozen_bytes = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    trained_bytes = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    for p in paths:
        assert not os.path.exists(os.path.join(p, "model.safetensors"))
        with open(os.path.join(p, INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
        assert {k for k, v in weight_map.items() if v == SHARDS[0]} == {"0.weight", "0.bias", "1.weight", "1.bias"}
        txckpt.verify_checkpoint(p)
    # The frozen shard is one inode in every checkpoint; the trained one is written each time.
    assert len({os.stat(os.path.join(p, SHARDS[0])).st_ino for p in paths}) == 1
    assert len({os.stat(os.path.join(p, SHARDS[1])).st_ino for p in paths}) == 3
    # After the first save the root grows by the trained tensors, the optimizer and the small
    # files: what the checkpoint holds beside the frozen shard, plus the log's and manifest's bytes.
    for p, grew in list(zip(paths, growth))[1:]:
        besides_frozen = sum(
            os.path.getsize(os.path.join(p, f)) for f in os.listdir(p) if f not in (SHARDS[0], txckpt.MANIFEST_NAME)
        )
        assert (
            trained_bytes
            <= besides_frozen
            < trained_bytes + (64 << 10) + os.path.getsize(os.path.join(p, "optimizer.bin"))
        )
        assert grew < besides_frozen + (64 << 10), (grew, besides_frozen)
        assert grew < frozen_bytes / 4, (grew, frozen_bytes)

    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # A new run (a restart): fresh weights, fresh optimizer, then load_state().
    acc2 = _accelerator(str(tmp_path / "run"))
    model2 = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 8))
    for layer in model2[:2]:
        layer.requires_grad_(False)
    opt2 = torch.optim.Adam([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    model2, opt2 = acc2.prepare(model2, opt2)
    assert acc2.load_state() == paths[-1]
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved[k]), k
    loaded_opt = opt2.state_dict()["state"]
    for k, s in saved_opt["state"].items():
        assert all(torch.equal(loaded_opt[k][n], s[n]) for n in ("exp_avg", "exp_avg_sq")), k


def test_a_stock_load_state_cannot_read_the_grouped_layout(tmp_path, fresh_state):
    """What docs/incremental.md says: stock accelerate reads model i only from
    model{_i}.safetensors or pytorch_model{_i}.bin."""
    _, _, _, paths, _ = _run(str(tmp_path / "run"), saves=1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    stock = Accelerator(cpu=True)
    model = stock.prepare(_model())
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        stock.load_state(paths[0])
    # txckpt reads it back as the one file it was saved as.
    merged = txckpt.load_checkpoint(paths[0])["model.safetensors"]
    assert sorted(merged) == sorted(model.state_dict())


def test_a_model_all_trained_keeps_one_file(tmp_path, fresh_state):
    """Grouping changes the layout only where a model has both: an all-trained model stays
    accelerate's one model.safetensors (a stock load_state reads it)."""
    acc = _accelerator(str(tmp_path / "run"))
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    paths = []
    for _ in range(2):
        _train_step_small(acc, model, opt)
        paths.append(acc.save_state())
    assert all(os.path.exists(os.path.join(p, "model.safetensors")) for p in paths)
    assert not any(os.path.exists(os.path.join(p, INDEX)) for p in paths)


def _train_step_small(acc, model, opt) -> None:
    acc.backward(model(torch.randn(4, 64)).pow(2).mean())
    opt.step()
    opt.zero_grad()
