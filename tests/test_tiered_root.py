"""Tiered roots (issue 31 item 3, protocol §14, docs/tiered.md): the seam the replicator
needs (a fork appended under a given lineage id, so that one id names a lineage on both tiers),
then TieredRoot on each kind of durable tier: replication under the same txid and lineage,
rollbacks forked on both tiers, a lost fast tier, repairs that fetch exactly the damaged files,
the retention guard, a restart's backlog, async saves, DCP, and two gloo ranks."""

import contextlib
import os

import pytest
import torch

import txckpt
from txckpt import save_checkpoint
from txckpt._log import commit
from txckpt.errors import ConcurrentWriterError, ReplicationError, StepConflictError
from txckpt._root.root import forget_roots, open_root
from txckpt._tiered.tiered import TieredRoot


def test_a_fork_repeated_under_the_fast_tiers_lineage_id_names_the_same_lineage(tmp_path):
    fast, durable = open_root(str(tmp_path / "fast")), open_root(str(tmp_path / "durable"))
    lid = commit.new_lineage(fast)
    assert commit.new_lineage(durable, lineage_id=lid) == lid
    assert durable.state().head == fast.state().head == lid
    # The durable lineage is an ordinary one: a save commits to it.
    save_checkpoint(str(tmp_path / "durable"), 1, {"w.bin": b"1"})
    assert open_root(str(tmp_path / "durable")).state().head == lid


def test_a_replicated_fork_is_appended_once(tmp_path):
    fast, durable = open_root(str(tmp_path / "fast")), open_root(str(tmp_path / "durable"))
    lid = commit.new_lineage(fast)
    commit.new_lineage(durable, lineage_id=lid)
    seq = durable.state().seq
    with pytest.raises(ConcurrentWriterError, match=lid):
        commit.new_lineage(durable, lineage_id=lid)
    assert durable.state().seq == seq


# ----- TieredRoot ---------------------------------------------------------------------------------


def files(step: int, base: torch.Tensor | None = None):
    """A checkpoint with a frozen base (shared across saves when ``base`` is the same) and
    files that change with ``step``."""
    return {
        "base.safetensors": {"w": base if base is not None else torch.arange(4096, dtype=torch.float32)},
        "adapter.safetensors": {"a": torch.full((64,), float(step))},
        "optimizer.pt": {"step": step},
        "trainer_state.json": {"global_step": step},
    }


@pytest.fixture(
    params=[
        "local",
        "memory",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("seaweedfs", marks=pytest.mark.seaweedfs),
    ]
)
def durable(request, tmp_path):
    """(url, storage_options) of an empty durable tier on each backend."""
    if request.param == "local":
        return str(tmp_path / "durable"), {}
    return request.getfixturevalue(f"{request.param}_root")


@pytest.fixture
def tiered(tmp_path, durable):
    forget_roots()
    url, options = durable
    t = TieredRoot(str(tmp_path / "fast"), url, options)
    yield t
    # No replication outlives its test: the next test's server (or bucket) would receive it.
    with contextlib.suppress(Exception):
        t.wait_durable(timeout=120)
    forget_roots()


def durable_root(t: TieredRoot) -> txckpt.CheckpointRoot:
    return txckpt.CheckpointRoot(t.durable, t.storage_options)


def test_a_save_commits_on_the_fast_tier_and_becomes_durable_under_the_same_txid_and_lineage(tiered):
    path = txckpt.save_checkpoint(tiered, 1, files(1))
    assert path.startswith(tiered.fast)
    txckpt.save_checkpoint(tiered, 2, files(2))
    tiered.wait_durable()
    assert tiered.pending() == []
    fast = {c.txid: c for c in tiered.fast_root.checkpoints("all")}
    dur = {c.txid: c for c in durable_root(tiered).checkpoints("all")}
    assert set(fast) == set(dur) and len(dur) == 2
    for txid, c in fast.items():
        assert (dur[txid].step, dur[txid].lineage) == (c.step, c.lineage)
        fm, dm = (
            txckpt.read_manifest(c.path),
            txckpt.verify_checkpoint(dur[txid].path, storage_options=tiered.storage_options),
        )
        assert {n: (e.size, e.checksum) for n, e in fm.files.items()} == {
            n: (e.size, e.checksum) for n, e in dm.files.items()
        }
    assert durable_root(tiered).state().head == tiered.fast_root.state().head
    # The durable tier on its own is an ordinary root: its newest checkpoint is step 2.
    last = txckpt.get_last_checkpoint(tiered.durable, storage_options=tiered.storage_options)
    assert txckpt.load_checkpoint(last, storage_options=tiered.storage_options)["optimizer.pt"] == {"step": 2}
    assert txckpt.get_last_checkpoint(tiered) == path.replace("checkpoint-1", "checkpoint-2")


