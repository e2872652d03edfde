"""The log format (protocol §4): a ``txckpt-log/2`` entry's size depends on neither the number of
lineages nor the history, and roots written in ``txckpt-log/1`` keep working."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

import txckpt
from txckpt._log import log as commit_log
from txckpt.cli import main as cli_main
from txckpt.errors import LogCorruptError

from tests.conftest import forge_snapshot

V1_ROOT = os.path.join(os.path.dirname(__file__), "data", "log_v1_root")


def _entry_sizes(root: str) -> dict[int, int]:
    d = os.path.join(root, ".txckpt", "log")
    return {int(n.split(".")[0]): os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".json")}


def _entry(root: str, seq: int) -> dict:
    with open(os.path.join(root, commit_log.entry_key(seq)), "rb") as f:
        return json.loads(f.read())


def test_entry_size_does_not_grow_with_lineages_or_history(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="txckpt")
    root = str(tmp_path / "r")
    r = txckpt.CheckpointRoot(root, durable=False)
    step, sizes = 0, {}
    for lin in range(50):
        if lin:
            step -= 15
            r.resume(step=step)  # a fork that abandons 15 checkpoints (30 at lineage 1)
        for _ in range(30):
            step += 1
            r.save(step, {"trainer_state.json": {"global_step": step}})
        sizes[lin] = max(_entry_sizes(root).values())
    # Every entry, commits and forks alike, stays under 2 KiB at 50 lineages and 1,500 commits,
    # and the largest at 50 lineages is no larger than the largest at 2.
    assert max(_entry_sizes(root).values()) <= 2048, sizes
    assert sizes[49] <= sizes[1] + 64, sizes
    entry = _entry(root, max(_entry_sizes(root)))
    assert entry["format"] == "txckpt-log/2" and entry["action"] == "commit"
    assert set(entry["head"]) == {"id", "parent", "created_seq", "created_time", "reason", "tip", "writer"}
    assert "state" not in entry
    # The newest entry holds the head's record only; the folded history holds every lineage.
    assert list(r.state().lineages) == [r.state().head]
    assert len(commit_log.read_history(r.storage, snapshots=False).state.lineages) == 50


def test_fold_derives_what_a_fork_abandons(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="txckpt")
    root = str(tmp_path / "r")
    r = txckpt.CheckpointRoot(root, durable=False)
    for s in range(1, 6):
        r.save(s, {"a.json": {"s": s}})
    a = r.state().head
    r.resume(step=2)
    fork = _entry(root, max(_entry_sizes(root)))
    assert fork["action"] == "fork" and "abandoned" not in fork
    h = commit_log.read_history(r.storage, snapshots=False)
    assert sorted(h.checkpoints[t].step for t in h.abandoned_at) == [3, 4, 5]
    assert set(h.abandoned_at.values()) == {fork["time"]}
    assert {c.lineage for c in h.abandoned()} == {a}


def _copy_v1(tmp_path) -> str:
    root = str(tmp_path / "v1")
    shutil.copytree(V1_ROOT, root, symlinks=True)
    return root


def test_v1_root_reads_as_before_and_takes_v2_entries(tmp_path, caplog, capsys, monkeypatch):
    caplog.set_level(logging.ERROR, logger="txckpt")
    root = _copy_v1(tmp_path)
    sizes = _entry_sizes(root)
    old_newest = max(sizes)
    assert {_entry(root, s)["format"] for s in sizes} == {"txckpt-log/1"}  # written by txckpt-log/1 code
    # Lookup, load and the histories (with and without the /1 snapshots) read it as that code did.
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-8")
    assert txckpt.load_checkpoint(os.path.join(root, "checkpoint-8"))["trainer_state.json"]["global_step"] == 8
    fresh = txckpt.CheckpointRoot(root, durable=False)
    full = commit_log.read_history(fresh.storage, snapshots=False)
    quick = commit_log.read_history(fresh.storage)
    assert quick.base_seq == 9 and quick.folds_like(full)
    assert len(full.state.lineages) == 2
    got = sorted((c.step, c.state) for c in fresh.checkpoints("all"))
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
    assert len(full.abandoned_at) == 2
    # A resume to an older step forks with a /2 entry after the /1 ones; saves go on.
    r = txckpt.CheckpointRoot(root, durable=False)
    r.resume(step=6)
    r.save(9, {"trainer_state.json": {"global_step": 9}})
    assert [_entry(root, s)["format"] for s in (old_newest + 1, old_newest + 2)] == ["txckpt-log/2"] * 2
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-9")
    mixed = commit_log.read_history(txckpt.CheckpointRoot(root).storage, snapshots=False)
    assert len(mixed.state.lineages) == 3 and mixed.state.head == r.state().head
    assert sorted(
        mixed.checkpoints[t].step for t, at in mixed.abandoned_at.items() if at == _entry(root, old_newest + 1)["time"]
    ) == [7, 8]
    # A /2 snapshot over the mixed log folds like the whole log; the audit agrees.
    monkeypatch.setattr(commit_log, "SNAPSHOT_EVERY", 1)
    txckpt.CheckpointRoot(root, durable=False).history(snapshot=True)
    snaps = commit_log.list_snapshots(txckpt.CheckpointRoot(root).storage)
    assert snaps[-1] == old_newest + 2
    quick = commit_log.read_history(txckpt.CheckpointRoot(root).storage)
    assert quick.base_seq == old_newest + 2 and quick.folds_like(mixed)
    capsys.readouterr()
    assert cli_main(["verify", root]) == 0, capsys.readouterr()


def test_snapshot_must_agree_with_its_entry(tmp_path, caplog, monkeypatch):
    """A /2 snapshot carries the full state; one whose head record is not its entry's is ignored."""
    root = str(tmp_path / "r")
    r = txckpt.CheckpointRoot(root, durable=False)
    for s in range(1, 4):
        r.save(s, {"a.json": {"s": s}})
    monkeypatch.setattr(commit_log, "SNAPSHOT_EVERY", 1)
    r.history(snapshot=True)
    (seq,) = commit_log.list_snapshots(r.storage)
    path = os.path.join(root, commit_log.snapshot_key(seq))
    with open(path, "rb") as f:
        data = f.read()

    def edit(head, body):
        body["state"]["lineages"][body["state"]["head"]]["writer"] = "someone-else"

    with open(path, "wb") as f:
        f.write(forge_snapshot(data, edit))
    caplog.set_level(logging.WARNING, logger="txckpt")
    quick = commit_log.read_history(r.storage)
    assert quick.base_seq == -1 and "is not the one log entry" in caplog.text
    assert quick.folds_like(commit_log.read_history(r.storage, snapshots=False))


