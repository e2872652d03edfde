"""The reliability campaign (issue 6) in its quick mode, and one minimal reproducer per known defect.

``test_campaign_case[<case>]``: the whole quick campaign runs once (a module fixture, < 6 minutes on
the 2-core dev machine; ``python -m tests.reliability`` is the full one, which writes
docs/reliability.md); each case then fails on any violation that no known issue explains, or on a
harness error. Violations explained by a known issue are listed in the test log. The quick mode's
samples (crash points past a case's cap, flipped bytes, power-loss states, soak cycles) are drawn
from the run's sweep seed (tests/harness/sampling.py): printed in the summary line, varied per run
so that runs together cover more, repeated with ``TXCKPT_SWEEP_SEED=<seed>``.

``test_<reproducer>``: one deterministic test per known issue (tests/reliability/known.py), marked
``xfail(strict=True)``: CI stays green while the defect is open and fails the day it is fixed, until
the mark and the KNOWN entry are removed.
"""

from __future__ import annotations

import errno
import os
import select
import shutil
import signal
import time

import pytest

import txckpt
from tests import conftest
from tests.harness import sampling
from tests.harness.procs import run_child
from tests.reliability.core import payload
from tests.reliability.known import KNOWN
from txckpt.errors import CheckpointNotFoundError, LogCorruptError, StaleLineageError, StorageError, TxckptError
from txckpt._root.root import CheckpointRoot


def _xfail(kid: str):
    return pytest.mark.xfail(strict=True, reason=f"{kid}: {KNOWN[kid].title} (see docs/reliability.md)")


# =================================================================================================
# The campaign, quick mode
# =================================================================================================
def _case_ids() -> list[str]:
    from tests.reliability.__main__ import all_cases

    return [c.id for c in all_cases()]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    from tests.reliability.__main__ import run
    from tests.reliability.report import render

    lines: list[str] = []
    seed = sampling.sweep_seed()
    results, wall, info = run(quick=True, progress=lines.append, seed=seed)
    out = tmp_path_factory.mktemp("reliability") / "reliability-quick.md"
    out.write_text(render(results, info, quick=True, wall=wall, command="pytest tests/test_reliability.py"))
    new = sum(len(r.violations) for r in results)
    known = sum(len(r.known_violations) for r in results)
    errors = sum(1 for r in results if r.error)
    points = sum(r.points for r in results)
    line = (
        f"reliability campaign (quick, seed {seed}: TXCKPT_SWEEP_SEED={seed} repeats it): {len(results)} cases, "
        f"{points} crash points/states/probes/cycles, {new} unexplained violations, {errors} harness errors, "
        f"{known} violations of {len({k for r in results for k in r.known})} known issues; {wall:.0f} s; scorecard: {out}"
    )
    conftest.SUMMARY_LINES.append(line)
    print(line)
    return {r.id: r for r in results}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case_id", _case_ids())
def test_campaign_case(campaign, case_id):
    r = campaign.get(case_id)
    if r is None:
        pytest.skip("not run here (no S3 server: moto is not installed)")
    assert r.error is None, r.error
    for v in r.known_violations[:3]:
        print(f"known ({', '.join(r.known)}): {v[:300]}")
    assert not r.violations, "\n".join(r.violations[:20])


# =================================================================================================
# Minimal reproducers of the known issues
# =================================================================================================
@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "root")


def _save(root: str, step: int, tag: str) -> str:
    return txckpt.save_checkpoint(root, step, payload(tag, step))


# Regression test of KI-fence, fixed in the core (was a strict xfail).
def test_zombie_beside_its_restart_is_fenced(root):
    zombie = CheckpointRoot(root)  # the old job (one CheckpointRoot = one process's view)
    zombie.save(2, payload("Z-2", 2))
    zombie.save(4, payload("Z-4", 4))
    restart = CheckpointRoot(root)  # its restart: resume_from_checkpoint=True
    restart.resume()
    restart.save(6, payload("R-6", 6))
    with pytest.raises(StaleLineageError):
        zombie.save(8, payload("Z-8", 8))  # today: commits step 8 on top of the restart's 6


# Regression test of KI-lease, fixed in the core (was a strict xfail).
def test_lease_is_refused_once_deletion_began(root):
    from txckpt._maintenance.leases import acquire_reader_lease
    from txckpt._maintenance.retention import retire

    paths = [_save(root, s, f"W-{s}") for s in (1, 2, 3)]
    txid = txckpt.read_manifest(paths[1]).txid
    retire(CheckpointRoot(root), [txid])  # phase one of a rotation: its data is about to go
    with pytest.raises(CheckpointNotFoundError):
        acquire_reader_lease(CheckpointRoot(root), txid)  # was: granted


