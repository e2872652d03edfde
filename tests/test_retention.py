"""Retention policies: what they keep, and the crash safety of the two-phase deletion."""

from __future__ import annotations

import json
import os

import pytest

import txckpt
from txckpt._maintenance.gc import collect_garbage
from txckpt._maintenance.retention import RetentionPolicy, apply_retention, retire, rewind
from txckpt._maintenance.leases import acquire_reader_lease, release_reader_lease


pytestmark = pytest.mark.non_durable  # TXCKPT_DURABLE=0 for every test here (tests/conftest.py)


def save(root, steps, tag="a"):
    for s in steps:
        txckpt.save_checkpoint(root, s, {"w.bin": f"{tag}{s}".encode() * 20, "meta.json": {"step": s, "tag": tag}})


def fresh(root) -> txckpt.CheckpointRoot:
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(root)


def steps_of(checkpoints) -> list[int]:
    return sorted(c.step for c in checkpoints)


def published(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("checkpoint-"))


@pytest.fixture
def any_root(url_root):
    """A root URL on each backend, without storage options (tests/harness/backends.py)."""
    return url_root


# ----- the pure decision -------------------------------------------------------------------------
def test_keep_last(any_root):
    save(any_root, range(1, 7))
    r = fresh(any_root)
    policy = RetentionPolicy(keep_last=2)
    assert steps_of(policy.decide(r.history())) == [1, 2, 3, 4]
    gone = apply_retention(r, policy)
    assert steps_of(gone) == [1, 2, 3, 4] and all(i.state == "current" for i in gone)
    r = fresh(any_root)
    infos = {c.step: c for c in r.checkpoints("all")}
    assert [s for s, c in infos.items() if c.state == "retired"] == [1, 2, 3, 4]
    assert all(infos[s].path is None for s in (1, 2, 3, 4))
    assert txckpt.get_last_checkpoint(any_root) == infos[6].path
    for s in (5, 6):
        txckpt.verify_checkpoint(infos[s].path)
    if "://" not in any_root:
        assert published(any_root) == [5, 6]
        assert sorted(os.listdir(os.path.join(any_root, ".txckpt", "tx"))) == sorted(
            c.txid for c in r.checkpoints("all") if c.step in (5, 6)
        )
    # One retire entry, and it left the state unchanged.
    entries = [e for e in r.history().entries if e["action"] == "retire"]
    assert len(entries) == 1 and len(entries[0]["txids"]) == 4
    prev = r.history().entries[entries[0]["seq"] - 1]
    assert entries[0]["head"] == prev["head"]
    assert apply_retention(r, policy) == []  # idempotent
    with pytest.raises(txckpt.errors.CheckpointNotFoundError, match="retention"):
        txckpt.resume(any_root, step=3)


def test_keep_every_and_last(tmp_path):
    root = str(tmp_path / "out")
    save(root, range(1, 11))
    policy = RetentionPolicy(keep_every=4, keep_last=1)
    assert steps_of(policy.decide(fresh(root).history())) == [1, 2, 3, 5, 6, 7, 9]
    apply_retention(fresh(root), policy)
    assert published(root) == [4, 8, 10]


def test_no_rule_keeps_everything(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2, 3))
    txckpt.forget_roots()
    txckpt.resume(root, step=1)
    assert RetentionPolicy().decide(fresh(root).history()) == []
    assert RetentionPolicy().is_noop


