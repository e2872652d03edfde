"""A session's first save reclaims what dead writers left (protocol §8 step 12), by gc's rules:
a SIGKILLed save's staging and intent go; a live writer's staging (a real process paused in
the middle of its save), a recent intent of another host, and a committed checkpoint's home
stay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

import txckpt
from txckpt._maintenance.gc import collect_garbage
from txckpt._base.layout import INTENTS_DIR, TX_DIR, home_key

BIG = 4 << 20  # the killed save's staged bytes

# A writer process. Modes:
#   kill:   resume, stage step STEP (a BIG file, uploaded), then SIGKILL itself mid-save
#   kill-after-commit: resume, save step STEP, SIGKILL itself when the commit deletes its intent
#   pause:  resume, stage step STEP, print "staged TXID", wait for a line on stdin, then commit
#   save:   resume, save step STEP, print the path
WRITER = (
    r"""
import json, os, signal, sys
import txckpt
mode, root, options, step = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) or None, int(sys.argv[4])
txckpt.resume(root, storage_options=options)
if mode == "kill-after-commit":
    import txckpt._log.commit
    txckpt._log.commit.clear_intent = lambda root, txid: os.kill(os.getpid(), signal.SIGKILL)
if mode in ("save", "kill-after-commit"):
    print(txckpt.save_checkpoint(root, step, {"w.bin": b"s" * 1000}, storage_options=options), flush=True)
    sys.exit(0)
with txckpt.transaction(root, step, storage_options=options) as tx:
    tx.save("big.bin", os.urandom(%d))
    tx._writes.wait()  # its upload has landed (object stores upload in the background)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("staged", tx.txid, flush=True)
    sys.stdin.readline()