# Regression test of KI-lease-order, fixed in the core (was a strict xfail).
def test_finish_retired_reads_leases_after_the_retired_set(root, monkeypatch):
    from txckpt._maintenance.leases import acquire_reader_lease
    from txckpt._maintenance import retention

    paths = [_save(root, s, f"W-{s}") for s in (1, 2, 3)]
    txid = txckpt.read_manifest(paths[1]).txid
    real = retention.read_leases
    calls = []

    def between(storage, now=None):
        out = real(storage, now)
        if not calls:
            calls.append(1)
            # After this deleter read the leases: a reader leases step 2 and checks it is not retired;
            # then another process's rotation (which decided earlier) retires it.
            acquire_reader_lease(CheckpointRoot(root), txid)
            assert txid not in CheckpointRoot(root).history().retired
            retention.retire(CheckpointRoot(root), [txid])
        return out

    monkeypatch.setattr(retention, "read_leases", between)
    retention.finish_retired(CheckpointRoot(root))
    r = CheckpointRoot(root)
    assert r.locate(r.history().checkpoints[txid].ref) is not None, "a leased checkpoint was deleted"


def test_adopt_on_an_object_store(memory_root):
    """Found by the campaign (adoption raised TypeError on fsspec backends), fixed in the core since."""
    from tests.reliability.core import write_legacy

    url, so = memory_root
    r = CheckpointRoot(url, so)
    write_legacy(r.storage, "checkpoint-2", "L-2", 2)
    path = txckpt.save_checkpoint(url, 4, payload("A-4", 4), storage_options=so)  # adopts first
    assert txckpt.get_last_checkpoint(url, storage_options=so) == path


# Regression test of KI-dirsync, fixed in the core (was a strict xfail).
@pytest.mark.process  # the save is recorded in a child (tests/reliability/powerloss.py)
def test_power_cut_after_commit_keeps_the_checkpoint(tmp_path):
    """Record a save; cut the power right after log/ is fsynced following the commit entry's link
    (the commit is durable: protocol.md section 8), losing every directory entry POSIX lets go."""
    from tests.reliability import powerloss as pl
    from tests.reliability.core import Ctx

    ctx = Ctx(str(tmp_path / "work"), True)
    os.makedirs(ctx.workdir)
    rec = pl.record(ctx, "save")
    m, _ = pl.load_prestate(rec["pre"])
    effects = pl.replay(m, rec["base"], rec["events"])
    _, log_fsync = pl.commit_points(rec["events"], rec["base"])
    space = pl.StateSpace(m, effects, log_fsync + 1, "posix")
    lost = {u[0]: u[2] for u in space.meta_units}  # every unsynced entry operation lost
    state = space.build(lost, {u[0]: len(u[1]) for u in space.data_units})
    target = str(tmp_path / "after-power-cut")
    state.materialize(target)
    last = txckpt.get_last_checkpoint(os.path.join(target, "root"))
    assert last is not None and txckpt.read_manifest(last).step == 4, (
        f"the durable commit of step 4 lost its data: {last}"
    )


# Regression test of KI-log-unprotected, fixed in the core (was a strict xfail).
def test_flipped_byte_in_a_log_entry_is_detected(root):
    from txckpt._maintenance.gc import collect_garbage
    from txckpt._base.layout import entry_key

    for s in (2, 4, 6):
        _save(root, s, f"A-{s}")
    txckpt.resume(root, step=2)  # are abandoned: their data lives in .txckpt/tx/<txid>
    _save(root, 4, "B-4")
    txckpt.forget_roots()
    hist = CheckpointRoot(root).history()
    a4 = next(e for e in hist.entries if e["action"] == "commit" and e["checkpoint"]["step"] == 4)
    home = os.path.join(root, ".txckpt", "tx", a4["checkpoint"]["txid"])
    p = os.path.join(root, *entry_key(a4["seq"]).split("/"))
    data = bytearray(open(p, "rb").read())
    i = data.index(a4["checkpoint"]["txid"].encode()) + len(a4["checkpoint"]["txid"]) - 1
    data[i] ^= 0x01  # one bit of the txid, inside the commit entry
    open(p, "wb").write(bytes(data))
    try:
        collect_garbage(CheckpointRoot(root))
    except LogCorruptError:
        pass
    assert os.listdir(os.path.join(home, "checkpoint-4")), "gc deleted a committed checkpoint's data"
    with pytest.raises(LogCorruptError):
        CheckpointRoot(root).history()


