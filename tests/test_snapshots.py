"""History snapshots (protocol §4a): a fresh process folds the log from the newest snapshot, and
gets exactly what folding every entry gives; a bad snapshot is ignored, never trusted."""

from __future__ import annotations

import pytest

import txckpt
from txckpt._log import log as commit_log
from txckpt.errors import LogCorruptError
from txckpt._maintenance.gc import collect_garbage
from txckpt._maintenance.retention import RetentionPolicy, apply_retention

from tests.conftest import count_reads, forge_snapshot

EVERY = 6


@pytest.fixture(autouse=True)
def _small_interval(monkeypatch):
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    monkeypatch.setattr(commit_log, "SNAPSHOT_EVERY", EVERY)


def fresh(url, opts=None) -> txckpt.CheckpointRoot:
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(url, opts)


def files(tag: str, step: int) -> dict:
    return {"w.bin": f"{tag}{step}".encode() * 10, "meta.json": {"step": step, "tag": tag}}


def busy_root(url, opts=None, saves: int = 20) -> None:
    """Saves with retention after each one, a rollback in the middle: forks, retire entries and
    abandoned checkpoints all end up in the history."""
    policy = RetentionPolicy(keep_last=2, abandoned=0)
    r = fresh(url, opts)
    for step in range(1, saves + 1):
        if step == saves // 2:
            r = fresh(url, opts)
            r.resume(step - 2)  # a rollback: abandons the newest (keep_last=2 kept two)
        r.save(step, files("A", step))
        apply_retention(r, policy)


def count_log_reads(monkeypatch, r, under: str = commit_log.LOG_DIR) -> list[str]:
    """The keys under ``under`` (default: the log's entries) that ``r`` reads from now on."""
    return count_reads(monkeypatch, r, under + "/")


def test_fold_from_snapshot_equals_fold_of_every_entry(any_root):
    url, opts = any_root
    busy_root(url, opts)
    r = fresh(url, opts)
    snaps = commit_log.list_snapshots(r.storage)
    assert snaps, "retention folded more than SNAPSHOT_EVERY entries but left no snapshot"
    quick = r.history()
    assert quick.base_seq == snaps[-1] >= 0
    assert quick.entries and quick.entries[0]["seq"] == quick.base_seq + 1 or quick.state.seq == quick.base_seq
    full = commit_log.read_history(r.storage, snapshots=False)
    assert full.base_seq == -1 and len(full.entries) == full.state.seq + 1
    assert quick.folds_like(full)
    # What the snapshot-based history decides is what the full one decides.
    policy = RetentionPolicy(keep_last=1, abandoned=3600)
    assert [c.txid for c in policy.decide(quick, now=1e12)] == [c.txid for c in policy.decide(full, now=1e12)]


def test_fresh_retention_reads_only_the_entries_after_the_snapshot(root, monkeypatch):
    busy_root(root, saves=30)
    r = fresh(root)
    total = r.state().seq + 1
    reads = count_log_reads(monkeypatch, r)
    apply_retention(r, RetentionPolicy(keep_last=2, abandoned=0))
    assert total > 4 * EVERY
    # The snapshot's own entry, at most EVERY - 1 after it, and the probes past the end.
    assert len(reads) <= EVERY + 4, (len(reads), total)


def test_restart_resuming_the_current_lineage_reads_a_constant_number_of_entries(root, monkeypatch):
    busy_root(root, saves=30)
    r = fresh(root)
    reads = count_log_reads(monkeypatch, r)
    path = r.resume()
    assert path == txckpt.get_last_checkpoint(root)
    # The state (newest entry + probe), the claim (re-read, append), the lookup: a constant, not
    # the 60 entries of the log.
    assert len(reads) <= 8, reads


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "not-json"])
def test_a_bad_snapshot_is_ignored_with_a_warning_and_gc_removes_it(root, tmp_path, txlog, damage):
    busy_root(root)
    r = fresh(root)
    seq = commit_log.list_snapshots(r.storage)[-1]
    path = r.storage.local_path(commit_log.snapshot_key(seq))
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        i = data.index(b'"retired"') + 3
        data[i] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "not-json":
        data = bytearray(b"\x00\xff" * 10)
    else:
        # A snapshot that verifies on its own, made from another root's log at the same seq.
        data = bytearray(forge_snapshot(bytes(data), lambda head, body: head.update(entry_digest="0" * 32)))
    with open(path, "wb") as f:
        f.write(data)
    r = fresh(root)
    quick = r.history()
    assert "ignoring the history snapshot" in txlog.text
    assert quick.base_seq != seq
    assert quick.folds_like(commit_log.read_history(r.storage, snapshots=False))
    report = collect_garbage(fresh(root), grace_seconds=0)
    gone = {i.key for i in report.items if i.kind == "snapshot" and i.done}
    assert commit_log.snapshot_key(seq) in gone
    left = commit_log.list_snapshots(fresh(root).storage)
    assert len(left) <= 1 and seq not in left