def test_a_rollback_forks_on_both_tiers_and_keeps_the_abandoned_checkpoints(tiered):
    for step in (1, 2, 3):
        txckpt.save_checkpoint(tiered, step, files(step))
    txckpt.resume(tiered, step=1)
    txckpt.save_checkpoint(tiered, 2, files(20))
    tiered.wait_durable()
    d = durable_root(tiered)
    assert d.state().head == tiered.fast_root.state().head
    current = [(c.step, c.txid) for c in d.checkpoints("current")]
    assert current == [(c.step, c.txid) for c in tiered.fast_root.checkpoints("current")]
    assert [s for s, _ in current] == [1, 2]
    assert sorted(c.step for c in d.checkpoints("all")) == [1, 2, 2, 3]  # nothing lost
    last = txckpt.get_last_checkpoint(tiered.durable, storage_options=tiered.storage_options)
    assert txckpt.load_checkpoint(last, storage_options=tiered.storage_options)["optimizer.pt"] == {"step": 20}


def test_a_lost_fast_tier_resumes_from_the_newest_durable_checkpoint_and_continues_its_lineage(tiered, tmp_path):
    import shutil

    for step in (1, 2):
        txckpt.save_checkpoint(tiered, step, files(step))
    tiered.wait_durable()
    lineage = tiered.fast_root.state().head
    shutil.rmtree(tiered.fast)  # a new node
    forget_roots()
    fresh = TieredRoot(tiered.fast, tiered.durable, tiered.storage_options)
    last = txckpt.get_last_checkpoint(fresh)
    assert last is not None and not last.startswith(fresh.fast)
    assert txckpt.resume(fresh) == last
    assert txckpt.load_checkpoint(fresh)["optimizer.pt"] == {"step": 2}
    with pytest.raises(StepConflictError, match="step 2 is already committed"):
        txckpt.save_checkpoint(fresh, 2, files(2))
    txckpt.save_checkpoint(fresh, 3, files(3))
    fresh.wait_durable()
    d = durable_root(fresh)
    assert fresh.fast_root.state().head == d.state().head == lineage
    assert [c.step for c in d.checkpoints("current")] == [1, 2, 3]
    assert txckpt.get_last_checkpoint(fresh).startswith(fresh.fast)


