"""What `txckpt gc` says it frees is what the disk gets back (issue 45 item 8): on an incremental
root a collected checkpoint's files are often hard links that live checkpoints share, and
removing one frees nothing; gc counted each name's size ("10.6 MB reclaimed" where `du` got
2.17 MB back)."""

from __future__ import annotations

import os

import pytest

import txckpt
from txckpt import cli
from txckpt._cli.common import human_bytes
from txckpt._maintenance.gc import collect_garbage
from txckpt._maintenance.retention import RetentionPolicy

pytestmark = pytest.mark.non_durable

SHARED = b"s" * 300_000  # the same bytes in every step: one file, hard-linked into each checkpoint


def disk_bytes(root: str) -> int:
    """The bytes the root's checkpoint data occupies (its checkpoint-N and .txckpt/tx: not the
    log, which gc's retire entry grows): each inode once, however many names it has."""
    seen: dict[tuple[int, int], int] = {}
    for d, _, names in os.walk(root):
        rel = os.path.relpath(d, root)
        if not (rel.startswith("checkpoint-") or rel.startswith(os.path.join(".txckpt", "tx"))):
            continue
        for n in names:
            st = os.lstat(os.path.join(d, n))
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def incremental_root(root: str, steps=(1, 2, 3, 4)) -> None:
    for s in steps:
        txckpt.save_checkpoint(root, s, {"shared.bin": SHARED, "own.bin": bytes([s]) * 50_000}, incremental=True)
    txckpt.forget_roots()


def test_gc_reports_the_bytes_the_disk_gets_back_on_an_incremental_root(tmp_path):
    root = str(tmp_path / "out")
    incremental_root(root)
    shared = os.lstat(os.path.join(root, "checkpoint-4", "shared.bin"))
    assert shared.st_nlink == 4  # the premise: every step links the one file
    before = disk_bytes(root)
    policy = RetentionPolicy(keep_last=1)
    planned = collect_garbage(txckpt.CheckpointRoot(root), dry_run=True, policy=policy)
    assert disk_bytes(root) == before
    report = collect_garbage(txckpt.CheckpointRoot(root), policy=policy)
    freed = before - disk_bytes(root)
    assert len(report.of("policy")) == 3 and all(i.done for i in report.of("policy"))
    # The three collected checkpoints' own files (and manifests) went; the shared file stays,
    # held by checkpoint-4, and is reported as held, once (not three times).
    assert report.bytes == freed == planned.bytes
    assert report.held == planned.held == len(SHARED)
    assert all(i.held == len(SHARED) for i in report.of("policy"))
    assert report.to_json()["held_bytes"] == len(SHARED)


def test_a_file_shared_only_by_collected_checkpoints_is_freed_once(tmp_path):
    """Steps 1-3 share one file that step 4 does not have: it is freed with the last of its
    names, counted once, and nothing is held."""
    root = str(tmp_path / "out")
    for s in (1, 2, 3):
        txckpt.save_checkpoint(root, s, {"shared.bin": SHARED, "own.bin": bytes([s]) * 50_000}, incremental=True)
    txckpt.save_checkpoint(root, 4, {"shared.bin": b"t" * 300_000, "own.bin": b"4" * 50_000}, incremental=True)
    txckpt.forget_roots()
    before = disk_bytes(root)
    policy = RetentionPolicy(keep_last=1)
    planned = collect_garbage(txckpt.CheckpointRoot(root), dry_run=True, policy=policy)
    report = collect_garbage(txckpt.CheckpointRoot(root), policy=policy)
    freed = before - disk_bytes(root)
    assert report.bytes == freed == planned.bytes and freed > len(SHARED)
    assert report.held == planned.held == 0
    # The first two names of the shared file freed none of it; the last one freed all of it.
    assert [i.held for i in planned.of("policy")] == [len(SHARED), len(SHARED), 0]


def test_gc_summary_line_says_what_links_still_hold(tmp_path, capsys):
    root = str(tmp_path / "out")
    incremental_root(root, steps=(1, 2))
    assert cli.main(["gc", root, "--keep-last", "1", "--dry-run"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("1 item(s), ") and "reclaimable" in last
    assert last.endswith("300.0 kB of their files would stay, held by live checkpoints' links")
    before = disk_bytes(root)
    assert cli.main(["gc", root, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    freed = before - disk_bytes(root)
    assert (
        out[-1] == f"1 item(s), {human_bytes(freed)} reclaimed; 300.0 kB of their files stay, "
        "held by live checkpoints' links"
    )
    assert "(+300.0 kB held by other links)" in out[0]


def test_an_object_store_without_links_reports_every_byte(tmp_path):
    """memory:// has no hard links: each object is its own, every byte of it freed (unchanged)."""
    root = f"memory://gc-freed-{os.getpid()}-{tmp_path.name}"
    for s in (1, 2, 3):
        txckpt.save_checkpoint(root, s, {"shared.bin": SHARED, "own.bin": bytes([s]) * 50_000}, incremental=True)
    r = txckpt.CheckpointRoot(root)
    objects = {c.step: sum(size for _, size in r.storage.walk_files(r.storage.key_of(c.path))) for c in r.checkpoints()}
    report = collect_garbage(r, policy=RetentionPolicy(keep_last=1))
    assert [i.bytes for i in report.of("policy")] == [objects[1], objects[2]]
    assert report.bytes == objects[1] + objects[2] and report.held == 0
