"""SIGKILL a real process before and after every file operation of a tiered root's save, its
replication to the durable tier, the fast tier's retention, a rollback replicated as a fork,
and a restart on an empty fast tier; after each crash a fresh process checks protocol §14's
promises (docs/tiered.md, "What a crash leaves"):

- no checkpoint committed on the durable tier fails verification (no torn durable checkpoint);
- every checkpoint durable before the crash is still there, whole (the newest durable one is
  never deleted), and the fast tier never retired a checkpoint that is not durable;
- a restart (a new TieredRoot) looks up and loads a checkpoint whose every file verifies,
  written by one save (one tag), and resuming replicates everything left pending.
"""

import os
import shutil

import pytest
import torch

import txckpt
from tests.harness.crash_sweep import report, sweep
from txckpt.tiered import TieredRoot

pytestmark = pytest.mark.slow


def files(tag: str, step: int):
    return {
        "model.safetensors": {"w": torch.full((64,), float(step)), "tag": torch.tensor(list(tag.encode()), dtype=torch.uint8)},
        "optimizer.pt": {"state": torch.full((32,), float(step)), "tag": tag},
        "trainer_state.json": {"global_step": step, "tag": tag},
    }


def tags(data) -> set[str]:
    return {bytes(data["model.safetensors"]["tag"].tolist()).decode(), data["optimizer.pt"]["tag"],
            data["trainer_state.json"]["tag"]}


def tiers(root: str) -> TieredRoot:
    txckpt.forget_roots()
    return TieredRoot(os.path.join(root, "fast"), os.path.join(root, "durable"))


def durable_digests(root: str) -> dict[str, str]:
    d = txckpt.CheckpointRoot(os.path.join(root, "durable"))
    return {c.txid: txckpt.read_manifest(c.path).digest for c in d.checkpoints("all") if c.path}


def make_checker(allowed: set[str], before: dict[str, str]):
    def check(root: str, k: int, when: str) -> list[str]:
        v: list[str] = []
        durable = txckpt.CheckpointRoot(os.path.join(root, "durable"))
        committed = {c.txid: c for c in durable.checkpoints("all")} if durable.state().seq >= 0 else {}
        for c in committed.values():
            if c.path is None:
                if c.state != "retired":
                    v.append(f"durable checkpoint {c.txid} has no files")
                continue
            try:
                txckpt.verify_checkpoint(c.path)
            except txckpt.TxckptError as e:
                v.append(f"durable checkpoint {c.txid} fails verification: {e}")
        for txid, digest in before.items():
            c = committed.get(txid)
            if c is None or c.path is None or txckpt.read_manifest(c.path).digest != digest:
                v.append(f"durable checkpoint {txid} is gone or changed")
        fast = txckpt.CheckpointRoot(os.path.join(root, "fast"))
        if fast.state().seq >= 0:
            hist = fast.history()
            for txid in hist.retired:
                if txid not in committed:
                    v.append(f"the fast tier retired {txid}, which is not durable")
        t = tiers(root)
        last = txckpt.get_last_checkpoint(t)
        if last is None:
            v.append("lookup returned None")
        else:
            data = t.load(last)
            got = tags(data)
            if len(got) != 1 or not got <= allowed:
                v.append(f"lookup returned {last} with tags {sorted(got)}")
        # A restart: resume, and everything pending becomes durable.
        t = tiers(root)
        txckpt.resume(t)
        t.wait_durable()
        if t.pending():
            v.append(f"still pending after a restart: {[c.txid for c in t.pending()]}")
        return v

    return check


def template_with_two_durable_saves(tmp_path) -> str:
    template = str(tmp_path / "template")
    t = tiers(template)
    for s in (1, 2):
        txckpt.save_checkpoint(t, s, files(f"A-{s}", s))
    t.wait_durable()
    txckpt.forget_roots()
    return template


def test_sweep_tiered_save_replication_and_retention(tmp_path):
    template = template_with_two_durable_saves(tmp_path)
    before = durable_digests(template)

    def scenario(root):
        t = tiers(root)
        txckpt.save_checkpoint(t, 3, files("A-3", 3))
        t.wait_durable()
        t.apply_retention(txckpt.RetentionPolicy(keep_last=1))

    result = sweep("tiered save + replication + fast retention", template, str(tmp_path / "work"),
                   scenario, make_checker({"A-2", "A-3"}, before))
    assert any("durable" in op for op in result.ops) and any("fast" in op for op in result.ops)
    report(result)


def test_sweep_tiered_rollback_replicated_as_a_fork(tmp_path):
    template = template_with_two_durable_saves(tmp_path)
    before = durable_digests(template)

    def scenario(root):
        t = tiers(root)
        txckpt.resume(t, step=1)
        txckpt.save_checkpoint(t, 2, files("B-2", 2))
        t.wait_durable()

    result = sweep("tiered rollback + re-save, replicated as a fork", template, str(tmp_path / "work"),
                   scenario, make_checker({"A-2", "A-1", "B-2"}, before))
    report(result)


def test_sweep_tiered_restart_on_an_empty_fast_tier(tmp_path):
    template = template_with_two_durable_saves(tmp_path)
    shutil.rmtree(os.path.join(template, "fast"))  # a new node
    before = durable_digests(template)

    def scenario(root):
        t = tiers(root)
        txckpt.resume(t)
        txckpt.save_checkpoint(t, 3, files("A-3", 3))
        t.wait_durable()

    result = sweep("tiered restart on an empty fast tier + save", template, str(tmp_path / "work"),
                   scenario, make_checker({"A-2", "A-3"}, before))
    report(result)