# Regression test of KI-log-rollback, fixed in the core (was a strict xfail).
def test_a_deleted_newest_log_entry_is_not_silent(root, txlog):
    from txckpt._base.layout import entry_key

    _save(root, 2, "A-2")
    newest = _save(root, 4, "A-4")
    txckpt.forget_roots()
    seq = CheckpointRoot(root).state().seq
    os.unlink(os.path.join(root, *entry_key(seq).split("/")))  # the newest commit entry is lost
    txckpt.forget_roots()
    try:
        last = txckpt.get_last_checkpoint(root)
    except LogCorruptError:
        return  # a typed error is fine
    assert last == newest or "missing" in txlog.text or "verify" in txlog.text, (
        f"lookup silently returned {last} instead of {newest}"
    )


# Regression test of KI-gc-clock, fixed in the core (was a strict xfail).
def test_gc_keeps_a_live_writers_staging_when_its_clock_is_behind(root, monkeypatch):
    from txckpt._maintenance.gc import collect_garbage

    _save(root, 1, "W-1")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)  # this writer's clock is an hour behind
    tx = txckpt.transaction(root, 2)
    tx.__enter__()
    monkeypatch.setattr(time, "time", real)
    try:
        tx.save("a.dat", b"x" * 100)
        # gc in another process (gc takes its own pid for alive)
        code, out = run_child(
            lambda: [i.key for i in collect_garbage(CheckpointRoot(root)).items if i.kind == "staging"]
        )
        assert code == 0, out
        assert out["ok"] == [], f"gc removed the live writer's staging: {out['ok']}"
    finally:
        tx.__exit__(None, None, None)


# Regression test of KI-commit-missing, fixed in the core (was a strict xfail).
def test_commit_refuses_when_the_staging_vanished(root):
    _save(root, 1, "W-1")
    tx = txckpt.transaction(root, 2)
    with pytest.raises(TxckptError):
        with tx:
            tx.save("a.dat", b"x" * 100)
            shutil.rmtree(os.path.dirname(tx.directory))  # gc, or an operator, removed the staging
    txckpt.forget_roots()
    assert txckpt.read_manifest(txckpt.get_last_checkpoint(root)).step == 1


# Regression test of KI-storage-untyped, fixed in the core (was a strict xfail).
def test_enospc_writing_the_intent_is_a_storage_error(root, monkeypatch):
    from txckpt._storage.local.store import LocalStorage

    _save(root, 1, "W-1")
    real = LocalStorage.replace

    def full(self, key, data, *, durable=False):
        if key.startswith(".txckpt/intents/"):
            raise OSError(errno.ENOSPC, "No space left on device", key)
        return real(self, key, data, durable=durable)

    monkeypatch.setattr(LocalStorage, "replace", full)
    with pytest.raises(StorageError):
        txckpt.save_checkpoint(root, 2, payload("W-2", 2))