def test_best_is_kept_by_path_txid_or_metric(tmp_path):
    root = str(tmp_path / "out")
    for s, loss in zip(range(1, 7), (5.0, 1.0, 4.0, 3.0, 2.5, 6.0)):
        txckpt.save_checkpoint(root, s, {"w.bin": b"x" * s}, metadata={"eval_loss": loss})
    r = fresh(root)
    h = r.history()
    by_step = {c.step: c for c in h.in_view(None)}
    best_path = os.path.join(root, "checkpoint-3")
    # A path (what the Trainer passes as best_model_checkpoint) and a txid.
    policy = RetentionPolicy(keep_last=1, keep_best=[best_path, by_step[4].txid])
    assert steps_of(policy.decide(h)) == [1, 2, 5]
    # save_total_limit=1 with a best that is not the newest keeps two, as transformers does.
    policy = RetentionPolicy.from_save_total_limit(1, best_path)
    assert steps_of(policy.decide(h)) == [1, 2, 4, 5]
    # The limit counts the best, as transformers' rotation does: an older best takes the place of
    # the second newest; a best among the newest changes nothing.
    assert steps_of(RetentionPolicy.from_save_total_limit(2, best_path).decide(h)) == [1, 2, 4, 5]
    assert steps_of(RetentionPolicy.from_save_total_limit(3, best_path).decide(h)) == [1, 2, 4]
    assert steps_of(RetentionPolicy.from_save_total_limit(2, by_step[5].txid).decide(h)) == [1, 2, 3, 4]
    assert steps_of(RetentionPolicy(keep_last=2, keep_best=[best_path]).decide(h)) == [1, 2, 4]
    # By a metric in the manifests' metadata (lower is better by default).
    policy = RetentionPolicy(keep_last=1, best_metric="eval_loss", keep_best_n=2)
    assert steps_of(apply_retention(r, policy, dry_run=True)) == [1, 3, 4]
    apply_retention(r, policy)
    assert published(root) == [2, 5, 6]


def test_newest_and_fork_points_are_always_kept_abandoned_kept_by_default(tmp_path):
    root = str(tmp_path / "out")
    save(root, (2, 4, 6), "a")
    txckpt.forget_roots()
    txckpt.resume(root, step=2)
    save(root, (4,), "b")
    txckpt.forget_roots()
    txckpt.resume(root, step=4)  # a fork at the head's own tip does nothing...
    r = fresh(root)
    h = r.history()
    a = next(c.lineage for c in h.checkpoints.values() if c.step == 6)
    # keep_last=1 would keep only b's 4; 2 is a fork point, a's 4 and 6 are abandoned (kept).
    assert RetentionPolicy(keep_last=1).decide(h) == []
    # Explicitly retiring the head tip or a fork point is refused inside the append.
    tip = h.state.head_tip.txid
    fork_point = next(iter(h.fork_points()))
    assert retire(r, [tip, fork_point]) == []
    assert not any(e["action"] == "retire" for e in r.history().entries)
    # With a TTL of 0 the abandoned ones may go, never the fork point.
    gone = apply_retention(r, RetentionPolicy(keep_last=1, abandoned=0))
    assert sorted((i.lineage, i.step, i.state) for i in gone) == [(a, 4, "abandoned"), (a, 6, "abandoned")]
    infos = fresh(root).checkpoints("all")
    assert sorted((c.step, c.state) for c in infos) == [(2, "current"), (4, "current"), (4, "retired"), (6, "retired")]
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-4")
    txckpt.verify_checkpoint(os.path.join(root, "checkpoint-2"))


def test_abandoned_ttl_counts_from_the_fork(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2, 3))
    txckpt.forget_roots()
    txckpt.resume(root, step=1)
    h = fresh(root).history()
    fork_time = next(e["time"] for e in h.entries if e["action"] == "fork" and e["seq"] > 0)
    policy = RetentionPolicy(abandoned=3600)
    assert policy.decide(h, now=fork_time + 3599) == []
    assert steps_of(policy.decide(h, now=fork_time + 3601)) == [2, 3]


def test_retire_redecides_when_the_log_moved(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2, 3, 4))
    r = fresh(root)
    policy = RetentionPolicy(keep_last=1)
    decided_at = r.history().state.seq
    going = policy.decide(r.history())
    assert steps_of(going) == [1, 2, 3]
    # Meanwhile an operator rolls back to 2: it becomes a fork point (and the head's tip), and 3
    # is now abandoned, which this policy keeps: only 1 may still go.
    txckpt.forget_roots()
    txckpt.resume(root, step=2)
    done = retire(r, [c.txid for c in going], policy=policy, decided_at=decided_at)
    assert done == [going[0].txid]
    r = fresh(root)
    assert sorted((c.step, c.state) for c in r.checkpoints("all")) == [
        (1, "retired"),
        (2, "current"),
        (3, "abandoned"),
        (4, "abandoned"),
    ]


