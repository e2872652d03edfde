"""Names on an Accelerate root (naming ``checkpoint_<i>``, txckpt/naming.py): every message that
names a checkpoint by its public name uses the root's naming, never the default ``checkpoint-N``
(homes, ``.txckpt/tx/<txid>/checkpoint-N``, keep theirs: protocol §2)."""

from __future__ import annotations

import logging
import os
import re

import torch

import txckpt
from txckpt.naming import Naming, record_naming
from txckpt.root import open_root


def _accelerate_root(path: str, steps: int) -> list[str]:
    """A root named as accelerate's (checkpoint_<i>) with checkpoints 0..steps-1."""
    os.makedirs(path)
    r = open_root(path)
    record_naming(r.storage, Naming("checkpoint_"), durable=False)
    r.publication.naming = Naming("checkpoint_")
    return [txckpt.save_checkpoint(path, i, {"w.safetensors": {"w": torch.full((2,), float(i))}})
            for i in range(steps)]


def _default_names(text: str) -> list[str]:
    """``checkpoint-N`` public names in ``text``, home paths (``.../checkpoint-N``) aside."""
    return [m.group(0) for m in re.finditer(r"(?<![/\w])checkpoint-(\d+|N)\b", text)]


def test_rollback_warning_on_an_accelerate_root_names_checkpoints_by_its_naming(tmp_path, caplog):
    root = str(tmp_path / "checkpoints")
    paths = _accelerate_root(root, 4)
    assert [os.path.basename(p) for p in paths] == [f"checkpoint_{i}" for i in range(4)]
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        txckpt.resume(root, step=1)
    (warning,) = [r.getMessage() for r in caplog.records if "rolling back" in r.getMessage()]
    assert "checkpoint_2" in warning and "checkpoint_3" in warning, warning
    assert _default_names(warning) == [], warning


def test_fallback_warning_on_an_accelerate_root_names_checkpoints_by_its_naming(tmp_path, caplog):
    root = str(tmp_path / "checkpoints")
    paths = _accelerate_root(root, 3)
    weights = os.path.join(paths[-1], "w.safetensors")
    with open(weights, "r+b") as f:  # bit rot in the newest checkpoint
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        resumed = txckpt.resume(root, on_damaged="fallback")
    assert os.path.basename(resumed) == "checkpoint_1"
    (warning,) = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert "checkpoint_2 (txid" in warning, warning
    assert _default_names(warning) == [], warning
