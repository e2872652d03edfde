"""SIGKILL a real process before and after every file operation of a tiered root's save, its
replication to the durable tier, the fast tier's retention, a rollback replicated as a fork,
and a restart on an empty fast tier; after each crash a fresh process checks protocol §14's
promises (docs/tiered.md, "What a crash leaves"):

- no checkpoint committed on the durable tier fails verification (no torn durable checkpoint);
- every checkpoint durable before the crash is still there, whole (the newest durable one is
  never deleted), and the fast tier never retired a checkpoint that is not durable;
- a restart (a new TieredRoot) looks up and loads a checkpoint whose every file verifies,
  written by one save (one tag), and resuming replicates everything left pending.

In the campaign each of the three local sweeps tries every point around an operation that flips
what a reader sees (a manifest, log entry or `latest` put in place, a publication) and a seeded
40% of the others; the seed is in the summary line (`TXCKPT_SWEEP_SEED=<seed>` repeats a draw)
and varies per run, so the runs cover every point between them; `TXCKPT_FULL_SWEEP=1` tries every
point (tests/harness/sampling.py). The SeaweedFS sweeps kill before and after each mutating request
the same way: every point around a request that puts a manifest, log entry or `latest` and a seeded
40% of the others (a point costs ~6 s there: the 44 points of both took 221 s of the campaign).
"""

import os
import shutil

import pytest

import txckpt
from tests.harness.crash_sweep import report, s3_request_sweep, sweep
from tests.test_crash_sweep import files  # a three-file checkpoint whose every file carries a tag
from txckpt._tiered.tiered import TieredRoot

pytestmark = pytest.mark.slow


def tags(data) -> set[str]:
    return {
        bytes(data["model.safetensors"]["tag"].tolist()).decode(),
        data["optimizer.pt"]["tag"],
        data["trainer_state.json"]["tag"],
    }


def tiers(root: str) -> TieredRoot:
    txckpt.forget_roots()
    return TieredRoot(os.path.join(root, "fast"), os.path.join(root, "durable"))


def durable_digests(root: str) -> dict[str, str]:
    d = txckpt.CheckpointRoot(os.path.join(root, "durable"))
    return {c.txid: txckpt.read_manifest(c.path).digest for c in d.checkpoints("all") if c.path}


def violations(fast: str, durable_url: str, so: dict, allowed: set[str], before: dict[str, str]) -> list[str]:
    """protocol §14's promises after a crash, checked by a fresh process (module doc)."""
    v: list[str] = []
    durable = txckpt.CheckpointRoot(durable_url, so)
    committed = {c.txid: c for c in durable.checkpoints("all")} if durable.state().seq >= 0 else {}
    for c in committed.values():
        if c.path is None:
            if c.state != "retired":
                v.append(f"durable checkpoint {c.txid} has no files")
            continue
        try:
            txckpt.verify_checkpoint(c.path, storage_options=so)
        except txckpt.TxckptError as e:
            v.append(f"durable checkpoint {c.txid} fails verification: {e}")
    for txid, digest in before.items():
        c = committed.get(txid)
        if c is None or c.path is None or txckpt.read_manifest(c.path, storage_options=so).digest != digest:
            v.append(f"durable checkpoint {txid} is gone or changed")
    fast_root = txckpt.CheckpointRoot(fast)
    if fast_root.state().seq >= 0:
        for txid in fast_root.history().retired:
            if txid not in committed:
                v.append(f"the fast tier retired {txid}, which is not durable")
    txckpt.forget_roots()
    t = TieredRoot(fast, durable_url, so)
    last = txckpt.get_last_checkpoint(t)
    if last is None:
        v.append("lookup returned None")
    else:
        got = tags(t.load(last))
        if len(got) != 1 or not got <= allowed:
            v.append(f"lookup returned {last} with tags {sorted(got)}")
    # A restart: resume, and everything pending becomes durable.
    txckpt.forget_roots()
    t = TieredRoot(fast, durable_url, so)
    txckpt.resume(t)
    t.wait_durable()
    if t.pending():
        v.append(f"still pending after a restart: {[c.txid for c in t.pending()]}")
    return v