def test_gc_keeps_only_the_newest_snapshot(any_root):
    url, opts = any_root
    busy_root(url, opts, saves=30)
    r = fresh(url, opts)
    before = commit_log.list_snapshots(r.storage)
    assert len(before) >= 2
    collect_garbage(r, grace_seconds=0)
    after = commit_log.list_snapshots(fresh(url, opts).storage)
    assert after == [before[-1]] or (len(after) == 1 and after[0] > before[-1])
    # Nothing committed was touched: every kept checkpoint still verifies.
    r = fresh(url, opts)
    for info in r.checkpoints("all"):
        if info.state != "retired":
            txckpt.verify_checkpoint(info.path, storage_options=opts)


def test_gc_reads_the_snapshot_its_fold_started_from_once(root, monkeypatch):
    busy_root(root, saves=30)
    r = fresh(root)
    newest = commit_log.list_snapshots(r.storage)[-1]
    reads = count_log_reads(monkeypatch, r, under=commit_log.SNAPSHOT_DIR)
    collect_garbage(r, grace_seconds=0)
    assert reads == [commit_log.snapshot_key(newest)], reads
    assert commit_log.list_snapshots(fresh(root).storage) == [newest]


def test_a_snapshot_of_a_lost_entry_is_a_damaged_log(root):
    busy_root(root)
    r = fresh(root)
    seq = commit_log.list_snapshots(r.storage)[-1]
    newest = r.state().seq
    # The log loses its newest entries, down to (and including) the snapshot's (a restore from an
    # older backup of .txckpt/log); the hint goes too, so only the snapshot tells.
    for s in range(seq, newest + 1):
        r.storage.delete_file(commit_log.entry_key(s))
    r.storage.delete_file(commit_log.LATEST_HINT)
    with pytest.raises(LogCorruptError, match="lost entries"):
        fresh(root).history()


def test_a_hole_after_the_snapshot_is_a_damaged_log(root):
    """A fold from a snapshot, or one extending a history a session holds, reads on without
    listing the log (its cost follows what was appended since): an entry deleted there ends
    that read short of the latest hint and is reported, never taken for the end of the log."""
    busy_root(root)
    held = fresh(root)
    held_end = held.history().state.seq
    writer = fresh(root)
    writer.resume()
    tip = writer.state().head_tip.step
    for step in (tip + 1, tip + 2):
        writer.save(step, files("later", step))
    seq = commit_log.list_snapshots(writer.storage)[-1]
    assert writer.state().seq > held_end + 1 > seq
    writer.storage.delete_file(commit_log.entry_key(held_end + 1))
    with pytest.raises(LogCorruptError, match="lost entries"):
        fresh(root).history()
    with pytest.raises(LogCorruptError, match="lost entries"):
        held.history()


def test_snapshot_write_failure_is_not_an_error(root, monkeypatch):
    """A read-only or full root cannot take a snapshot; retention still does its work."""
    busy_root(root, saves=8)
    r = fresh(root)
    r.resume()
    original = r.storage.create_exclusive

    def refuse_snapshots(key, data, *, durable):
        if key.startswith(commit_log.SNAPSHOT_DIR + "/"):
            raise OSError(28, "No space left on device")
        return original(key, data, durable=durable)

    monkeypatch.setattr(r.storage, "create_exclusive", refuse_snapshots)
    before = commit_log.list_snapshots(r.storage)
    policy = RetentionPolicy(keep_last=2, abandoned=0)
    for step in range(9, 9 + 2 * EVERY):
        r.save(step, files("A", step))
        apply_retention(r, policy)
    assert commit_log.list_snapshots(r.storage) == before
    kept = [c.step for c in r.checkpoints("current")]
    last = 8 + 2 * EVERY
    assert kept[-2:] == [last - 1, last] and len(kept) <= 3, kept  # keep_last=2 + the fork point
