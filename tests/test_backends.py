"""The core behaviours on every backend (local disk, fsspec memory, S3 through moto's server),
through one parametrised fixture."""

import multiprocessing
import os

import pytest
import torch

import txckpt
from txckpt.errors import ConcurrentWriterError, IntegrityError, StaleLineageError, StepConflictError
from txckpt._storage import open_storage

from tests.conftest import count_reads


def files(tag, step):
    return {
        "model.safetensors": {"w": torch.full((8,), float(step))},
        "optimizer.pt": {"tag": tag, "m": torch.ones(4) * step},
        "trainer_state.json": {"global_step": step, "tag": tag},
    }


def tag_of(path, opts):
    data = txckpt.load_checkpoint(path, storage_options=opts)
    tags = {data["optimizer.pt"]["tag"], data["trainer_state.json"]["tag"]}
    assert len(tags) == 1, tags
    return tags.pop()


def fresh(url, opts):
    """A root as a new process would open it (no cached instance or listing)."""
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(url, {**opts, "skip_instance_cache": True} if url.startswith("s3") else opts)


def test_save_lookup_load(any_root):
    url, opts = any_root
    if "://" not in url:
        os.makedirs(url)  # a missing local root raises FileNotFoundError (tests/test_lookup.py)
    assert txckpt.get_last_checkpoint(url, storage_options=opts) is None
    for s in (2, 4):
        path = txckpt.save_checkpoint(url, s, files("A", s), storage_options=opts)
    assert txckpt.get_last_checkpoint(url, storage_options=opts) == path
    assert path.rstrip("/").endswith("checkpoint-4")
    assert tag_of(path, opts) == "A"
    m = txckpt.read_manifest(path, storage_options=opts)
    assert m.step == 4 and sorted(m.files) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]


def test_the_rollback_warning_says_where_the_abandoned_checkpoints_are(any_root, txlog):
    url, opts = any_root
    paths = {s: txckpt.save_checkpoint(url, s, files("A", s), storage_options=opts) for s in (2, 4)}
    txid = txckpt.read_manifest(paths[4], storage_options=opts).txid
    txckpt.forget_roots()
    txckpt.resume(url, step=2, storage_options=opts)
    warning = next(r.getMessage() for r in txlog.records if "rolling back" in r.getMessage())
    storage = fresh(url, opts).storage
    home = f".txckpt/tx/{txid}/checkpoint-4"
    if storage.atomic_dir_rename:
        assert "the abandoned ones move to .txckpt/tx/<txid>/checkpoint-N" in warning
        assert storage.key_of(paths[4]) == "checkpoint-4" and not os.path.exists(paths[4])
        assert txckpt.read_manifest(storage.full_path(home), storage_options=opts).txid == txid
    else:
        # Nothing moves on an object store: the path the save returned is where it stays.
        assert "move to" not in warning and "nothing is moved on this object store" in warning
        assert storage.key_of(paths[4]) == home
        assert txckpt.read_manifest(paths[4], storage_options=opts).txid == txid


def test_rollback_on_every_backend(any_root, txlog):
    url, opts = any_root
    for s in (2, 4, 6):
        txckpt.save_checkpoint(url, s, files("A", s), storage_options=opts)
    txckpt.forget_roots()
    txckpt.resume(url, step=2, storage_options=opts)
    assert "abandons 2" in txlog.text
    r = fresh(url, opts)
    assert tag_of(r.get_last_checkpoint(), opts) == "A"
    assert txckpt.read_manifest(r.get_last_checkpoint(), storage_options=opts).step == 2
    r.resume()
    for s in (4, 6):
        r.save(s, files("B", s))
    r = fresh(url, opts)
    assert tag_of(r.get_last_checkpoint(), opts) == "B"
    abandoned = [c for c in r.checkpoints("all") if c.state == "abandoned"]
    assert sorted(c.step for c in abandoned) == [4, 6]
    assert all(tag_of(c.path, opts) == "A" for c in abandoned)