def make_checker(allowed: set[str], before: dict[str, str]):
    def check(root: str, k: int, when: str) -> list[str]:
        return violations(os.path.join(root, "fast"), os.path.join(root, "durable"), {}, allowed, before)

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

    result = sweep(
        "tiered save + replication + fast retention",
        template,
        str(tmp_path / "work"),
        scenario,
        make_checker({"A-2", "A-3"}, before),
        sampled=True,
    )
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

    result = sweep(
        "tiered rollback + re-save, replicated as a fork",
        template,
        str(tmp_path / "work"),
        scenario,
        make_checker({"A-2", "A-1", "B-2"}, before),
        sampled=True,
    )
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

    result = sweep(
        "tiered restart on an empty fast tier + save",
        template,
        str(tmp_path / "work"),
        scenario,
        make_checker({"A-2", "A-3"}, before),
        sampled=True,
    )
    report(result)


@pytest.mark.seaweedfs
@pytest.mark.parametrize("case", ["save", "restart"])
def test_sweep_tiered_replication_to_seaweedfs_at_every_mutating_request(tmp_path, seaweedfs_cluster, case):
    """The durable tier on SeaweedFS: SIGKILL before and after the mutating S3 requests of
    ``save``: a tiered save, its replication and the fast tier's retention; ``restart``: a new
    node (an empty fast tier) resuming, which restores the durable tip onto the fast tier and
    claims the lineage on the durable tier, then a save and its replication. (The fast tier's
    own file operations are the local sweeps'.) Each crash point gets a copy of the template's
    fast directory (``restart``: an empty one) and a server-side copy of its durable prefix. The
    points are sampled as the local sweeps' are (the module's doc); ``TXCKPT_FULL_SWEEP=1``: all."""
    from tests.harness.backends import SEAWEEDFS_BUCKET
    from tests.harness.procs import run_child
    from tests.reliability.s3 import copy_prefix

    so, client = seaweedfs_cluster.storage_options(), seaweedfs_cluster.boto3_client()
    base = f"tiered-sweep-{case}-{os.getpid()}-{id(tmp_path) & 0xFFFF:x}"
    url = lambda prefix: f"s3://{SEAWEEDFS_BUCKET}/{base}/{prefix}"  # noqa: E731
    template_fast = str(tmp_path / "template-fast")

    def build():  # in a child: the parent never starts s3fs's event loop before it forks
        txckpt.forget_roots()
        t = TieredRoot(template_fast, url("template"), so)
        for s in (1, 2):
            txckpt.save_checkpoint(t, s, files(f"A-{s}", s))
        t.wait_durable()
        d = txckpt.CheckpointRoot(url("template"), so)
        return {c.txid: txckpt.read_manifest(c.path, storage_options=so).digest for c in d.checkpoints("all")}

    code, out = run_child(build, timeout=300)
    assert code == 0 and "ok" in out, out
    before = out["ok"]

    def scenario(fast: str, durable_url: str):
        txckpt.forget_roots()
        t = TieredRoot(fast, durable_url, so)
        if case == "restart":
            txckpt.resume(t)
        txckpt.save_checkpoint(t, 3, files("A-3", 3))
        t.wait_durable()
        if case == "save":
            t.apply_retention(txckpt.RetentionPolicy(keep_last=1))

    def fresh(name: str) -> tuple[str, str]:
        fast = str(tmp_path / f"{name}-fast")
        if case == "save":
            shutil.copytree(template_fast, fast, symlinks=True)
        copy_prefix(client, SEAWEEDFS_BUCKET, f"{base}/template", f"{base}/{name}")
        return fast, url(name)

    _, every, _, found = s3_request_sweep(
        f"tiered {case} to SeaweedFS",
        base,
        fresh,
        lambda copy: scenario(*copy),
        lambda copy: violations(copy[0], copy[1], so, {"A-2", "A-3"}, before),
        done=lambda copy: shutil.rmtree(copy[0], ignore_errors=True),
    )
    assert len(every) >= 10 and not found, "\n".join(found[:20])