# Regression test of KI-enospc-staging-fork, fixed in the core (was a strict xfail).
def test_enospc_making_the_staging_directory_is_a_storage_error(root, monkeypatch):
    _save(root, 1, "W-1")
    real = os.mkdir

    def full(path, *args, **kwargs):
        if "/.txckpt/tx/" in os.fsdecode(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", full)
    with pytest.raises(StorageError):
        txckpt.save_checkpoint(root, 2, payload("W-2", 2))
    # The save left nothing: neither its intent nor a part of its staging.
    assert os.listdir(os.path.join(root, ".txckpt", "intents")) == []
    assert not [t for t in os.listdir(os.path.join(root, ".txckpt", "tx")) if t.startswith("2-")]


# Regression test of KI-enospc-staging-fork, fixed in the core (was a strict xfail).
def test_fork_with_a_full_disk_while_unpublishing_raises_only_typed_errors(root, monkeypatch):
    """The other half of KI-enospc-staging-fork (kept separate so that each half's fix shows)."""
    import txckpt._storage.local.store as local

    for s in (2, 4, 6):
        _save(root, s, f"A-{s}")
    txckpt.forget_roots()

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    monkeypatch.setattr(local, "rename_noreplace", full)
    try:
        txckpt.resume(root, step=2)  # today: a plain OSError, after the fork entry was appended
    except TxckptError:
        pass


# Regression test of KI-enospc-torch-save, fixed in the core (was a strict xfail).
def test_enospc_inside_torch_save_is_a_storage_error(root, monkeypatch):
    import torch

    from txckpt._storage.local import store as local

    _save(root, 1, "W-1")
    real = local._DurableFile.write
    calls = []

    def write(self, data):
        calls.append(1)
        if len(calls) == 3:  # the third write of torch.save's zip stream
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(local._DurableFile, "write", write)
    with pytest.raises(StorageError):
        txckpt.save_checkpoint(root, 2, {"optimizer.pt": {"state": torch.ones(100), "steps": list(range(50))}})


def test_load_follows_a_checkpoint_published_after_lookup(root, monkeypatch):
    from txckpt._log.publication import RenamePublication

    _save(root, 1, "W-1")
    seen = {}
    real = RenamePublication.publish

    def publish(self, ref, *args, **kwargs):
        seen["path"] = CheckpointRoot(root).get_last_checkpoint()  # a reader, between commit and rename
        return real(self, ref, *args, **kwargs)

    monkeypatch.setattr(RenamePublication, "publish", publish)
    _save(root, 2, "W-2")
    assert "/.txckpt/tx/" in seen["path"]  # the reader got the home path
    txckpt.load_checkpoint(seen["path"])  # follows the txid to checkpoint-2 (protocol §6a)


# Regression test of KI-lookup-outpaced (concurrency/*/readers-polling on a loaded machine).
def test_lookup_is_not_none_when_rotation_deletes_the_tip_it_read(root, monkeypatch):
    from txckpt._log import log as commit_log
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention

    writer = CheckpointRoot(root)
    for s in (1, 2, 3):
        writer.save(s, payload(f"W-{s}", s))
    real, held = commit_log.read_state, []

    def read_state(storage):  # the reader, held between its read of the log and its next request
        out = real(storage)
        if not held:
            held.append(out.seq)
            for s in (4, 5):
                writer.save(s, payload(f"W-{s}", s))
                apply_retention(writer, RetentionPolicy(keep_last=2))
        return out

    monkeypatch.setattr(commit_log, "read_state", read_state)
    path = CheckpointRoot(root).get_last_checkpoint()
    assert path is not None and txckpt.read_manifest(path).step == 5


# Regression test of KI-fold-hint-race (concurrency/s3/readers-polling on a loaded machine).
def test_a_commit_landing_while_the_history_is_folded_is_not_taken_for_lost_entries(root, monkeypatch):
    """Another process commits between the fold's last probe (the entry after the end: absent)
    and the end of the fold: its entry and hint are newer than what the fold read, which is not
    a damaged log (it was reported as one, to readers polling an S3 root during commits)."""
    import subprocess
    import sys

    from txckpt._log import log as commit_log

    for step in (1, 2, 3):
        txckpt.save_checkpoint(root, step, {"a.bin": b"%d" % step})
    txckpt.forget_roots()
    storage = CheckpointRoot(root).storage
    end = commit_log.read_history(storage, snapshots=False).state.seq
    real = commit_log.read_entry
    landed = []

    def read_entry(st, seq):
        got = real(st, seq)
        if got is None and seq == end + 1 and not landed:  # the probe past the end: now commit
            landed.append(
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        "import sys, txckpt; txckpt.save_checkpoint(sys.argv[1], 4, {'a.bin': b'4'})",
                        root,
                    ],
                    env=dict(os.environ, PYTHONPATH=os.getcwd()),
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            )
        return got

    monkeypatch.setattr(commit_log, "read_entry", read_entry)
    history = commit_log.read_history(storage, snapshots=False)
    assert landed and landed[0].returncode == 0, landed and landed[0].stderr
    assert history.state.seq == end  # the fold as it read it; the next one sees the commit
    monkeypatch.setattr(commit_log, "read_entry", real)
    assert commit_log.read_history(storage, snapshots=False).state.seq > end  # its claim and commit


def test_every_known_issue_has_a_reproducer():
    from tests.reliability.known import FIXED

    names = {n for n in globals() if n.startswith("test_")}
    for k in KNOWN.values():
        assert k.reproducer in names, f"{k.id}: no test named {k.reproducer}"
    for f in FIXED:
        assert f.regression in names, f"{f.id}: no regression test named {f.regression}"
        assert f.id not in KNOWN, f"{f.id} is both known (open) and fixed"


