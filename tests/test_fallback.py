"""resume(root, on_damaged="fallback"): a restart past a damaged newest checkpoint (local, memory
and S3 on the moto server). The damage is done to the stored bytes, as bit rot, a truncated copy
or a hand edit would."""

import json
import logging

import fsspec
import pytest
import torch

import txckpt
from txckpt import cli
from txckpt.errors import IntegrityError, InvalidArgumentError, ManifestError, NoIntactCheckpointError
from txckpt._log.log import read_state
from txckpt._base.layout import MANIFEST_NAME
from txckpt._storage import open_storage

WEIGHTS = "model.safetensors"
DAMAGE = ["flipped_byte", "truncated", "deleted_file", "edited_manifest", "deleted_manifest"]


def commit(root, opts, steps=(2, 4, 6)):
    paths = {}
    for s in steps:
        paths[s] = txckpt.save_checkpoint(
            root, s, {WEIGHTS: {"w": torch.full((256,), float(s))}, "state.json": {"step": s}}, storage_options=opts
        )
    txckpt.forget_roots()  # the restart is a fresh process
    return {s: txckpt.read_manifest(p, storage_options=opts).txid for s, p in paths.items()}, paths


def damage(path, opts, kind):
    """Damage the stored checkpoint at ``path``; returns the file that now fails."""
    fs, base = fsspec.core.url_to_fs(path, **opts)
    weights, manifest = f"{base}/{WEIGHTS}", f"{base}/{MANIFEST_NAME}"
    if kind == "flipped_byte":
        data = bytearray(fs.cat_file(weights))
        data[-5] ^= 0x01
        fs.pipe_file(weights, bytes(data))
        return WEIGHTS
    if kind == "truncated":
        fs.pipe_file(weights, fs.cat_file(weights)[:-9])
        return WEIGHTS
    if kind == "deleted_file":
        fs.rm_file(weights)
        return WEIGHTS
    if kind == "edited_manifest":
        body = json.loads(fs.cat_file(manifest))
        body["metadata"] = {"edited": True}  # still valid JSON, still naming its txid
        fs.pipe_file(manifest, json.dumps(body).encode())
        return MANIFEST_NAME
    assert kind == "deleted_manifest"
    fs.rm_file(manifest)
    return None  # nothing names the checkpoint's data any more: reported by step and txid


def stored(path, opts):
    fs, base = fsspec.core.url_to_fs(path, **opts)
    return {f: fs.cat_file(f) for f in fs.find(base)}


def abandoned(root, opts, txid):
    txckpt.forget_roots()
    (info,) = [c for c in txckpt.CheckpointRoot(root, opts).checkpoints("all") if c.txid == txid]
    return info


@pytest.mark.parametrize("kind", DAMAGE)
def test_fallback_forks_from_the_newest_checkpoint_that_verifies(any_root, kind, caplog):
    root, opts = any_root
    txids, paths = commit(root, opts)
    failing = damage(paths[6], opts, kind)
    caplog.set_level(logging.WARNING, logger="txckpt")
    head_before = read_state(open_storage(root, opts)).head

    got = txckpt.resume(root, on_damaged="fallback", storage_options=opts)

    assert txckpt.read_manifest(got, storage_options=opts).txid == txids[4]
    assert txckpt.load_checkpoint(got, storage_options=opts)["state.json"] == {"step": 4}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"checkpoint-6 (txid {txids[6]})" in warnings[0] and "Falling back to step 4" in warnings[0]
    if failing:
        assert f"/{failing}" in warnings[0]
    # A fork of the current lineage, recorded with why; the damaged one is in its abandoned set.
    state = read_state(open_storage(root, opts))
    assert state.head != head_before and state.head_tip.txid == txids[4]
    entry = json.loads(open_storage(root, opts).read_bytes(f".txckpt/log/{state.seq:020d}.json"))
    assert entry["action"] == "fork"
    # The entry does not list what it abandons (txckpt-log/2): the fold derives it, at this fork.
    txckpt.forget_roots()
    hist = txckpt.CheckpointRoot(root, opts).history()
    assert [t for t, at in hist.abandoned_at.items() if at == entry["time"]] == [txids[6]]
    assert [d["txid"] for d in entry["damaged"]] == [txids[6]]
    # The damaged checkpoint is untouched; a load of it still fails; the next save of step 6 commits.
    info = abandoned(root, opts, txids[6])
    assert info.state == "abandoned"
    if kind != "deleted_manifest":
        before = {
            k.rsplit("/", 1)[-1]: v for k, v in stored(paths[6] if info.path is None else info.path, opts).items()
        }
        with pytest.raises(IntegrityError):
            txckpt.verify_checkpoint(info.path, storage_options=opts)
    new6 = txckpt.save_checkpoint(root, 6, {"state.json": {"step": 6, "again": True}}, storage_options=opts)
    assert txckpt.get_last_checkpoint(root, storage_options=opts) is not None
    assert txckpt.load_checkpoint(new6, storage_options=opts)["state.json"] == {"step": 6, "again": True}
    info = abandoned(root, opts, txids[6])
    if kind != "deleted_manifest":
        after = {k.rsplit("/", 1)[-1]: v for k, v in stored(info.path, opts).items()}
        assert after == before


