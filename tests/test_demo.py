"""`python -m txckpt.demo`, as README runs it: a relative root, --help, and its ending."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.harness.zygote import run_python


def demo(cwd, *args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "txckpt.demo", *args], cwd=cwd, timeout=300)


def test_the_readme_command_with_a_relative_root_runs_and_ends_with_the_log(tmp_path):
    out = demo(tmp_path, "out")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "get_last_checkpoint -> " + os.path.join("out", "checkpoint-2") + " " in out.stdout
    assert f"The demo wrote to {tmp_path / 'out'}" in out.stdout
    graph = out.stdout[out.stdout.index("`txckpt log out`") :]
    assert "(HEAD -> lineage" in graph and "abandoned" in graph and "lineages:" in graph
    assert "fork point of" in graph


def test_help_prints_usage_and_creates_nothing(tmp_path):
    out = demo(tmp_path, "--help")
    assert out.returncode == 0 and "usage: python -m txckpt.demo" in out.stdout
    assert os.listdir(tmp_path) == []


def test_a_root_that_is_not_empty_is_refused_before_writing(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    out = demo(tmp_path, "out")
    assert out.returncode == 2 and "not an empty directory" in out.stderr
    assert os.listdir(tmp_path / "out") == ["notes.txt"]


def _readme_block(command: str) -> list[str]:
    """The lines README's Operators sample shows under ``$ COMMAND`` (up to the next ``$`` or fence)."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read().splitlines()
    start = readme.index(f"$ {command}") + 1
    block = []
    for line in readme[start:]:
        if line.startswith("$ ") or line.startswith("```"):
            break
        block.append(line)
    while block and not block[-1]:
        block.pop()
    return block


def test_the_demo_names_its_root_once_and_leaves_what_readmes_gc_sample_shows(tmp_path):
    """With the default root (an absolute temp path) the first line names it once; and `txckpt gc
    --dry-run` on what the demo left prints what README's sample says."""
    out = demo(tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    root = first.split(" a rollback in ", 1)[1]
    assert os.path.isabs(root) and os.path.isdir(root) and first.count(root) == 1, first
    try:
        gc = run_python(["-m", "txckpt", "gc", "--dry-run", root], timeout=120)
    finally:
        shutil.rmtree(os.path.dirname(root))  # the demo's own temporary directory
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.rstrip("\n").splitlines() == _readme_block("txckpt gc --dry-run out")