def test_refusals_on_every_backend(any_root):
    url, opts = any_root
    txckpt.save_checkpoint(url, 2, files("A", 2), storage_options=opts)
    with pytest.raises(StepConflictError):
        txckpt.save_checkpoint(url, 2, files("B", 2), storage_options=opts)
    zombie = txckpt.CheckpointRoot(url, opts)
    zombie.resume()
    txckpt.CheckpointRoot(url, opts).new_lineage()
    with pytest.raises(StaleLineageError):
        zombie.save(3, files("Z", 3))


def test_writer_plans_a_save_without_reading_the_log(any_root, monkeypatch):
    """A session that holds the lineage plans its next save against the state of its own last
    commit (protocol §8 step 1): the save reads no log entry and no hint before its commit."""
    url, opts = any_root
    root = txckpt.CheckpointRoot(url, opts)
    root.save(1, files("A", 1))
    reads = count_reads(monkeypatch, root, ".txckpt/")
    root.save(2, files("A", 2))
    assert not [k for k in reads if k.startswith(".txckpt/log/") or k == ".txckpt/latest"], reads
    assert txckpt.read_manifest(fresh(url, opts).get_last_checkpoint(), storage_options=opts).step == 2


def test_save_after_another_process_appended_commits_after_the_newest_entry(any_root):
    """The state a save planned against is stale (another process retired a checkpoint since):
    the commit's first attempt loses the create-if-absent race and it appends after the newest
    entry instead, validated against it."""
    from txckpt._maintenance.retention import retire

    url, opts = any_root
    writer = txckpt.CheckpointRoot(url, opts)
    writer.save(1, files("A", 1))
    writer.save(2, files("A", 2))
    other = fresh(url, opts)
    one = next(c for c in other.checkpoints("all") if c.step == 1)
    assert retire(other, [one.txid]) == [one.txid]
    seq_before = fresh(url, opts).state().seq
    writer.save(3, files("A", 3))
    r = fresh(url, opts)
    assert r.state().seq == seq_before + 1
    m = txckpt.read_manifest(r.get_last_checkpoint(), storage_options=opts)
    assert m.step == 3 and m.parent.step == 2
    assert one.txid in r.history().retired


def test_stale_writer_save_fails_at_commit_and_leaves_nothing(any_root):
    """A zombie whose lineage another job forked away plans against its own stale state, stages
    its files, and is refused at the commit: StaleLineageError, nothing committed, its staging and
    intent deleted, the new lineage untouched."""
    url, opts = any_root
    zombie = txckpt.CheckpointRoot(url, opts)
    zombie.save(1, files("Z", 1))
    restart = fresh(url, opts)
    restart.resume(step=1)
    restart.save(2, files("R", 2))
    with pytest.raises(StaleLineageError):
        with zombie.transaction(3) as tx:
            for name, obj in files("Z", 3).items():
                tx.save(name, obj)
    storage = open_storage(url, opts)
    assert not list(storage.walk_files(f".txckpt/tx/{tx.txid}"))
    assert not storage.exists(f".txckpt/intents/{tx.txid}.json")
    r = fresh(url, opts)
    assert tag_of(r.get_last_checkpoint(), opts) == "R"
    assert not [c for c in r.checkpoints("all") if c.step == 3]
    # Refused once, the zombie knows the newest state (the refused commit re-read it to learn
    # whether it had committed): its next save is refused before it stages anything.
    written = []
    real_replace = zombie.storage.replace
    zombie.storage.replace = lambda key, data, **kw: (written.append(key), real_replace(key, data, **kw))[1]
    with pytest.raises(StaleLineageError):
        zombie.save(4, files("Z", 4))
    assert not [k for k in written if k.startswith(".txckpt/intents/")], written


def test_abort_leaves_nothing_visible(any_root):
    url, opts = any_root
    txckpt.save_checkpoint(url, 1, files("A", 1), storage_options=opts)
    with pytest.raises(RuntimeError):
        with txckpt.transaction(url, 2, storage_options=opts) as tx:
            tx.save("optimizer.pt", {"tag": "X"})
            raise RuntimeError("killed")
    r = fresh(url, opts)
    assert tag_of(r.get_last_checkpoint(), opts) == "A"
    storage = open_storage(url, opts)
    assert not list(storage.walk_files(f".txckpt/tx/{tx.txid}"))