def test_entry_of_a_newer_format_is_refused_with_what_to_do(tmp_path):
    root = str(tmp_path / "r")
    txckpt.save_checkpoint(root, 1, {"a.json": {}})
    path = os.path.join(root, commit_log.entry_key(max(_entry_sizes(root))))
    with open(path) as f:
        body = json.load(f)
    body["format"] = "txckpt-log/3"
    with open(path, "w") as f:
        json.dump(body, f)
    with pytest.raises(LogCorruptError, match="upgrade txckpt"):
        txckpt.get_last_checkpoint(root)


def _replace_by_a_directory(storage, key: str) -> None:
    """What a directory where a file was looks like on each backend: on an object store the
    object is gone and another object lies under its name as a prefix (``key/x``)."""
    local = storage.local_path(key)
    if local is not None:
        os.unlink(local)
        os.makedirs(os.path.join(local, "x"))
    else:
        storage.delete_file(key)
        storage.replace(f"{key}/x", b"junk")


def test_a_log_entry_replaced_by_a_directory_is_log_corruption_on_every_backend(any_root):
    """Every other kind of damage to the newest entry (garbage, a FIFO, a newer format) is a
    LogCorruptError from lookup and resume; a directory where the entry was is one too, never a
    bare IsADirectoryError, and the message says what is there."""
    from txckpt._storage import open_storage

    url, so = any_root
    for step in (1, 2):
        txckpt.save_checkpoint(url, step, {"a.json": {"step": step}}, storage_options=so)
    storage = open_storage(url, so)
    newest = commit_log.read_state(storage).seq
    _replace_by_a_directory(storage, commit_log.entry_key(newest))
    for call in (
        lambda: txckpt.get_last_checkpoint(url, storage_options=so),
        lambda: txckpt.resume(url, storage_options=so),
    ):
        txckpt.forget_roots()
        with pytest.raises(LogCorruptError) as e:
            call()
        assert f"log entry {newest}" in str(e.value) and "a directory, not a file" in str(e.value)
        assert "Restore .txckpt/log from a backup" in str(e.value)


