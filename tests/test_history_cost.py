"""History costs nothing (issue 20 item 3): what a fresh process reads for `txckpt ls` and
`resume(step=...)` does not grow with the number of commits, and roots whose snapshots were
written in the older ``txckpt-snapshot/2`` format keep working.

The speed itself is measured in benchmarks/lookup.py (the 10,000-commit root against a 50-commit
one); these tests count the reads that the speed follows from, which is what can regress."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

import txckpt
from txckpt._log import log as commit_log
from txckpt.cli import main as cli_main
from txckpt._cli.views import LS_DEFAULT_COUNT
from txckpt._base.layout import MANIFEST_NAME

from benchmarks.lookup import build_root
from tests.conftest import count_reads

EVERY = 40
V2_SNAPSHOT_ROOT = os.path.join(os.path.dirname(__file__), "data", "snapshot_v2_root")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, caplog):
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    monkeypatch.setattr(commit_log, "SNAPSHOT_EVERY", EVERY)
    caplog.set_level(logging.ERROR, logger="txckpt")  # every rollback warns


def long_root(path: str) -> int:
    """300 saves over 3 lineages, each forked half a lineage back from the last: benchmarks/
    lookup.py's root, built by its builder. Returns the tip's step."""
    return build_root(path, commits=300, lineages=3)["tip"]


def fresh(path: str) -> txckpt.CheckpointRoot:
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(path)


def test_saves_alone_leave_a_snapshot_every_snapshot_every_entries(tmp_path):
    root = str(tmp_path / "r")
    r = txckpt.CheckpointRoot(root)
    for step in range(1, 3 * EVERY + 5):
        r.save(step, {"a.json": {"s": step}})
    # No retention, no rollback: before, such a run left no snapshot at all, and every fresh
    # reader folded its whole log. The committer of every EVERY-th entry leaves one, and removes
    # all but the newest two (no gc runs here to do it).
    snaps = commit_log.list_snapshots(r.storage)
    assert snaps == [2 * EVERY, 3 * EVERY]
    with open(os.path.join(root, commit_log.snapshot_key(snaps[-1])), "rb") as f:
        assert json.loads(f.readline())["format"] == "txckpt-snapshot/3"
    quick = commit_log.read_history(fresh(root).storage)
    assert quick.base_seq == 3 * EVERY and len(quick.entries) == 4
    assert quick.folds_like(commit_log.read_history(r.storage, snapshots=False))


def test_a_fresh_ls_reads_what_it_shows_not_the_history(tmp_path, capsys, monkeypatch):
    root = str(tmp_path / "r")
    tip = long_root(root)
    r = fresh(root)
    entries = count_reads(monkeypatch, r, commit_log.LOG_DIR + "/")
    everything = count_reads(monkeypatch, r, "", methods=("read_bytes", "list_dir"))
    monkeypatch.setattr("txckpt._cli.views.open_root_arg", lambda *a, **k: r)
    capsys.readouterr()
    assert cli_main(["ls", root]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1 + LS_DEFAULT_COUNT and lines[-1].split()[0] == str(tip)
    assert f"{300 - LS_DEFAULT_COUNT:,} older checkpoint(s) not listed" in err and "--all" in err
    # The newest snapshot and the entries after it (fewer than EVERY), not the 302 entries; and
    # the manifests of the rows shown (a public name, else the home), not one per checkpoint.
    assert len(entries) < EVERY + 5, entries
    manifests = [k for k in everything if k.endswith(MANIFEST_NAME)]
    assert len(manifests) <= 2 * LS_DEFAULT_COUNT, manifests
    # --all and -n still give everything, or as many as asked.
    assert cli_main(["ls", root, "--all"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 300
    assert cli_main(["ls", root, "-n", "5", "--json"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)] == list(range(tip - 4, tip + 1))


def test_a_rollback_moves_only_the_names_it_changes(tmp_path, monkeypatch):
    root = str(tmp_path / "r")
    tip = long_root(root)
    r = fresh(root)
    reads = count_reads(monkeypatch, r, "", methods=("read_bytes", "list_dir"))
    path = r.resume(step=tip - 3)
    assert path == os.path.join(root, f"checkpoint-{tip - 3}")
    # Three checkpoints abandoned: their names go back to their homes. Before, the fork read the
    # manifest of every checkpoint-N in the root and of every checkpoint in the view (~400).
    manifests = [k for k in reads if k.endswith(MANIFEST_NAME)]
    assert len(manifests) <= 12, manifests
    assert len([k for k in reads if k.startswith(commit_log.LOG_DIR + "/")]) < EVERY + 8
    names = {n for n in os.listdir(root) if n.startswith("checkpoint-")}
    assert f"checkpoint-{tip - 3}" in names and not {f"checkpoint-{s}" for s in range(tip - 2, tip + 1)} & names
    # Nothing is left for gc to reconcile.
    from txckpt._maintenance.gc import collect_garbage

    report = collect_garbage(fresh(root), dry_run=True)
    assert [i for i in report.items if i.kind in ("publish", "unpublish")] == []


def test_a_root_with_v2_snapshots_reads_as_before_and_gets_v3_ones(tmp_path, monkeypatch, caplog, capsys):
    """tests/data/snapshot_v2_root was written by txckpt before txckpt-snapshot/3 (saves, a
    rollback, retention, with TXCKPT_SNAPSHOT_EVERY=4): its snapshots are /2."""
    caplog.set_level(logging.WARNING, logger="txckpt")
    root = str(tmp_path / "v2")
    shutil.copytree(V2_SNAPSHOT_ROOT, root, symlinks=True)
    r = fresh(root)
    snaps = commit_log.list_snapshots(r.storage)
    assert snaps == [5, 10]
    for seq in snaps:
        with open(os.path.join(root, commit_log.snapshot_key(seq))) as f:
            assert json.load(f)["format"] == "txckpt-snapshot/2"
    full = commit_log.read_history(r.storage, snapshots=False)
    quick = commit_log.read_history(r.storage)
    assert quick.base_seq == 10 and quick.folds_like(full)
    assert "ignoring the history snapshot" not in caplog.text
    got = sorted((c.step, c.state) for c in r.checkpoints("all"))
    assert got == [
        (1, "retired"),
        (2, "retired"),
        (3, "current"),
        (4, "abandoned"),
        (4, "current"),
        (5, "abandoned"),
        (6, "current"),
        (7, "current"),
        (8, "current"),
    ]
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-8")
    # A save on it: the commit of an EVERY-th entry leaves a /3 snapshot, which readers take.
    monkeypatch.setattr(commit_log, "SNAPSHOT_EVERY", 1)
    r.save(9, {"trainer_state.json": {"global_step": 9}})
    newest = commit_log.list_snapshots(r.storage)[-1]
    assert newest == full.state.seq + 2  # this session's claim of the lineage, then the commit
    with open(os.path.join(root, commit_log.snapshot_key(newest)), "rb") as f:
        assert json.loads(f.readline())["format"] == "txckpt-snapshot/3"
    quick = commit_log.read_history(fresh(root).storage)
    assert quick.base_seq == newest and quick.folds_like(commit_log.read_history(r.storage, snapshots=False))
    assert "ignoring the history snapshot" not in caplog.text
    capsys.readouterr()
    assert cli_main(["verify", root]) == 0, capsys.readouterr()