def test_leased_checkpoint_is_kept_until_released(tmp_path):
    root = str(tmp_path / "out")
    save(root, (1, 2, 3))
    r = fresh(root)
    one = next(c for c in r.history().checkpoints.values() if c.step == 1)
    lease = acquire_reader_lease(r, one.txid, 600)
    apply_retention(r, RetentionPolicy(keep_last=1))
    assert published(root) == [1, 3]
    release_reader_lease(r, lease)
    apply_retention(r, RetentionPolicy(keep_last=1))
    assert published(root) == [3]


def test_a_deleter_whose_clock_runs_ahead_does_not_undercut_a_live_lease(any_root, monkeypatch):
    """The lease's ``expires`` is the reader's clock, compared with the deleter's: a deleter
    whose clock runs 2 minutes ahead (within the documented bound, 5 minutes) must neither
    retire and delete the leased checkpoint nor remove the lease, while it has 1 minute left."""
    import time

    from txckpt._base.layout import READERS_DIR
    from txckpt._maintenance.retention import lease_clock_skew

    save(any_root, (1, 2, 3))
    reader = fresh(any_root)
    one = next(c for c in reader.history().checkpoints.values() if c.step == 1)
    lease = acquire_reader_lease(reader, one.txid, 60)
    ahead = time.time() + 120  # the deleter's clock: 2 minutes ahead of the reader's
    deleter = fresh(any_root)
    apply_retention(deleter, RetentionPolicy(keep_last=1), now=ahead)
    collect_garbage(deleter, now=ahead)
    assert steps_of(fresh(any_root).checkpoints()) == [1, 3]
    assert deleter.locate(one.ref) is not None and deleter.storage.exists(lease)
    # Beyond the bound the lease counts as expired, as docs/protocol.md §11 says.
    assert lease_clock_skew() == 300
    beyond = time.time() + 60 + 301
    apply_retention(deleter, RetentionPolicy(keep_last=1), now=beyond)
    collect_garbage(deleter, now=beyond)
    assert deleter.locate(one.ref) is None and deleter.storage.list_dir(READERS_DIR) == []
    monkeypatch.setenv("TXCKPT_LEASE_CLOCK_SKEW", "0")
    assert lease_clock_skew() == 0


def test_a_lease_is_refused_once_retired_and_not_left_behind(tmp_path):
    from txckpt.errors import CheckpointNotFoundError
    from txckpt._base.layout import READERS_DIR
    from txckpt._maintenance.retention import read_leases

    root = str(tmp_path / "out")
    save(root, (1, 2, 3))
    r = fresh(root)
    one = next(c for c in r.history().checkpoints.values() if c.step == 1)
    assert retire(r, [one.txid]) == [one.txid]  # phase one: its deletion may begin any time
    with pytest.raises(CheckpointNotFoundError, match="retired"):
        acquire_reader_lease(fresh(root), one.txid, 600)
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        acquire_reader_lease(fresh(root), "7-deadbeef-0123456789", 600)
    assert r.storage.list_dir(READERS_DIR) == [] and read_leases(r.storage) == (set(), [])
    apply_retention(fresh(root), RetentionPolicy(keep_last=2))
    assert published(root) == [2, 3]


def test_invalid_policies():
    for bad in ({"keep_last": 0}, {"keep_every": -1}, {"abandoned": "forever"}, {"abandoned": -1}, {"keep_best_n": 0}):
        with pytest.raises(txckpt.errors.InvalidArgumentError):
            RetentionPolicy(**bad)


def _rewind_template(root: str) -> dict[str, dict]:
    """a: 1..5; rolled back to a's 2; b: 3..6. Returns {lineage tag: {step: txid}}."""
    save(root, (1, 2, 3, 4, 5), "a")
    txckpt.forget_roots()
    txckpt.resume(root, step=2)
    save(root, (3, 4, 5, 6), "b")
    txckpt.forget_roots()
    h = txckpt.CheckpointRoot(root).history()
    b = h.state.head
    return {
        tag: {c.step: c.txid for c in h.checkpoints.values() if (c.lineage == b) == (tag == "b")} for tag in ("a", "b")
    }