"""
    % BIG
)


def writer(mode: str, root: str, step: int, options: dict | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TXCKPT_DURABLE": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, mode, root, json.dumps(options), str(step)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def run_writer(mode: str, root: str, step: int, options: dict | None = None) -> tuple[int, str]:
    p = writer(mode, root, step, options)
    out, err = p.communicate(timeout=120)
    return p.returncode, out + err


def txids_staged(r: txckpt.CheckpointRoot) -> set[str]:
    return set(r.storage.list_dir(TX_DIR))


def intents(r: txckpt.CheckpointRoot) -> set[str]:
    return {n[: -len(".json")] for n in r.storage.list_dir(INTENTS_DIR)}


def uncommitted(r: txckpt.CheckpointRoot) -> set[str]:
    return txids_staged(r) - set(r.history().checkpoints)


def fresh(root: str, options: dict | None = None) -> txckpt.CheckpointRoot:
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(root, options)


def fake_intent_staging(r: txckpt.CheckpointRoot, step: int, host: str, age: float) -> str:
    txid = f"{step}-{r.state().head}-{uuid.uuid4().hex[:10]}"
    r.storage.replace(f"{home_key(txid, step)}/w.bin", b"partial")
    record = {
        "txid": txid,
        "step": step,
        "lineage": r.state().head,
        "world_size": 1,
        "host": host,
        "pid": 1,
        "time": time.time() - age,
    }
    r.storage.replace(f"{INTENTS_DIR}/{txid}.json", json.dumps(record).encode())
    return txid


def killed_save_is_reclaimed_by_the_next_save(root: str, options: dict | None) -> None:
    code, out = run_writer("save", root, 1, options)
    assert code == 0, out
    code, out = run_writer("kill", root, 2, options)
    assert code == -signal.SIGKILL, out
    r = fresh(root, options)
    (dead,) = uncommitted(r)
    assert dead in intents(r)
    assert sum(size for _, size in r.storage.walk_files(f"{TX_DIR}/{dead}")) == BIG
    committed_homes = txids_staged(r) - {dead}

    code, out = run_writer("save", root, 2, options)  # the restarted job's first save
    assert code == 0, out

    r = fresh(root, options)
    assert uncommitted(r) == set() and intents(r) == set()
    assert not r.storage.exists(f"{TX_DIR}/{dead}")
    assert committed_homes <= txids_staged(r)  # homes of committed checkpoints stay
    last = txckpt.get_last_checkpoint(root, storage_options=options)
    assert txckpt.read_manifest(last, storage_options=options).step == 2
    for c in r.checkpoints("all"):
        txckpt.verify_checkpoint(c.path, storage_options=options)
    assert [i for i in collect_garbage(r, dry_run=True).items if i.kind in ("staging", "intent")] == []


pytestmark = pytest.mark.non_durable  # TXCKPT_DURABLE=0 for every test here (tests/conftest.py)


def test_a_restarted_save_reclaims_the_staging_of_a_killed_save(tmp_path):
    killed_save_is_reclaimed_by_the_next_save(str(tmp_path / "out"), None)


@pytest.mark.s3
def test_a_restarted_save_reclaims_a_killed_saves_staging_on_s3(s3_root):
    killed_save_is_reclaimed_by_the_next_save(*s3_root)


def test_the_first_save_keeps_live_writers_and_committed_homes(tmp_path):
    root = str(tmp_path / "out")
    code, out = run_writer("save", root, 1)
    assert code == 0, out
    # Killed after its commit and publication, before deleting its intent: committed.
    code, out = run_writer("kill-after-commit", root, 2)
    assert code == -signal.SIGKILL, out
    r = fresh(root)
    (committed,) = intents(r)
    assert committed in r.history().checkpoints
    remote_young = fake_intent_staging(r, 7, "elsewhere", 60)
    remote_old = fake_intent_staging(r, 8, "elsewhere", 7200)
    # A live writer, paused in the middle of its save (its file is staged).
    live = writer("pause", root, 3, stdin=subprocess.PIPE)
    try:
        line = live.stdout.readline()
        assert line.startswith("staged "), line + live.stderr.read()
        live_txid = line.split()[1]
        assert live_txid in uncommitted(fresh(root))

        code, out = run_writer("save", root, 3)  # a fresh session's first save
        assert code == 0, out

        r = fresh(root)
        assert uncommitted(r) == {live_txid, remote_young}
        assert intents(r) == {live_txid, remote_young}
        assert sum(size for _, size in r.storage.walk_files(f"{TX_DIR}/{live_txid}")) == BIG
        assert not r.storage.exists(f"{TX_DIR}/{remote_old}")
        c2 = r.history().checkpoints[committed]
        assert os.path.isdir(os.path.join(root, TX_DIR, committed))  # its (empty) home stays
        txckpt.verify_checkpoint(r.locate(c2.ref))
    finally:
        # The paused writer goes on: the save above claimed the lineage, so its commit is
        # refused and it deletes its own staging.
        out, err = live.communicate("go\n", timeout=120)
    assert live.returncode != 0 and "StaleLineageError" in err, out + err
    r = fresh(root)
    assert uncommitted(r) == {remote_young}


def test_what_the_reclaim_costs_a_save(tmp_path, monkeypatch):
    """With no intent of a gone writer, the session's first save lists intents/ and nothing
    else (no tx/ listing, no history fold); later saves of the session not even that."""
    root = str(tmp_path / "out")
    txckpt.CheckpointRoot(root).save(1, {"w.bin": b"1"})
    r = fresh(root)
    listed: list[str] = []
    real = r.storage.list_dir

    def list_dir(key):
        listed.append(key)
        return real(key)

    monkeypatch.setattr(r.storage, "list_dir", list_dir)
    r.save(2, {"w.bin": b"2"})
    assert listed.count(INTENTS_DIR) == 1 and TX_DIR not in listed
    assert r.folded_history is None  # the history was not folded
    listed.clear()
    r.save(3, {"w.bin": b"3"})
    r.save(4, {"w.bin": b"4"})
    assert INTENTS_DIR not in listed and TX_DIR not in listed


def test_a_failing_reclaim_does_not_fail_the_save(tmp_path, monkeypatch, txlog):
    root = str(tmp_path / "out")
    r = txckpt.CheckpointRoot(root)
    real = r.storage.list_dir

    def list_dir(key):
        if key == INTENTS_DIR:
            raise PermissionError(13, "Permission denied", key)
        return real(key)

    monkeypatch.setattr(r.storage, "list_dir", list_dir)
    path = r.save(1, {"w.bin": b"1"})
    assert path == os.path.join(root, "checkpoint-1") and txckpt.get_last_checkpoint(root) == path
    assert "reclaiming the staging of dead writers" in txlog.text and "txckpt gc" in txlog.text


def test_reclaiming_a_killed_saves_staging_is_a_warning_that_names_it(tmp_path, txlog):
    """A reclaim means an earlier process died in the middle of a save: shown at the default
    verbosity (WARNING), naming the staging, its step and bytes, and that nothing committed went."""
    root = str(tmp_path / "out")
    txckpt.CheckpointRoot(root).save(1, {"w.bin": b"1"})
    r = fresh(root)
    dead = fake_intent_staging(r, 2, host="another-host", age=10**6)
    r.save(2, {"w.bin": b"2"})  # this session's first save reclaims it
    assert dead not in txids_staged(fresh(root))
    (record,) = [rec for rec in txlog.records if dead in rec.getMessage()]
    text = record.getMessage()
    assert record.levelname == "WARNING" and record.name.startswith("txckpt")
    assert f"{TX_DIR}/{dead}" in text and "step 2" in text and f"{len(b'partial')} bytes" in text
    assert "never committed" in text and "nothing committed was lost" in text
