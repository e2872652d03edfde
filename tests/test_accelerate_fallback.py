"""TransactionalAccelerator(on_damaged=...): a restart past a damaged newest checkpoint (the
accelerate side of ``txckpt.resume(root, on_damaged="fallback")``), in a real process."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

pytest.importorskip("accelerate")

from .harness.fs import flip_byte  # noqa: E402
from .harness.zygote import run_python  # noqa: E402

_SCRIPT = textwrap.dedent(r"""
    import json, logging, os, sys
    import torch
    from accelerate.utils import ProjectConfiguration
    import txckpt
    from txckpt.integrations.accelerate import TransactionalAccelerator

    project, mode, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    warnings = []
    class Grab(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("txckpt").addHandler(Grab())
    acc = TransactionalAccelerator(cpu=True, on_damaged=mode,
                                   project_config=ProjectConfiguration(project_dir=project,
                                                                       automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(4, 4))
    out = {}
    if phase == "save":
        paths = []
        for tag in (1.0, 2.0, 3.0):
            with torch.no_grad():
                model.weight.fill_(tag)
            paths.append(acc.save_state())
        out["paths"] = paths
    else:
        try:
            out["loaded"] = acc.load_state()
            out["weight"] = float(model.weight[0, 0])
        except txckpt.errors.IntegrityError as e:
            out["error"] = [type(e).__name__, str(e), getattr(e, "path", None)]
    out["warnings"] = warnings
    print(json.dumps(out))
""")


def _run(project: str, mode: str, phase: str) -> dict:
    p = run_python(["-c", _SCRIPT, project, mode, phase], timeout=300, env={**os.environ, "TXCKPT_DURABLE": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_load_state_falls_back_past_a_damaged_newest_checkpoint(tmp_path):
    project = str(tmp_path / "proj")
    saved = _run(project, "raise", "save")["paths"]
    newest = saved[-1]
    weights = next(os.path.join(newest, n) for n in sorted(os.listdir(newest)) if n.startswith("model"))
    flip_byte(weights, from_end=3)  # bit rot in the newest checkpoint's weights
    damaged_bytes = open(weights, "rb").read()

    default = _run(project, "raise", "load")
    assert default["error"][0] == "IntegrityError" and default["error"][2] == weights, default

    fell_back = _run(project, "fallback", "load")
    assert "error" not in fell_back, fell_back
    assert os.path.basename(fell_back["loaded"]) == os.path.basename(saved[-2])
    assert fell_back["weight"] == 2.0  # the older checkpoint's weights, not the damaged ones
    (warning,) = [w for w in fell_back["warnings"] if "failed verification" in w]
    assert weights in warning
    # Nothing deleted: the damaged bytes are still on disk, under the abandoned lineage.
    homes = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(project, "checkpoints"))
        for f in fs
        if f == os.path.basename(weights)
    ]
    assert any(open(h, "rb").read() == damaged_bytes for h in homes)
