"""collect_garbage: what it reclaims, what it must never touch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

import txckpt
from tests.harness.fs import tree
from txckpt._maintenance.gc import collect_garbage
from txckpt._maintenance.intents import pid_alive, process_start, writer_status
from txckpt._base.layout import INTENTS_DIR, ORPHANS_DIR, READERS_DIR, TX_DIR, home_key
from txckpt._maintenance.retention import RetentionPolicy, retire
from txckpt._maintenance.leases import acquire_reader_lease


pytestmark = pytest.mark.non_durable  # TXCKPT_DURABLE=0 for every test here (tests/conftest.py)


def save(root, steps, tag="a"):
    for s in steps:
        txckpt.save_checkpoint(root, s, {"w.bin": f"{tag}{s}".encode() * 20})


def fresh(root) -> txckpt.CheckpointRoot:
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(root)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def fake_staging(r: txckpt.CheckpointRoot, step: int, intent: dict | None) -> str:
    """A staging directory as a crashed writer leaves it (with its intent, if given)."""
    lineage = r.state().head or "deadbeef"
    txid = f"{step}-{lineage}-{uuid.uuid4().hex[:10]}"
    r.storage.replace(f"{home_key(txid, step)}/w.bin", b"partial")
    if intent is not None:
        record = {"txid": txid, "step": step, "lineage": lineage, "world_size": 1, **intent}
        r.storage.replace(f"{INTENTS_DIR}/{txid}.json", json.dumps(record).encode())
    return txid


def kinds(report) -> list[tuple[str, str]]:
    return sorted((i.kind, i.key) for i in report.items)


@pytest.fixture
def any_root(url_root):
    """A root URL on each backend, without storage options (tests/harness/backends.py)."""
    return url_root


def test_crashed_save_is_reclaimed_and_nothing_else(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2))
    txckpt.forget_roots()
    txckpt.resume(root, step=1)
    save(root, (2,), "b")
    code = (
        f"import os, signal, txckpt\nwith txckpt.transaction({root!r}, 3) as tx:\n"
        f"    tx.save('w.bin', b'x' * 1000)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TXCKPT_DURABLE": "0"})
    assert p.returncode == -signal.SIGKILL
    r = fresh(root)
    (txid,) = [t for t in os.listdir(os.path.join(root, TX_DIR)) if t not in r.history().checkpoints]
    before = tree(root)
    report = collect_garbage(r, dry_run=True)
    assert kinds(report) == [("intent", f"{INTENTS_DIR}/{txid}.json"), ("staging", f"{TX_DIR}/{txid}")]
    assert report.of("staging")[0].bytes == 1000 and not report.of("staging")[0].done
    assert tree(root) == before
    report = collect_garbage(r)
    assert all(i.done for i in report.items) and not report.errors
    after = tree(root)
    staging = os.path.join(TX_DIR, txid)
    assert set(before) - set(after) == {k for k in before if k.startswith(staging)} | {
        os.path.join(INTENTS_DIR, f"{txid}.json")
    }
    assert all(before[k] == v for k, v in after.items())
    # Empty homes of published checkpoints belong to committed checkpoints: still there.
    for c in r.history().checkpoints.values():
        assert os.path.isdir(os.path.join(root, TX_DIR, c.txid))
    assert collect_garbage(r).items == []


def test_writer_liveness_rules(any_root):
    save(any_root, (1,))
    r = fresh(any_root)
    now = time.time()
    host = socket.gethostname()
    live = fake_staging(r, 2, {"host": host, "pid": os.getpid(), "time": now - 10**6})
    dead = fake_staging(r, 3, {"host": host, "pid": dead_pid(), "time": now})
    no_intent = fake_staging(r, 4, None)
    young_remote = fake_staging(r, 5, {"host": "elsewhere", "pid": 1, "time": now - 60})
    old_remote = fake_staging(r, 6, {"host": "elsewhere", "pid": 1, "time": now - 7200})
    report = collect_garbage(r, grace_seconds=3600)
    removed = {i.key.split("/")[-1] for i in report.of("staging")}
    assert removed == {dead, no_intent, old_remote}
    assert {i.key.split("/")[-1] for i in report.kept} == {live, young_remote}
    assert r.storage.exists(f"{TX_DIR}/{live}") and r.storage.exists(f"{TX_DIR}/{young_remote}")
    intents = {n[:-5] for n in r.storage.list_dir(INTENTS_DIR)}
    assert intents == {live, young_remote}
    # The grace period is measured against `now`: later, the remote one is reclaimed too.
    report = collect_garbage(r, grace_seconds=3600, now=now + 3600)
    assert {i.key.split("/")[-1] for i in report.of("staging")} == {young_remote}
    txckpt.verify_checkpoint(txckpt.get_last_checkpoint(any_root))


def test_pid_reuse_counts_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        now = time.time()
        assert pid_alive(child.pid)
        assert pid_alive(child.pid, since=now)  # started before the intent: the writer itself
        # An intent written long before this process started: the pid was reused.
        assert not pid_alive(child.pid, since=now - 10**6)
        gone, why = writer_status(
            {"host": socket.gethostname(), "pid": child.pid, "time": now - 10**6}, now=now, grace_seconds=3600
        )
        assert gone and "dead" in why
    finally:
        child.stdin.close()
        child.wait()
    assert not pid_alive(child.pid)


@pytest.mark.skipif(process_start() is None, reason="no /proc: writers record no start time")
def test_liveness_uses_the_start_time_the_writer_recorded_not_its_clock(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1,))
    with txckpt.transaction(root, 2) as tx:
        intent = json.loads(tx._root.storage.read_bytes(f"{INTENTS_DIR}/{tx.txid}.json"))
        assert intent["process_start"] == process_start(os.getpid())
        tx.save("w.bin", b"x")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        host, now = socket.gethostname(), time.time()
        start = process_start(child.pid)
        # The writer's clock was a day behind when it wrote its intent: its start time decides.
        behind = {"host": host, "pid": child.pid, "time": now - 86400, "process_start": start}
        assert writer_status(behind, now=now, grace_seconds=3600) == (
            False,
            f"writer pid {child.pid} on this host is alive",
        )
        ahead = {"host": host, "pid": child.pid, "time": now + 86400, "process_start": start}
        assert not writer_status(ahead, now=now, grace_seconds=3600)[0]
        # Another process's start time under this pid: the pid was reused, the writer is dead.
        reused = {**behind, "process_start": {**start, "ticks": start["ticks"] - 1}}
        gone, why = writer_status(reused, now=now, grace_seconds=3600)
        assert gone and "another process" in why
        rebooted = {**behind, "process_start": {**start, "boot_id": "not-this-boot"}}
        gone, why = writer_status(rebooted, now=now, grace_seconds=3600)
        assert gone and "rebooted" in why
        # An intent written before process_start existed: the wall-clock test, as before.
        old = {"host": host, "pid": child.pid, "time": now - 86400}
        assert writer_status(old, now=now, grace_seconds=3600)[0]
        assert not writer_status({**old, "time": now}, now=now, grace_seconds=3600)[0]
    finally:
        child.stdin.close()
        child.wait()
    gone, why = writer_status(behind, now=now, grace_seconds=3600)
    assert gone and why == f"writer pid {child.pid} on this host is dead"


def test_a_commit_whose_staging_vanished_after_the_check_raises(tmp_path, monkeypatch):
    """gc (or an operator) deletes the staging after the commit checked it: the commit entry is
    appended, but the save must not return a path that holds nothing."""
    import shutil

    from txckpt._save import transactions
    from txckpt.errors import CheckpointNotFoundError

    root = str(tmp_path / "out")
    save(root, (1,))
    real = transactions.append_commit

    def append_commit(r, manifest, writer=None):  # §8 step 9, after the manifest (step 8)
        shutil.rmtree(os.path.join(root, ".txckpt", "tx", manifest.txid))
        return real(r, manifest, writer)

    monkeypatch.setattr(transactions, "append_commit", append_commit)
    with pytest.raises(CheckpointNotFoundError, match="was committed, but its data"):
        save(root, (2,))
    monkeypatch.setattr(transactions, "append_commit", real)
    assert txckpt.read_manifest(fresh(root).get_last_checkpoint()).step == 1


def test_a_crashed_adoptions_manifest_temp_files_are_reclaimed(tmp_path):
    """A crashed adoption leaves checkpoint-N/[.]txckpt-manifest.json.<rnd>.tmp (the temp files of
    the storage's create-if-absent and replace writes, protocol §9): gc removes them by its temp
    rule (older than the grace period), and nothing else in the directory."""
    root = str(tmp_path / "out")
    ckpt = os.path.join(root, "checkpoint-3")
    os.makedirs(ckpt)
    open(os.path.join(ckpt, "model.bin"), "wb").write(b"weights")
    old = [".txckpt-manifest.json.0123456789ab.tmp", "txckpt-manifest.json.ba9876543210.tmp"]
    young = ".txckpt-manifest.json.fedcba987654.tmp"
    user = "notes.0123456789ab.tmp"  # a user's file: not a temp of a manifest write
    for name in old + [young, user]:
        open(os.path.join(ckpt, name), "wb").write(b"{}")
    for name in old + [user]:
        os.utime(os.path.join(ckpt, name), (time.time() - 7200, time.time() - 7200))
    report = collect_garbage(fresh(root), grace_seconds=3600)
    assert sorted(k for k in kinds(report) if k[0] == "temp") == sorted(("temp", f"checkpoint-3/{n}") for n in old)
    assert sorted(os.listdir(ckpt)) == sorted([young, user, "model.bin"])
    # A dry run of a txckpt root reports them the same way (after adoption, in the adopted checkpoint).
    txckpt.CheckpointRoot(root).adopt()
    os.remove(os.path.join(ckpt, young))
    stale = os.path.join(ckpt, "txckpt-manifest.json.aaaaaaaaaaaa.tmp")
    open(stale, "wb").write(b"{}")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    report = collect_garbage(fresh(root), grace_seconds=3600, dry_run=True)
    assert [k for k in kinds(report) if k[0] == "temp"] == [("temp", "checkpoint-3/" + os.path.basename(stale))]
    assert os.path.exists(stale)


def test_stale_intents_tmp_files_and_orphans(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2))
    r = fresh(root)
    c2 = next(c for c in r.history().checkpoints.values() if c.step == 2)
    # A writer that committed and died before removing its intent.
    r.storage.replace(
        f"{INTENTS_DIR}/{c2.txid}.json",
        json.dumps({"txid": c2.txid, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode(),
    )
    # Temp files of interrupted create-if-absent writes: an old one and a fresh one.
    logdir = os.path.join(root, ".txckpt", "log")
    old_tmp = os.path.join(logdir, ".00000000000000000009.json.abc.tmp")
    new_tmp = os.path.join(logdir, ".00000000000000000009.json.def.tmp")
    for p in (old_tmp, new_tmp):
        open(p, "wb").write(b"{}")
    os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
    # An orphan: reported, never touched.
    orphan = os.path.join(root, ORPHANS_DIR, "checkpoint-7.20250101T000000.abcd1234")
    os.makedirs(orphan)
    open(os.path.join(orphan, "x"), "wb").write(b"keep me")
    log_before = sorted(os.listdir(logdir))
    report = collect_garbage(r, grace_seconds=3600)
    assert kinds(report) == [
        ("intent", f"{INTENTS_DIR}/{c2.txid}.json"),
        ("temp", f".txckpt/log/{os.path.basename(old_tmp)}"),
    ]
    assert report.orphans == [f"{ORPHANS_DIR}/{os.path.basename(orphan)}"]
    assert os.path.exists(new_tmp) and not os.path.exists(old_tmp)
    assert open(os.path.join(orphan, "x"), "rb").read() == b"keep me"
    assert sorted(os.listdir(logdir)) == [n for n in log_before if n != os.path.basename(old_tmp)]


def test_finishes_retired_deletions_and_respects_leases(any_root):
    save(any_root, (1, 2, 3, 4))
    r = fresh(any_root)
    h = r.history()
    by_step = {c.step: c for c in h.in_view(None)}
    # A reader leases step 2; then a rotation that decided before the lease retires 1 and 2
    # (phase one only, as a crash right after the retire entry leaves it).
    acquire_reader_lease(r, by_step[2].txid, 600)
    assert retire(r, [by_step[1].txid, by_step[2].txid]) == [by_step[1].txid, by_step[2].txid]
    assert r.locate(by_step[1].ref) is not None
    r.storage.replace(
        f"{READERS_DIR}/{by_step[3].txid}.old.json",
        json.dumps({"txid": by_step[3].txid, "expires": time.time() - 86400}).encode(),
    )
    report = collect_garbage(r)
    assert len(report.of("retired")) == 1 and by_step[1].txid in report.of("retired")[0].reason
    assert [i.kind for i in report.kept] == ["retired"]
    assert len(report.of("lease")) == 1
    assert r.locate(by_step[1].ref) is None and r.locate(by_step[2].ref) is not None
    assert not r.storage.exists(f"{TX_DIR}/{by_step[1].txid}")
    for s in (3, 4):
        txckpt.verify_checkpoint(r.locate(by_step[s].ref))


def test_policy_through_gc(any_root):
    save(any_root, (1, 2, 3))
    r = fresh(any_root)
    dry = collect_garbage(r, dry_run=True, policy=RetentionPolicy(keep_last=1))
    assert [i.kind for i in dry.items] == ["policy", "policy"] and not any(i.done for i in dry.items)
    assert len(r.checkpoints()) == 3
    # What gc frees of a checkpoint is all it deletes: its files and its manifest (issue 45 item 8).
    manifests = sum(
        len(r.storage.read_bytes(f"{r.storage.key_of(c.path)}/txckpt-manifest.json"))
        for c in r.checkpoints()
        if c.step < 3
    )
    report = collect_garbage(r, policy=RetentionPolicy(keep_last=1))
    assert all(i.done for i in report.items) and len(report.items) == 2
    assert [c.step for c in fresh(any_root).checkpoints()] == [3]
    assert report.bytes == 2 * 40 + manifests == dry.bytes


def test_completes_publication(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2))
    r = fresh(root)
    c2 = next(c for c in r.history().checkpoints.values() if c.step == 2)
    # A crash between the commit entry and the publishing rename leaves it at its home.
    os.rename(os.path.join(root, "checkpoint-2"), os.path.join(root, home_key(c2.txid, 2)))
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, home_key(c2.txid, 2))
    report = collect_garbage(r, dry_run=True)
    assert kinds(report) == [("publish", "checkpoint-2")]
    assert not os.path.exists(os.path.join(root, "checkpoint-2"))
    report = collect_garbage(r)
    assert report.items[0].done and os.path.isdir(os.path.join(root, "checkpoint-2"))
    # After a fork, an abandoned checkpoint still holding its name (crash before unpublish).
    txckpt.forget_roots()
    txckpt.resume(root, step=1)
    r = fresh(root)
    os.rename(os.path.join(root, home_key(c2.txid, 2)), os.path.join(root, "checkpoint-2"))
    report = collect_garbage(r)
    assert kinds(report) == [("unpublish", "checkpoint-2")]
    assert os.path.isdir(os.path.join(root, home_key(c2.txid, 2)))
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-1")


def test_incomplete_uploads_via_backend_hook(any_root):
    save(any_root, (1,))
    r = fresh(any_root)
    now = time.time()
    host = socket.gethostname()
    live = fake_staging(r, 2, {"host": host, "pid": os.getpid(), "time": now})
    uploads = [
        {"key": f"{TX_DIR}/{live}/checkpoint-2/big.bin", "upload_id": "u1", "initiated": now - 7200},
        {"key": f"{TX_DIR}/9-x-y/checkpoint-9/big.bin", "upload_id": "u2", "initiated": now - 7200},
        {"key": f"{TX_DIR}/10-x-y/checkpoint-10/big.bin", "upload_id": "u3", "initiated": now - 5},
        {"key": "elsewhere/big.bin", "upload_id": "u4", "initiated": now - 5},
        {"key": "elsewhere/old.bin", "upload_id": "u5", "initiated": now - 7200},
    ]
    aborted = []
    r.storage.list_incomplete_uploads = lambda: list(uploads)
    r.storage.abort_incomplete_uploads = lambda us: aborted.extend(u["upload_id"] for u in us)
    report = collect_garbage(r, dry_run=True)
    expected = [uploads[i]["key"] for i in (1, 2, 4)]
    assert [i.key for i in report.of("upload")] == expected and aborted == []
    report = collect_garbage(r)
    assert aborted == ["u2", "u3", "u5"] and all(i.done for i in report.of("upload"))
    assert sorted(i.key for i in report.kept if i.kind == "upload") == sorted([uploads[0]["key"], uploads[3]["key"]])


@pytest.mark.s3
def test_s3_abandoned_multipart_upload_is_aborted(s3_root, s3_server):
    url, options = s3_root
    txckpt.save_checkpoint(url, 1, {"w.bin": b"1" * 10}, storage_options=options)
    r = txckpt.CheckpointRoot(url, options)
    client = s3_server.boto3_client()
    bucket, prefix = url[len("s3://") :].split("/", 1)
    crashed = f"{prefix}/{TX_DIR}/2-deadbeef-0123456789/checkpoint-2/model.safetensors"
    client.create_multipart_upload(Bucket=bucket, Key=crashed)
    # A live writer's upload on this host (its intent names this process): kept.
    live_txid = f"3-{r.state().head}-abcdefabcd"
    r.storage.replace(
        f"{INTENTS_DIR}/{live_txid}.json",
        json.dumps({"txid": live_txid, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode(),
    )
    live_key = f"{prefix}/{TX_DIR}/{live_txid}/checkpoint-3/model.safetensors"
    client.create_multipart_upload(Bucket=bucket, Key=live_key)
    assert len(s3_server.multipart_uploads(prefix=prefix)) == 2
    report = collect_garbage(r, dry_run=True)
    assert [i.key for i in report.of("upload")] == [crashed[len(prefix) + 1 :]]
    report = collect_garbage(r)
    assert report.of("upload")[0].done and not report.errors
    assert [u["Key"] for u in s3_server.multipart_uploads(prefix=prefix)] == [live_key]
    txckpt.verify_checkpoint(txckpt.get_last_checkpoint(url, storage_options=options), storage_options=options)


def test_never_touches_the_log_or_committed_checkpoints_even_with_grace_zero(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2, 3))
    txckpt.forget_roots()
    txckpt.resume(root, step=2)
    save(root, (3,), "b")
    r = fresh(root)
    before = tree(root)
    report = collect_garbage(r, grace_seconds=0)
    assert report.items == [] and tree(root) == before