def test_txckpt_verify_still_reports_the_damaged_checkpoint(root, capsys):
    txids, paths = commit(root, None)
    damage(paths[6], {}, "flipped_byte")
    txckpt.resume(root, on_damaged="fallback")
    txckpt.save_checkpoint(root, 6, {"state.json": {}})
    assert cli.main(["verify", root]) == 1
    out = capsys.readouterr()
    assert f"{txids[6]}/checkpoint-6/{WEIGHTS}" in out.out + out.err


@pytest.mark.parametrize("kind", ["flipped_byte", "edited_manifest"])
def test_by_default_loading_the_damaged_newest_raises_naming_the_file_and_the_fallback(any_root, kind):
    root, opts = any_root
    txids, paths = commit(root, opts)
    failing = damage(paths[6], opts, kind)
    got = txckpt.resume(root, storage_options=opts)  # as cheap as before: no verification
    assert got == txckpt.get_last_checkpoint(root, storage_options=opts)
    with pytest.raises(IntegrityError) as e:
        txckpt.load_checkpoint(got, storage_options=opts)
    assert e.value.path is not None and e.value.path.endswith(f"/{failing}")
    assert 'on_damaged="fallback"' in str(e.value)
    assert read_state(open_storage(root, opts)).head_tip.txid == txids[6]


def test_damage_in_the_two_newest_falls_back_two(any_root, caplog):
    root, opts = any_root
    txids, paths = commit(root, opts)
    damage(paths[6], opts, "flipped_byte")
    damage(paths[4], opts, "truncated")
    caplog.set_level(logging.WARNING, logger="txckpt")
    got = txckpt.resume(root, on_damaged="fallback", storage_options=opts)
    assert txckpt.read_manifest(got, storage_options=opts).txid == txids[2]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"checkpoint-6 (txid {txids[6]})" in warning and f"checkpoint-4 (txid {txids[4]})" in warning
    assert warning.count(f"/{WEIGHTS}") >= 2 and "Falling back to step 2" in warning
    state = read_state(open_storage(root, opts))
    entry = json.loads(open_storage(root, opts).read_bytes(f".txckpt/log/{state.seq:020d}.json"))
    txckpt.forget_roots()
    hist = txckpt.CheckpointRoot(root, opts).history()  # the fold derives what the fork abandoned
    assert sorted(t for t, at in hist.abandoned_at.items() if at == entry["time"]) == sorted([txids[4], txids[6]])
    assert [d["txid"] for d in entry["damaged"]] == [txids[6], txids[4]]


def test_all_damaged_raises_a_typed_error_and_forks_nothing(any_root):
    root, opts = any_root
    txids, paths = commit(root, opts)
    for s, kind in ((2, "deleted_file"), (4, "edited_manifest"), (6, "flipped_byte")):
        damage(paths[s], opts, kind)
    before = read_state(open_storage(root, opts))
    with pytest.raises(NoIntactCheckpointError) as e:
        txckpt.resume(root, on_damaged="fallback", storage_options=opts)
    assert [d["txid"] for d in e.value.damaged] == [txids[6], txids[4], txids[2]]
    assert e.value.path.endswith(f"/{WEIGHTS}") and e.value.damaged[1]["path"].endswith(MANIFEST_NAME)
    assert isinstance(e.value, IntegrityError)
    after = read_state(open_storage(root, opts))
    assert after.seq == before.seq and after.head == before.head  # nothing appended: no fork, no claim


def test_an_intact_newest_is_verified_and_continued_without_a_fork(root):
    txids, paths = commit(root, None)
    before = read_state(open_storage(root, None))
    got = txckpt.resume(root, on_damaged="fallback")
    assert got == paths[6]
    after = read_state(open_storage(root, None))
    assert after.head == before.head and after.head_tip.txid == txids[6]
    txckpt.save_checkpoint(root, 8, {"state.json": {}})  # this process holds the lineage


def test_fallback_is_for_restarts_and_values_are_checked(root):
    commit(root, None)
    with pytest.raises(InvalidArgumentError, match="restart"):
        txckpt.resume(root, 4, on_damaged="fallback")
    with pytest.raises(InvalidArgumentError, match="on_damaged"):
        txckpt.resume(root, on_damaged="skip")


def test_integrity_errors_carry_their_path_across_processes():
    import pickle

    e = pickle.loads(pickle.dumps(NoIntactCheckpointError("m", path="/p", root="/r", damaged=[{"step": 1}])))
    assert (e.path, e.root, e.damaged) == ("/p", "/r", [{"step": 1}])
    assert pickle.loads(pickle.dumps(ManifestError("m", path="/q"))).path == "/q"


@pytest.mark.distributed
def test_every_rank_gets_rank_0s_decision_and_the_job_forks_once(tmp_path):
    from tests.children import dist_workers as dw
    from tests.harness import launcher

    root = str(tmp_path / "out")
    txids, paths = commit(root, None)
    damage(paths[6], {}, "flipped_byte")
    run = launcher.launch(2, dw.fallback_every_rank, str(tmp_path / "res"), root=root)
    for r in run.results:
        assert r.exitcode == 0 and r.ok is not None, run.describe() + "\n" + (r.trace or "")
    assert {r.ok["resumed"] for r in run.results} == {paths[4]}
    assert {r.ok["saved"] for r in run.results} == {f"{root}/checkpoint-5"}
    txckpt.forget_roots()
    r = txckpt.CheckpointRoot(root)
    assert len(r.history().state.lineages) == 2, "one fork for the job, not one per rank"
    assert [c.step for c in r.checkpoints()] == [2, 4, 5]
    assert txckpt.read_manifest(f"{root}/checkpoint-5").world_size == 2
