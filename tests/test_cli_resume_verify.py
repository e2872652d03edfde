"""`txckpt resume ROOT --step K` verifies K before forking onto it (issue 45 item 10): it forked
onto a checkpoint that fails verification without a word, making it the current lineage's newest,
which the restart then failed to load."""

from __future__ import annotations

import json
import os

import pytest

import txckpt
from txckpt import cli

pytestmark = pytest.mark.non_durable


def damaged_root(tmp_path) -> str:
    root = str(tmp_path / "out")
    for s in (1, 2, 3):
        txckpt.save_checkpoint(root, s, {"a.bin": bytes([s]) * 1000, "b.json": {"s": s}})
    with open(os.path.join(root, "checkpoint-2", "a.bin"), "r+b") as f:
        f.seek(5)
        f.write(b"X")  # same size, another checksum
    txckpt.forget_roots()
    return root


def head(root: str) -> str | None:
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(root).state().head


def test_resume_refuses_a_step_that_fails_verification(tmp_path, capsys):
    root = damaged_root(tmp_path)
    before = head(root)
    assert cli.main(["resume", root, "--step", "2"]) == 1
    err = capsys.readouterr().err
    assert "IntegrityError: refusing to resume at step 2: it fails verification" in err
    assert "checkpoint-2/a.bin does not match its checksum" in err and "--no-verify" in err
    assert head(root) == before  # nothing forked
    assert txckpt.get_last_checkpoint(root).endswith("checkpoint-3")


def test_resume_says_it_verified_the_step_it_forks_onto(tmp_path, capsys):
    root = damaged_root(tmp_path)
    before = head(root)
    assert cli.main(["resume", root, "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verified step 1: 2 file(s), ") and "resumed at" in out
    assert head(root) != before


def test_no_verify_forks_and_says_it_did_not_verify(tmp_path, capsys):
    root = damaged_root(tmp_path)
    before = head(root)
    assert cli.main(["resume", root, "--step", "2", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "step 2 was NOT verified (--no-verify)" in out
    assert head(root) != before and txckpt.get_last_checkpoint(root).endswith("checkpoint-2")


def test_resume_json_says_whether_it_verified(tmp_path, capsys):
    root = damaged_root(tmp_path)
    assert cli.main(["resume", root, "--step", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True


def test_no_verify_without_a_step_is_a_usage_error(tmp_path, capsys):
    root = damaged_root(tmp_path)
    before = head(root)
    assert cli.main(["resume", root, "--no-verify"]) == 2
    assert "--no-verify goes with --step" in capsys.readouterr().err
    assert head(root) == before
