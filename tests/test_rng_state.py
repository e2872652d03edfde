"""txckpt.rng_state / txckpt.set_rng_state (issue 32): every generator a loop draws from is
captured and restored exactly, through a plain dict that torch.save, pickle and a txckpt
checkpoint carry; a state of another layout raises RngStateError, nothing restored.

In-process and fast: no child process."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

import txckpt
from txckpt._base import rngstate
from txckpt.errors import InvalidArgumentError, RngStateError


def _draw(n: int = 8) -> tuple:
    """n draws from each generator a loop uses (CUDA too where it is initialised)."""
    out = (
        [random.random() for _ in range(n)],
        [random.gauss(0, 1) for _ in range(n)],
        np.random.rand(n).tolist(),
        np.random.randn(n).tolist(),
        torch.rand(n).tolist(),
        torch.randint(0, 1 << 30, (n,)).tolist(),
    )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out += tuple(torch.rand(n, device=f"cuda:{d}").tolist() for d in range(torch.cuda.device_count()))
    return out


def test_capture_draw_restore_draws_the_same():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draw(5)  # somewhere in the streams, with a cached gauss in random and numpy
    random.gauss(0, 1), np.random.randn()
    state = txckpt.rng_state()
    first = _draw(50)
    _draw(7)  # move on
    txckpt.set_rng_state(state)
    assert _draw(50) == first
    txckpt.set_rng_state(state)  # a state restores as often as asked: it is not consumed
    assert _draw(50) == first


def test_state_is_plain_and_versioned():
    state = txckpt.rng_state()
    assert state["version"] == rngstate.RNG_STATE_VERSION == 1
    assert set(state) == {"version", "python", "numpy", "torch", "cuda"}
    assert isinstance(state["torch"], torch.Tensor) and state["torch"].dtype == torch.uint8
    assert state["numpy"] is not None and state["numpy"]["bit_generator"] == "MT19937"
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert state["cuda"] is None  # skipped cleanly: nothing drew from CUDA
    first = _draw()
    copy = pickle.loads(pickle.dumps(state))
    txckpt.set_rng_state(copy)
    assert _draw() == first


def test_a_checkpointed_state_restores_identically(tmp_path):
    root = str(tmp_path / "out")
    torch.manual_seed(11), random.seed(12), np.random.seed(13)
    _draw(3)
    state = txckpt.rng_state()
    first = _draw(40)
    path = txckpt.save_checkpoint(root, 1, {"rng_state_0.pth": state, "model.pt": {"w": torch.zeros(2)}})
    _draw(9)
    loaded = txckpt.load_checkpoint(path)["rng_state_0.pth"]  # weights_only=True: plain data only
    txckpt.set_rng_state(loaded)
    assert _draw(40) == first


def test_other_layouts_raise_and_restore_nothing(monkeypatch):
    state = txckpt.rng_state()
    before = txckpt.rng_state()
    for bad, what in [
        ({**state, "version": 2}, "version"),
        ("not a state", "str"),
        ({"version": 1}, "no python"),
        ({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 3}, "CUDA generator"),
    ]:
        with pytest.raises(RngStateError) as e:
            txckpt.set_rng_state(bad)
        assert what in str(e.value) and "Nothing was restored" in str(e.value)
        assert isinstance(e.value, InvalidArgumentError)
        assert e.value.process_layout["version"] == 1
    assert pickle.loads(pickle.dumps(e.value)).state_layout == {"version": 1, "numpy": True, "cuda": 3}
    assert _draw() == (txckpt.set_rng_state(before), _draw())[1]  # nothing had been restored


def test_numpy_missing_here(monkeypatch):
    state = txckpt.rng_state()
    first = _draw()
    monkeypatch.setattr(rngstate, "_numpy", lambda: None)
    with pytest.raises(RngStateError, match="numpy does not import here") as e:
        txckpt.set_rng_state(state)
    assert e.value.state_layout["numpy"] is True and e.value.process_layout["numpy"] is False
    txckpt.set_rng_state(state, strict=False)  # the others are restored
    d = _draw()
    assert (d[:2], d[4:]) == (first[:2], first[4:])
    monkeypatch.undo()
    txckpt.set_rng_state(state)
    assert _draw() == first
    # captured without numpy: nothing to restore there; the rest is exact
    monkeypatch.setattr(rngstate, "_numpy", lambda: None)
    no_numpy = txckpt.rng_state()
    assert no_numpy["numpy"] is None
    first = _draw()
    monkeypatch.undo()
    txckpt.set_rng_state(no_numpy)
    again = _draw()
    assert (again[:2], again[4:]) == (first[:2], first[4:])