def test_rewind_retires_only_what_the_rollback_leaves(tmp_path):
    root = str(tmp_path / "out")
    ids = _rewind_template(root)
    r = fresh(root)
    entries = len(r.history().entries)
    gone = rewind(r, os.path.join(root, "checkpoint-4"))  # b's 4, by its published path
    assert sorted(c.txid for c in gone) == sorted([ids["b"][5], ids["b"][6]])
    r = fresh(root)
    h = r.history()
    assert [e["action"] for e in h.entries[entries:]] == ["fork", "retire"]
    assert h.state.head_tip.txid == ids["b"][4]
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-4")
    assert txckpt.read_manifest(txckpt.get_last_checkpoint(root)).txid == ids["b"][4]
    assert set(h.retired) == {ids["b"][5], ids["b"][6]}
    assert published(root) == [1, 2, 3, 4]
    # Run a's checkpoints (abandoned by the earlier rollback) and the fork point are untouched.
    for step in (2, 3, 4, 5):
        c = h.checkpoints[ids["a"][step]]
        txckpt.verify_checkpoint(r.locate(c.ref))
    for step in (5, 6):
        assert r.locate(h.checkpoints[ids["b"][step]].ref) is None
        assert not os.path.exists(os.path.join(root, ".txckpt", "tx", ids["b"][step]))
    # The next save continues from the kept checkpoint.
    save(root, (5,), "c")
    assert txckpt.read_manifest(txckpt.get_last_checkpoint(root)).step == 5


def test_rewind_to_the_newest_changes_nothing_and_refuses_other_lineages(tmp_path):
    root = str(tmp_path / "out")
    ids = _rewind_template(root)
    r = fresh(root)
    n = len(r.history().entries)
    assert rewind(r, ids["b"][6]) == []
    with pytest.raises(txckpt.errors.CheckpointNotFoundError, match="current lineage"):
        rewind(r, ids["a"][4])  # abandoned: not something to roll the current lineage back to
    assert len(fresh(root).history().entries) == n


def test_rewind_leaves_a_leased_checkpoint_for_later(tmp_path):
    root = str(tmp_path / "out")
    ids = _rewind_template(root)
    r = fresh(root)
    lease = acquire_reader_lease(r, ids["b"][6])
    gone = rewind(r, ids["b"][4])
    assert [c.step for c in gone] == [5]
    h = fresh(root).history()
    assert ids["b"][6] not in h.retired and h.state.head_tip.txid == ids["b"][4]
    txckpt.verify_checkpoint(fresh(root).locate(h.checkpoints[ids["b"][6]].ref))  # still readable
    release_reader_lease(r, lease)


# ----- crash safety -------------------------------------------------------------------------------
@pytest.mark.slow
def _sweep_clean(name, template, tmp_path, scenario, check):
    """SIGKILL ``scenario`` before and after each of its file operations; every point clean."""
    from tests.harness.crash_sweep import sweep

    result = sweep(name, template, str(tmp_path / "work"), scenario, check)
    print(
        f"{name} crash sweep: {len(result.ops)} file ops, {result.crash_points} crash points, "
        f"{len(result.violations)} violations"
    )
    assert result.crash_points >= 2 * 10
    assert not result.violations, "\n".join(result.violations[:20])