def test_directory_mode_uploads_once(any_root):
    url, opts = any_root
    with txckpt.transaction(url, 5, storage_options=opts) as tx:
        with open(os.path.join(tx.directory, "config.json"), "w") as f:
            f.write('{"hidden": 8}')
        torch.save({"tag": "D"}, os.path.join(tx.directory, "optimizer.pt"))
    data = txckpt.load_checkpoint(tx.path, storage_options=opts)
    assert data["config.json"] == {"hidden": 8} and data["optimizer.pt"]["tag"] == "D"


def test_flipped_byte_detected_on_every_backend(any_root):
    url, opts = any_root
    path = txckpt.save_checkpoint(url, 1, files("A", 1), storage_options=opts)
    storage = open_storage(path, opts)
    data = bytearray(storage.read_bytes("optimizer.pt"))
    data[-5] ^= 0xFF
    with storage.open_write("optimizer.pt", durable=False) as f:
        f.write(bytes(data))
    with pytest.raises(IntegrityError, match="optimizer.pt"):
        txckpt.load_checkpoint(path, storage_options=opts)


def _race(url, opts, i, barrier, results):
    import txckpt as t

    r = t.CheckpointRoot(url, {**opts, "skip_instance_cache": True} if url.startswith("s3") else opts)
    r.resume()
    barrier.wait()  # start together: the race is for the commit entry
    try:
        r.save(4, files(f"W{i}", 4))
        results.put(("won", i))
    except (StepConflictError, ConcurrentWriterError) as e:
        results.put(("lost", type(e).__name__))


