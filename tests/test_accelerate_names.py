"""Names on an Accelerate root (naming ``checkpoint_<i>``, txckpt/_base/naming.py): every message that
names a checkpoint by its public name uses the root's naming, never the default ``checkpoint-N``
(homes, ``.txckpt/tx/<txid>/checkpoint-N``, keep theirs: protocol §2)."""

from __future__ import annotations

import logging
import os
import re

import torch

import txckpt
from txckpt._base.naming import Naming, record_naming
from txckpt._root.root import open_root

from .harness.fs import flip_byte


def _accelerate_root(path: str, steps: int) -> list[str]:
    """A root named as accelerate's (checkpoint_<i>) with checkpoints 0..steps-1."""
    os.makedirs(path)
    r = open_root(path)
    record_naming(r.storage, Naming("checkpoint_"), durable=False)
    r.publication.naming = Naming("checkpoint_")
    return [txckpt.save_checkpoint(path, i, {"w.safetensors": {"w": torch.full((2,), float(i))}}) for i in range(steps)]


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
    flip_byte(weights)  # bit rot in the newest checkpoint
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        resumed = txckpt.resume(root, on_damaged="fallback")
    assert os.path.basename(resumed) == "checkpoint_1"
    (warning,) = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert "checkpoint_2 (txid" in warning, warning
    assert _default_names(warning) == [], warning


def test_fallback_warning_names_checkpoint_4_not_checkpoint_dash_4(tmp_path, caplog):
    """Issue 28 (a): the damaged newest checkpoint of an Accelerate root, checkpoint_4, is named
    so in the fallback warning; checkpoint-4 appears only inside home paths."""
    root = str(tmp_path / "checkpoints")
    paths = _accelerate_root(root, 5)
    flip_byte(os.path.join(paths[-1], "w.safetensors"))
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        assert os.path.basename(txckpt.resume(root, on_damaged="fallback")) == "checkpoint_3"
    (warning,) = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert "failed verification: checkpoint_4 (txid" in warning, warning
    assert "checkpoint_4 (lineage" in warning, warning  # the abandoned list too
    assert _default_names(warning) == [], warning


def _zero_padded_legacy_root(path: str, steps: int) -> None:
    """A stock run's root whose directories are zero-padded (``checkpoint-00001``), adopted."""
    for i in range(1, steps + 1):
        d = os.path.join(path, f"checkpoint-{i:05d}")
        os.makedirs(d)
        with open(os.path.join(d, "w.bin"), "wb") as f:
            f.write(bytes([i]) * 8)
    txckpt.CheckpointRoot(path).adopt()


def test_warnings_name_adopted_zero_padded_checkpoints_as_they_are_named(tmp_path, caplog):
    """A root whose checkpoints are zero-padded (adopted ``checkpoint-00003``) is named so in the
    fallback and rollback warnings, not ``checkpoint-3`` (a name that is not on disk)."""
    root = str(tmp_path / "run")
    _zero_padded_legacy_root(root, 3)
    flip_byte(os.path.join(root, "checkpoint-00003", "w.bin"))
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        assert os.path.basename(txckpt.resume(root, on_damaged="fallback")) == "checkpoint-00002"
    (warning,) = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert "failed verification: checkpoint-00003 (txid" in warning, warning
    assert "abandons 1 checkpoint(s): checkpoint-00003 (lineage" in warning, warning
    caplog.clear()
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        txckpt.resume(root, step=1)
    (warning,) = [r.getMessage() for r in caplog.records if "rolling back" in r.getMessage()]
    assert "    checkpoint-00002  (lineage" in warning, warning
    assert "checkpoint-2 " not in warning, warning


def test_a_retired_checkpoint_left_at_its_accelerate_name_is_found(tmp_path):
    """Retention finishes a retired checkpoint whose data is still at its public name: on an
    Accelerate root that name is checkpoint_0 (retired_present looked for checkpoint-0)."""
    from txckpt._maintenance.retention import finish_retired, retire, retired_present

    root = str(tmp_path / "checkpoints")
    _accelerate_root(root, 3)
    r = open_root(root)
    first = r.checkpoints()[0]
    assert retire(r, [first.txid]) == [first.txid]
    os.rmdir(os.path.join(root, ".txckpt", "tx", first.txid))  # its (empty) home is gone
    txckpt.forget_roots()
    r = open_root(root)
    assert [c.txid for c in retired_present(r)] == [first.txid]
    finish_retired(r)
    assert not os.path.exists(os.path.join(root, "checkpoint_0"))
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["checkpoint_1", "checkpoint_2"]


def test_keep_best_by_an_accelerate_name_keeps_that_step(tmp_path):
    """A keep_best path that no longer exists (a stale copy's) is resolved by its name, in the
    root's naming: ``.../checkpoint_1`` keeps step 1 of an Accelerate root."""
    from txckpt._maintenance.retention import RetentionPolicy, plan_retention

    root = str(tmp_path / "checkpoints")
    _accelerate_root(root, 4)
    stale = str(tmp_path / "elsewhere" / "checkpoint_1")
    going = plan_retention(open_root(root), RetentionPolicy(keep_last=1, keep_best=[stale]))
    assert sorted(c.step for c in going) == [0, 2]


def test_log_of_a_legacy_accelerate_project_names_its_directories(tmp_path, capsys):
    """``txckpt log`` of a stock accelerate project (checkpoint_<i>, no log) names them so."""
    from txckpt._cli import app

    root = str(tmp_path / "checkpoints")
    for i in (0, 1):
        os.makedirs(os.path.join(root, f"checkpoint_{i}"))
    record_naming(open_root(root).storage, Naming("checkpoint_"), durable=False)
    txckpt.forget_roots()
    assert app.main(["log", root, "--format", "dot"]) == 0
    assert app.main(["log", root]) == 0
    out = capsys.readouterr().out
    assert '"checkpoint_0 (legacy)" -> "checkpoint_1 (legacy)"' in out, out
    assert "legacy checkpoint_N steps: [0, 1]" in out, out
    assert _default_names(out) == [], out