def test_apply_retention_crash_sweep(tmp_path):
    """SIGKILL apply_retention before and after each of its file operations; after each crash
    nothing that must be kept is gone, no half-deleted checkpoint-N is visible, and gc then
    finishes the deletion."""

    template = str(tmp_path / "template")
    save(template, (1, 2, 3, 4, 5), "a")
    txckpt.forget_roots()
    txckpt.resume(template, step=2)
    save(template, (3, 4), "b")
    txckpt.forget_roots()
    h = txckpt.CheckpointRoot(template).history()
    policy = RetentionPolicy(keep_last=1, abandoned=0)
    going = {c.txid for c in policy.decide(h)}
    keep = {txid: c for txid, c in h.checkpoints.items() if txid not in going}
    # b's 3, a's 1, 3, 4, 5 go; a's 2 (fork point) and b's 4 (newest) stay.
    assert sorted((c.lineage == h.state.head, c.step) for c in keep.values()) == [(False, 2), (True, 4)]
    assert len(going) == 5

    def scenario(root: str):
        txckpt.forget_roots()
        apply_retention(txckpt.CheckpointRoot(root), policy)

    def check(root: str, k: int, when: str) -> list[str]:
        v: list[str] = []
        txckpt.forget_roots()
        r = txckpt.CheckpointRoot(root)
        hist = r.history()
        for txid, c in keep.items():
            where = r.locate(c.ref)
            if where is None:
                v.append(f"kept checkpoint step {c.step} ({txid}) is gone")
                continue
            try:
                txckpt.verify_checkpoint(where)
            except Exception as e:
                v.append(f"kept checkpoint {txid} damaged: {e}")
        last = txckpt.get_last_checkpoint(root)
        if last != os.path.join(root, "checkpoint-4") or txckpt.read_manifest(last).lineage != hist.state.head:
            v.append(f"lookup returned {last}")
        for name in os.listdir(root):  # every visible checkpoint-N is whole
            if name.startswith("checkpoint-"):
                try:
                    txckpt.verify_checkpoint(os.path.join(root, name))
                except Exception as e:
                    v.append(f"visible {name} is not whole: {e}")
        retired_entry = any(e["action"] == "retire" for e in hist.entries)
        if not retired_entry:  # phase one did not happen: nothing may be missing
            for txid, c in hist.checkpoints.items():
                if r.locate(c.ref) is None:
                    v.append(f"{txid} deleted before the retire entry")
        # gc finishes the job.
        collect_garbage(r, grace_seconds=0)
        if retired_entry:
            hist = r.history()
            if set(hist.retired) != going:
                v.append(f"retired {sorted(hist.retired)}, expected {sorted(going)}")
            for txid in going:
                if r.locate(hist.checkpoints[txid].ref) is not None or os.path.exists(
                    os.path.join(root, ".txckpt", "tx", txid)
                ):
                    v.append(f"gc left retired {txid} behind")
        for txid, c in keep.items():
            where = r.locate(c.ref)
            if where is None:
                v.append(f"after gc: kept {txid} is gone")
            else:
                txckpt.verify_checkpoint(where)
        leftovers = [
            n
            for n in os.listdir(os.path.join(root, ".txckpt", "tx"))
            if n not in keep and (retired_entry or n not in going)
        ]
        if leftovers:
            v.append(f"after gc, .txckpt/tx holds {leftovers}")
        return v

    _sweep_clean("apply_retention", template, tmp_path, scenario, check)


@pytest.mark.slow
def test_rewind_crash_sweep(tmp_path):
    """SIGKILL rewind (the Trainer's end of training with save_total_limit=1) before and after
    each file operation: lookup returns the old newest or the kept one, never anything else;
    nothing but the checkpoints the rollback leaves is ever deleted; gc finishes the deletion."""

    template = str(tmp_path / "template")
    ids = _rewind_template(template)
    h = txckpt.CheckpointRoot(template).history()
    going = {ids["b"][5], ids["b"][6]}
    keep = {t: c for t, c in h.checkpoints.items() if t not in going}

    def scenario(root: str):
        txckpt.forget_roots()
        rewind(txckpt.CheckpointRoot(root), ids["b"][4])

    def check(root: str, k: int, when: str) -> list[str]:
        v: list[str] = []
        txckpt.forget_roots()
        r = txckpt.CheckpointRoot(root)
        hist = r.history()
        forked = any(e["action"] == "fork" for e in hist.entries[len(h.entries) :])
        last = txckpt.get_last_checkpoint(root)
        want = ids["b"][4] if forked else ids["b"][6]
        if last is None or txckpt.read_manifest(last).txid != want:
            v.append(f"lookup returned {last}, expected {want} (forked: {forked})")
        for txid, c in hist.checkpoints.items():
            where = r.locate(c.ref)
            if txid in keep or txid not in hist.retired:
                if where is None:
                    v.append(f"{txid} (step {c.step}) is gone but was not retired")
                else:
                    txckpt.verify_checkpoint(where)
        if set(hist.retired) - going:
            v.append(f"retired {sorted(set(hist.retired) - going)}, which the rollback did not leave")
        for name in os.listdir(root):
            if name.startswith("checkpoint-"):
                try:
                    txckpt.verify_checkpoint(os.path.join(root, name))
                except Exception as e:
                    v.append(f"visible {name} is not whole: {e}")
        collect_garbage(r, grace_seconds=0)
        hist = r.history()
        for txid in hist.retired:
            if r.locate(hist.checkpoints[txid].ref) is not None or os.path.exists(
                os.path.join(root, ".txckpt", "tx", txid)
            ):
                v.append(f"gc left retired {txid} behind")
        for txid, c in keep.items():
            if r.locate(c.ref) is None:
                v.append(f"after gc: kept {txid} is gone")
        return v

    _sweep_clean("rewind", template, tmp_path, scenario, check)