@pytest.mark.parametrize("writers", [4])
def test_concurrent_commits_of_one_step_exactly_one_wins(any_root, writers):
    url, opts = any_root
    txckpt.save_checkpoint(url, 2, files("A", 2), storage_options=opts)
    if url.startswith("memory://"):
        # One process: threads race instead (memory roots are per process).
        import queue
        import threading

        barrier, results = threading.Barrier(writers), queue.Queue()
        threads = [threading.Thread(target=_race, args=(url, opts, i, barrier, results)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    else:
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(writers), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(url, opts, i, barrier, results)) for i in range(writers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            assert p.exitcode == 0
    outcomes = [results.get(timeout=10) for _ in range(writers)]
    winners = [o for o in outcomes if o[0] == "won"]
    assert len(winners) == 1, outcomes
    r = fresh(url, opts)
    assert tag_of(r.get_last_checkpoint(), opts) == f"W{winners[0][1]}"
    assert len([c for c in r.checkpoints("all") if c.step == 4]) == 1


def test_fetch_checkpoint_to_a_local_cache(any_root, tmp_path):
    url, opts = any_root
    path = txckpt.save_checkpoint(url, 3, files("F", 3), storage_options=opts)
    dest = tmp_path / "cache" / "checkpoint-3"
    got = txckpt.fetch_checkpoint(path, dest, storage_options=opts)
    assert got == str(dest)
    assert tag_of(got, {}) == "F"
    mtime = os.path.getmtime(dest / "optimizer.pt")
    assert txckpt.fetch_checkpoint(path, dest, storage_options=opts) == str(dest)  # reused
    assert os.path.getmtime(dest / "optimizer.pt") == mtime
    # A damaged source is refused and leaves no partial copy behind.
    storage = open_storage(path, opts)
    data = bytearray(storage.read_bytes("optimizer.pt"))
    data[-3] ^= 1
    with storage.open_write("optimizer.pt", durable=False) as f:
        f.write(bytes(data))
    with pytest.raises(IntegrityError):
        txckpt.fetch_checkpoint(path, tmp_path / "other" / "checkpoint-3", storage_options=opts)
    assert not (tmp_path / "other" / "checkpoint-3").exists()
    assert [n for n in os.listdir(tmp_path / "other")] == []


def test_final_path_is_where_the_commit_lands(any_root):
    url, opts = any_root
    with txckpt.transaction(url, 7, storage_options=opts) as tx:
        tx.save("a.json", 1)
        predicted = tx.final_path
    assert tx.path == predicted


def test_legacy_root_is_adopted_on_every_backend(any_root, txlog):
    """A root written without txckpt (plain checkpoint-N dirs) is adopted by the first save."""
    url, opts = any_root
    storage = open_storage(url, opts)
    for s in (2, 4):
        with storage.open_write(f"checkpoint-{s}/trainer_state.json", durable=False) as f:
            f.write(b'{"global_step": %d}' % s)
    assert txckpt.get_last_checkpoint(url, storage_options=opts).rstrip("/").endswith("checkpoint-4")
    assert "no txckpt log" in txlog.text
    txckpt.save_checkpoint(url, 6, files("A", 6), storage_options=opts)
    r = fresh(url, opts)
    cps = r.checkpoints("all")
    assert [(c.step, c.adopted) for c in cps] == [(2, True), (4, True), (6, False)]
    assert txckpt.load_checkpoint(cps[1].path, storage_options=opts)["trainer_state.json"] == {"global_step": 4}


def test_fetch_never_deletes_a_copy_that_appeared_meanwhile(any_root, tmp_path):
    url, opts = any_root
    path = txckpt.save_checkpoint(url, 3, files("F", 3), storage_options=opts)
    dest = tmp_path / "cache" / "checkpoint-3"
    first = txckpt.fetch_checkpoint(path, dest, storage_options=opts)
    inode = os.stat(os.path.join(first, "optimizer.pt")).st_ino
    # A second fetch into the same place (another rank) keeps the verified copy in place.
    from txckpt._read.fetch import _install_fetched

    scratch = tmp_path / "cache" / "scratch"
    import shutil

    shutil.copytree(dest, scratch)
    _install_fetched(str(scratch), str(dest), txckpt.read_manifest(dest))
    assert os.stat(os.path.join(first, "optimizer.pt")).st_ino == inode
    assert not scratch.exists()
    # Something else at dest is moved aside, never deleted.
    (dest / "optimizer.pt").write_bytes(b"damaged")
    got = txckpt.fetch_checkpoint(path, dest, storage_options=opts)
    assert tag_of(got, {}) == "F"
    stale = [n for n in os.listdir(tmp_path / "cache") if n.startswith("checkpoint-3.stale-")]
    assert len(stale) == 1 and (tmp_path / "cache" / stale[0] / "optimizer.pt").read_bytes() == b"damaged"


def test_transaction_local_dir_for_remote_scratch(any_root, tmp_path):
    url, opts = any_root
    with txckpt.transaction(url, 1, storage_options=opts, local_dir=tmp_path / "scratch") as tx:
        with open(os.path.join(tx.directory, "a.json"), "w") as f:
            f.write("1")
        if not url.startswith("/"):
            assert str(tmp_path / "scratch") in tx.directory
    assert txckpt.load_checkpoint(tx.path, storage_options=opts)["a.json"] == 1


def test_retention_after_each_save_does_not_grow_with_what_was_retired_before(any_root, monkeypatch):
    """A Trainer with save_total_limit applies retention after every save: its storage requests
    must not grow with the number of checkpoints retired earlier in the run (a check per retired
    checkpoint made a save on S3 cost ~4 requests per checkpoint ever retired)."""
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention

    url, opts = any_root
    root = txckpt.CheckpointRoot(url, opts)
    policy = RetentionPolicy(keep_last=2)
    calls = count_reads(monkeypatch, root, methods=("read_bytes", "exists", "list_dir", "walk_files", "open_read"))
    cost = {}
    for step in range(1, 41):
        root.save(step, files("R", step))
        del calls[:]
        gone = apply_retention(root, policy)
        assert [c.step for c in gone] == ([step - 2] if step > 2 else [])
        cost[step] = len(calls)
    assert cost[40] == cost[10], cost
    assert [c.step for c in fresh(url, opts).checkpoints()] == [39, 40]