def test_a_latest_hint_replaced_by_a_directory_reads_as_a_missing_hint(any_root):
    """The hint only saves reads (a FIFO there reads as a missing hint, tests/test_bad_input.py);
    a directory there too: lookup probes the log and answers the newest checkpoint."""
    from txckpt._storage import open_storage

    url, so = any_root
    for step in (1, 2):
        txckpt.save_checkpoint(url, step, {"a.json": {"step": step}}, storage_options=so)
    _replace_by_a_directory(open_storage(url, so), commit_log.LATEST_HINT)
    txckpt.forget_roots()
    path = txckpt.get_last_checkpoint(url, storage_options=so)
    assert txckpt.read_manifest(path, storage_options=so).step == 2
    txckpt.forget_roots()
    assert txckpt.read_manifest(txckpt.resume(url, storage_options=so), storage_options=so).step == 2


def test_a_snapshot_replaced_by_a_directory_is_ignored_like_any_damaged_snapshot(tmp_path, caplog, monkeypatch):
    """A snapshot only saves reads: a directory where it was is warned about and the log is
    folded instead, as for a garbled or FIFO snapshot, never a bare IsADirectoryError."""
    root = str(tmp_path / "r")
    r = txckpt.CheckpointRoot(root, durable=False)
    for s in range(1, 4):
        r.save(s, {"a.json": {"s": s}})
    monkeypatch.setattr(commit_log, "SNAPSHOT_EVERY", 1)
    r.history(snapshot=True)
    (seq,) = commit_log.list_snapshots(r.storage)
    _replace_by_a_directory(r.storage, commit_log.snapshot_key(seq))
    caplog.set_level(logging.WARNING, logger="txckpt")
    quick = commit_log.read_history(r.storage)
    assert quick.base_seq == -1 and "it is a directory, not a regular file" in caplog.text
    assert quick.folds_like(commit_log.read_history(r.storage, snapshots=False))


def test_a_log_directory_replaced_by_a_file_is_log_corruption(tmp_path):
    root = str(tmp_path / "r")
    for step in (1, 2):
        txckpt.save_checkpoint(root, step, {"a.json": {}})
    shutil.rmtree(os.path.join(root, commit_log.LOG_DIR))
    with open(os.path.join(root, commit_log.LOG_DIR), "w") as f:
        f.write("not a log")
    for call in (lambda: txckpt.get_last_checkpoint(root), lambda: txckpt.resume(root)):
        txckpt.forget_roots()
        with pytest.raises(LogCorruptError, match="is a file, not a directory"):
            call()


def test_a_writer_notes_what_its_entry_records(tmp_path, caplog, monkeypatch):
    """A writer does not read its own entry back: the state ``append`` returns is the head-only
    state a reader gets from the entry (``entry_state``), after saves, a fork, a save on the
    fork and retention, whichever lineages the built state held."""
    from txckpt._log import commit as commit_room
    from txckpt._root.root import open_root

    appended = []
    real_append = commit_log.append

    def recording_append(storage, build, **kw):
        entry, state = real_append(storage, build, **kw)
        appended.append((storage, entry["seq"], state))
        return entry, state

    monkeypatch.setattr(commit_room.commit_log, "append", recording_append)
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        txckpt.save_checkpoint(root, step, {"a.json": {"step": step}})
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        txckpt.resume(root, step=1)
    txckpt.save_checkpoint(root, 2, {"a.json": {"step": 22}})
    txckpt.apply_retention(open_root(root), txckpt.RetentionPolicy(keep_last=1))
    assert len(appended) >= 6  # three commits, the fork, the fork's commit, retention's entry
    assert any(len(commit_log.read_history(s).state.lineages) > 1 for s, _, _ in appended[:1])
    for storage, seq, state in appended:
        assert state == commit_log.entry_state(commit_log.read_entry(storage, seq)), seq