def test_retention_after_a_save_does_not_revisit_every_checkpoint_ever_retired(tmp_path, monkeypatch):
    """Retention runs after every save: its cost must follow what is kept and what the listings
    show, not the history. Deterministic: count the per-checkpoint work, not time."""
    root = str(tmp_path / "out")
    r = txckpt.CheckpointRoot(root)
    policy = RetentionPolicy(keep_last=2)
    for s in range(1, 31):
        r.save(s, {"meta.json": {"step": s}})
        apply_retention(r, policy)
    h = r.history()
    assert len(h.retired) == 28 and not [c for c in r.checkpoints("all") if c.state == "retired" and c.path]
    calls = []
    real = type(r.publication).candidates

    def counted(self, ref):
        calls.append(ref.txid)
        return real(self, ref)

    monkeypatch.setattr(type(r.publication), "candidates", counted)
    r.save(31, {"meta.json": {"step": 31}})
    apply_retention(r, policy)
    # Only the checkpoint this retention retired is located and deleted; none of the 28 retired
    # before (their data is gone, the listings show no trace of them) is located again.
    h = r.history()  # (a history handed out stays as it was: the fold after the save is a new one)
    assert len(h.retired) == 29
    assert not set(calls) & {t for t, seq in h.retired.items() if seq < h.state.seq}, calls
    # A view's checkpoints come from the lineage's live ones, not from every checkpoint ever.
    assert [c.step for c in h.in_view(None)] == [30, 31]
    assert len(h.in_view(None, include_retired=True)) == 31


@pytest.mark.parametrize("how", ["resume", "load_checkpoint", "read_manifest"])
def test_a_retired_checkpoint_given_by_path_says_it_was_retired_and_how_to_list_it(any_root, how, capsys):
    """A path that named a committed checkpoint which retention then retired (and deleted) was
    not "never committed": the error says it was committed, then retired by the retention policy
    (in which log entry), and that `txckpt ls ROOT --all` lists it."""
    from txckpt.errors import CheckpointNotFoundError, CheckpointRetiredError
    from txckpt._storage import open_storage

    url, so = any_root, None
    root = txckpt.CheckpointRoot(url, so)
    paths = []
    for s in (1, 2, 3, 4):
        root.save(s, {"w.bin": b"w" * s})
        paths.append(root.get_last_checkpoint())  # the path a user was given (a home on object stores)
        apply_retention(root, RetentionPolicy(keep_last=2))
    path = paths[0]
    assert not open_storage(path, so).exists(""), "retention deletes the retired checkpoint's data"
    txckpt.forget_roots()
    call = {
        "resume": lambda: txckpt.resume(url, path=path, storage_options=so),
        "load_checkpoint": lambda: txckpt.load_checkpoint(path, storage_options=so),
        "read_manifest": lambda: txckpt.read_manifest(path, storage_options=so),
    }[how]
    with pytest.raises(CheckpointRetiredError) as e:
        call()
    assert isinstance(e.value, CheckpointNotFoundError) and isinstance(e.value, FileNotFoundError)
    history = txckpt.CheckpointRoot(url, so).history()
    (retired,) = [c for c in history.checkpoints.values() if c.step == 1]
    assert (e.value.path, e.value.step, e.value.txid) == (path, 1, retired.txid)
    assert e.value.retired_seq == history.retired[retired.txid]
    text = str(e.value)
    assert "retired by the retention policy" in text and f"log entry {e.value.retired_seq}" in text
    assert f"`txckpt ls {root.url} --all`" in text and "not a committed checkpoint" not in text
    # The command the message names lists it, and says it was retired.
    from txckpt.cli import main as cli_main

    capsys.readouterr()
    assert cli_main(["ls", root.url, "--all", "--json"]) == 0
    listed = [c for c in json.loads(capsys.readouterr().out) if c["txid"] == retired.txid]
    assert [c["state"] for c in listed] == ["retired"]