def test_forged_manifest_is_refused_by_load(root):
    import json as _json

    from txckpt._manifest.manifest import _digest

    path = _save(root, 2, "A-2")
    mpath = os.path.join(path, txckpt.MANIFEST_NAME)
    body = _json.load(open(mpath))
    body.pop("digest")
    dropped = sorted(body["files"])[0]
    del body["files"][dropped]
    body["digest"] = _digest(body)  # forged: the self-digest matches the edited content
    open(mpath, "w").write(_json.dumps(body))
    with pytest.raises(TxckptError):
        txckpt.load_checkpoint(path)


# =================================================================================================
# The campaign's own harness: a broken or hung case is reported by name, never a silent hang
# =================================================================================================
def _hang_with_a_helper(ctx, case, result) -> None:
    """A case that hangs, after starting a helper process of its own (as actors and ranks do)."""
    helper = os.fork()
    if helper == 0:
        signal.pause()
        os._exit(0)
    with open(ctx.path("helper.pid"), "w") as f:
        f.write(str(helper))
    signal.pause()


def _quick_case(ctx, case, result) -> None:
    result.points = 1


@pytest.mark.process
def test_a_hung_case_is_killed_at_its_limit_with_what_it_started(tmp_path):
    """CI once lost its whole campaign tier to one case waiting forever on an actor that had
    died: the scheduler now kills a case past its limit, with its helpers, and names it."""
    from tests.reliability.core import Case, Ctx, run_cases

    cases = [
        Case("x/local/hangs", "crash", "hangs", "local", _hang_with_a_helper),
        Case("x/local/quick", "crash", "quick", "local", _quick_case),
    ]
    t0 = time.monotonic()
    results = {
        r.id: r
        for r in run_cases(cases, Ctx(str(tmp_path), True), workers=2, case_limit=3.0, progress=lambda line: None)
    }
    assert time.monotonic() - t0 < 120
    assert results["x/local/quick"].error is None and results["x/local/quick"].points == 1
    err = results["x/local/hangs"].error
    assert err is not None and "limit" in err, err
    pid = int((tmp_path / "x_local_hangs" / "helper.pid").read_text())
    # The helper was the hung case's child: SIGKILLed with it. A kill is delivered, not awaited:
    # wait for its exit on a pidfd (readable once the process has exited, child of ours or not).
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone and reaped already
    try:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, f"the hung case's helper {pid} still runs 60 s after its case was killed"
    finally:
        os.close(fd)


@pytest.mark.process
def test_an_actor_told_to_pause_where_nothing_is_says_so():
    """A pause spec naming a function that moved (the commit room's move left
    ``CheckpointRoot.commit`` in the campaign's specs) is an error the case sees at once."""
    from tests.reliability.actors import Actor

    a = Actor("probe", timeout=60)
    try:
        with pytest.raises(RuntimeError, match="cannot pause txckpt._root.root:CheckpointRoot.no_such"):
            a.pause("txckpt._root.root:CheckpointRoot.no_such")
        a.pause("txckpt._save.transactions:append_commit")  # the commit point's owner today
        a.unpause("txckpt._save.transactions:append_commit")
    finally:
        a.stop()


def _die(state, code: int) -> None:
    os._exit(code)


@pytest.mark.process
def test_an_actor_that_dies_is_reported_at_the_next_wait():
    from tests.reliability.actors import Actor

    a = Actor("victim", timeout=120)
    a.send(_die, 3)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="died \\(exit 3\\)"):
        a.wait()
    assert time.monotonic() - t0 < 60  # not the 120-second timeout


@pytest.mark.process
def test_a_forked_child_runs_parallel_torch_kernels_after_the_parent_used_its_thread_pool():
    """The campaign forks its cases from a pytest process whose OpenMP pool earlier tests started;
    a child's first parallel kernel then waited forever for the parent's pool threads (the CI
    campaign hung on the incremental scenarios' 2 MiB tensor). run_child's children (and the
    campaign's cases and actors) run torch on one thread."""
    import torch

    torch.arange(1 << 22, dtype=torch.float32).sum()  # the parent's pool is up
    code, out = run_child(lambda: float(torch.arange(1 << 19, dtype=torch.float32).sum()), timeout=60)
    assert code == 0 and out == {"ok": float((1 << 19) * ((1 << 19) - 1) // 2)}, out
