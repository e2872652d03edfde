"""The benchmark harness still runs end to end (tiny mode). Never asserts a timing: CI machines
are shared and noisy, and docs/benchmarks.md is where numbers live."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_run_writes_report_and_plot(tmp_path):
    out = tmp_path / "docs"
    scratch = tmp_path / "scratch"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--tiny", "--out", str(out), "--scratch", str(scratch)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = (out / "benchmarks.md").read_text()
    assert (out / "benchmarks.png").stat().st_size > 0
    assert "![save time against size](benchmarks.png)" in md
    assert "## Machine" in md and "## Summary" in md
    # Every case module shows up, as a table or as pending/skipped; none crashed the run.
    for title in (
        "Save, fsync on: txckpt vs the device's limit",
        "Save, fsync on: txckpt vs one sequential write + fsync",
        "Save, fsync on: txckpt vs torch DCP",
        "Save, durability off",
        "Load with verification",
        "Memory",
        "get_last_checkpoint",
        "Load, cold cache: txckpt vs the device's read limit",
        "S3: bytes uploaded per save",
        "S3: save throughput against pipe_file",
        "÷ parallel UploadParts",
        "S3: get_last_checkpoint requests",
        "Async save: time the training loop is blocked",
        "Async save on S3: blocked time against the synchronous save",
        "Trainer with txckpt_async_save: overhead per save",
        "DCP: TransactionalWriter / TransactionalReader vs plain torch DCP, 2 ranks",
        "Incremental save: frozen base + adapter (local disk, fsync on)",
        "Incremental save: the Trainer, a frozen base (local disk, fsync on)",
        "S3 load: verified, against the unverified readers",
        "Commit at many ranks (simulated): per-rank manifest parts",
        "Tiered root: fast local tier + S3 durable tier",
        "Lightning: time a save blocks the loop",
    ):
        assert title in md, title
    assert "**failed**" not in md, md[md.find("**failed**") - 400 :][:2000]
    # The write benchmarks cleaned up after themselves.
    assert not (scratch / "run").exists()
    # `render` rebuilds the page from the saved results without measuring.
    (out / "benchmarks.md").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "render", "--out", str(out), "--scratch", str(scratch)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "benchmarks.md").read_text() == md


def test_missing_and_failing_cases_are_reported_not_raised(monkeypatch):
    sys.path.insert(0, ROOT)
    try:
        from benchmarks import harness
    finally:
        sys.path.remove(ROOT)
    pending = harness.run_case("no_such_case_module", quick=True)
    assert pending[0]["status"] == "pending"

    import types

    broken = types.ModuleType("benchmarks.broken_case")

    def run(quick):
        raise RuntimeError("boom")

    broken.run = run
    monkeypatch.setitem(sys.modules, "benchmarks.broken_case", broken)
    failed = harness.run_case("broken_case", quick=True)
    assert failed[0]["status"] == "failed" and "boom" in failed[0]["reason"]