def test_a_load_fetches_exactly_the_missing_and_damaged_files_from_the_durable_tier(tiered):
    path = txckpt.save_checkpoint(tiered, 1, files(1))
    tiered.wait_durable()
    sizes = {n: e.size for n, e in txckpt.read_manifest(path).files.items()}
    os.unlink(os.path.join(path, "base.safetensors"))
    os.unlink(os.path.join(path, "trainer_state.json"))
    with open(os.path.join(path, "adapter.safetensors"), "r+b") as f:
        f.seek(sizes["adapter.safetensors"] - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    loaded = txckpt.load_checkpoint(tiered)
    assert torch.equal(loaded["adapter.safetensors"]["a"], torch.full((64,), 1.0))
    assert loaded["trainer_state.json"] == {"global_step": 1}
    damaged = ("base.safetensors", "trainer_state.json", "adapter.safetensors")
    assert tiered.last_fetched == {n: sizes[n] for n in damaged}
    txckpt.verify_checkpoint(path)  # the fast copy is whole again
    txckpt.load_checkpoint(tiered)
    assert tiered.last_fetched == {}


def test_a_damaged_file_of_a_checkpoint_not_yet_durable_fails_with_what_to_do(tiered, monkeypatch):
    monkeypatch.setattr(TieredRoot, "_kick", lambda self: None)  # replication not yet run
    path = txckpt.save_checkpoint(tiered, 1, files(1))
    os.unlink(os.path.join(path, "optimizer.pt"))
    with pytest.raises(txckpt.errors.IntegrityError, match="not durable"):
        txckpt.load_checkpoint(tiered)
    with pytest.raises(ReplicationError) as e:
        tiered.wait_durable()
    assert "optimizer.pt" in str(e.value.__cause__ or e.value) or e.value.txid


def test_fast_tier_retention_keeps_every_checkpoint_that_is_not_durable(tiered, monkeypatch):
    monkeypatch.setattr(TieredRoot, "_kick", lambda self: None)  # a durable tier that lags
    for step in (1, 2, 3, 4):
        txckpt.save_checkpoint(tiered, step, files(step))
    policy = txckpt.RetentionPolicy(keep_last=1)
    assert tiered.apply_retention(policy) == []
    assert len(tiered.pending()) == 4
    assert len(tiered.wait_durable()) == 4  # the backlog, on this thread
    assert sorted(i.step for i in tiered.apply_retention(policy)) == [1, 2, 3]
    assert [c.step for c in durable_root(tiered).checkpoints("current")] == [1, 2, 3, 4]


def test_a_restart_replicates_what_the_previous_process_left_pending(tiered, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(TieredRoot, "_kick", lambda self: None)  # the process dies before replicating
        txckpt.save_checkpoint(tiered, 1, files(1))
        txckpt.save_checkpoint(tiered, 2, files(2))
    forget_roots()
    fresh = TieredRoot(tiered.fast, tiered.durable, tiered.storage_options)
    assert [c.step for c in fresh.pending()] == [1, 2]
    assert txckpt.resume(fresh).endswith("checkpoint-2")
    fresh.wait_durable()
    assert fresh.pending() == []
    assert [c.step for c in durable_root(fresh).checkpoints("current")] == [1, 2]


def test_the_durable_tier_shares_a_frozen_base_it_already_holds(tmp_path):
    forget_roots()
    t = TieredRoot(str(tmp_path / "fast"), str(tmp_path / "durable"))
    base = torch.arange(4096, dtype=torch.float32)
    one = txckpt.save_checkpoint(t, 1, files(1, base), incremental=True)
    two = txckpt.save_checkpoint(t, 2, files(2, base), incremental=True)
    assert (
        os.stat(os.path.join(one, "base.safetensors")).st_ino == os.stat(os.path.join(two, "base.safetensors")).st_ino
    )
    t.wait_durable()
    d = [c.path for c in durable_root(t).checkpoints("current")]
    assert (
        os.stat(os.path.join(d[0], "base.safetensors")).st_ino == os.stat(os.path.join(d[1], "base.safetensors")).st_ino
    )
    assert (
        os.stat(os.path.join(d[0], "adapter.safetensors")).st_ino
        != os.stat(os.path.join(d[1], "adapter.safetensors")).st_ino
    )


def test_an_async_save_and_a_transaction_on_a_tiered_root_become_durable(tiered):
    future = txckpt.async_save(tiered, 1, files(1))
    assert future.result().startswith(tiered.fast)
    with txckpt.transaction(tiered, 2) as tx:
        tx.save("optimizer.pt", {"step": 2})
        with open(os.path.join(tx.directory, "config.json"), "w") as f:
            f.write("{}")
    tiered.wait_durable()
    d = durable_root(tiered)
    assert [c.step for c in d.checkpoints("current")] == [1, 2]
    last = txckpt.get_last_checkpoint(tiered.durable, storage_options=tiered.storage_options)
    assert set(txckpt.read_manifest(last, storage_options=tiered.storage_options).files) == {
        "optimizer.pt",
        "config.json",
    }


def test_dcp_saves_through_a_tiered_root_and_loads_its_newest_checkpoint_repaired(tiered):
    import torch.distributed.checkpoint as dcp

    from txckpt.integrations.dcp import TransactionalReader, TransactionalWriter

    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(8)}
    dcp.save(state, storage_writer=TransactionalWriter(tiered, 1), no_dist=True)
    tiered.wait_durable()
    [c] = durable_root(tiered).checkpoints("current")
    assert c.step == 1
    path = txckpt.get_last_checkpoint(tiered)
    shard = next(n for n in txckpt.read_manifest(path).files if n.endswith(".distcp"))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    out = {"w": torch.zeros(1 << 16), "b": torch.zeros(8)}
    dcp.load(out, storage_reader=TransactionalReader(tiered), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert list(tiered.last_fetched) == [shard]


@pytest.mark.distributed
def test_two_ranks_save_through_a_tiered_root_and_rank_0_replicates_every_ranks_files(tmp_path):
    from tests.children import dist_workers as dw
    from tests.harness import launcher

    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    run = launcher.launch(2, dw.tiered_save, str(tmp_path / "res"), fast=fast, durable=durable, steps=[1, 2])
    assert all(r.exitcode == 0 and r.error is None for r in run.results), [(r.error, r.trace) for r in run.results]
    assert run.results[0].ok["pending"] == []
    d = txckpt.CheckpointRoot(durable)
    assert [c.step for c in d.checkpoints("current")] == [1, 2]
    for c in d.checkpoints("current"):
        m = txckpt.verify_checkpoint(c.path)
        assert set(m.files) == {f"rank{r}.{ext}" for r in (0, 1) for ext in ("pt", "bin")}
        fast_m = txckpt.read_manifest(os.path.join(fast, f"checkpoint-{c.step}"))
        assert m.txid == fast_m.txid and {n: e.checksum for n, e in m.files.items()} == {
            n: e.checksum for n, e in fast_m.files.items()
        }


def test_wait_durable_waits_for_an_async_save_in_flight_and_a_settled_save_decides_nothing(tiered, monkeypatch):
    txckpt.async_save(tiered, 1, files(1))
    tiered.wait_durable()  # the async save commits first, then it is replicated
    assert [c.step for c in durable_root(tiered).checkpoints("current")] == [1]
    calls = []
    real = TieredRoot._adopt_lineage
    monkeypatch.setattr(TieredRoot, "_adopt_lineage", lambda self, step: calls.append(step) or real(self, step))
    txckpt.save_checkpoint(tiered, 2, files(2))  # learns that the fast lineage holds a checkpoint
    txckpt.save_checkpoint(tiered, 3, files(3))  # and from then on decides nothing
    assert calls == [2]
    tiered.wait_durable()
