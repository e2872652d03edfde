"""TransactionalCheckpointMixin with a remote txckpt root (S3 on the moto server) and a local
output_dir: saves upload and commit to S3, resumes and the best model are fetched into the local
cache, verified; the seed report's torn crash and a rank killed mid-save, on S3."""

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

import txckpt  # noqa: E402
from txckpt.integrations.transformers import TransactionalTrainer  # noqa: E402
from txckpt._storage import open_storage  # noqa: E402

from tests.harness.procs import torchrun as run_torchrun  # noqa: E402

HERE = Path(__file__).parent / "children"
from tests.harness.tiny import FILES, Data, TinyConfig, TinyModel, make_args  # noqa: E402

pytestmark = [pytest.mark.trainer, pytest.mark.s3]
CACHE = ".txckpt-cache"


class Begin(TrainerCallback):
    """What the run sees when training begins: the step, the best checkpoint, the cache."""

    def __init__(self, cache):
        self.cache = cache
        self.step = self.best = None
        self.cached = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.step, self.best = state.global_step, state.best_model_checkpoint
        self.cached = sorted(p for p in Path(self.cache).glob("*/checkpoint-*")) if os.path.isdir(self.cache) else []


class StopAt(TrainerCallback):
    """Stops training after ``step`` (its checkpoint saved), like a job whose time ran out."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def train(out, max_steps, s3, resume=None, data_seed=0, callbacks=(), **overrides):
    url, opts = s3
    torch.manual_seed(0)
    begin = Begin(os.path.join(out, CACHE))
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(out), max_steps, **overrides),
        train_dataset=Data(data_seed),
        eval_dataset=Data(7, n=16),
        callbacks=[begin, *callbacks],
        txckpt_root=url,
        txckpt_storage_options=opts,
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.begin = begin
    return trainer


def current(s3):
    txckpt.forget_roots()
    return {c.step: c for c in txckpt.CheckpointRoot(*s3).checkpoints()}


def everything(s3):
    txckpt.forget_roots()
    return {c.txid: c for c in txckpt.CheckpointRoot(*s3).checkpoints(lineage="all")}


def remote_digests(path, opts, files=FILES):
    storage = open_storage(path, opts)
    return {f: hashlib.sha1(storage.read_bytes(f)).hexdigest() for f in files}


def remote_state(path, opts):
    return json.loads(open_storage(path, opts).read_bytes("trainer_state.json"))


def assert_holds_exactly_its_manifest(path, opts):
    """Every object under the checkpoint's key is in its manifest and matches it; nothing else."""
    manifest = txckpt.verify_checkpoint(path, storage_options=opts)
    names = {name for name, _ in open_storage(path, opts).walk_files("")}
    assert names == set(manifest.files) | {txckpt.MANIFEST_NAME}
    return manifest


def local_leftovers(out):
    """Files in output_dir that txckpt put there (the cache's checkpoint copies excluded)."""
    found = []
    for d, _, fs in os.walk(out):
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), out)
            found.append(rel)
    return sorted(found)


def state_dict_of(path, opts):
    return txckpt.load_checkpoint(path, files=["model.safetensors"], storage_options=opts)["model.safetensors"]


def test_saves_commit_to_s3_and_resume_true_fetches_a_verified_copy(tmp_path, s3_root):
    url, opts = s3_root
    out = tmp_path / "out"
    train(out, 6, s3_root, callbacks=[StopAt(4)])
    cps = current(s3_root)
    assert sorted(cps) == [2, 4]
    for c in cps.values():
        assert c.path.startswith(url + "/.txckpt/tx/") and c.path.endswith(f"/checkpoint-{c.step}")
        files = set(txckpt.verify_checkpoint(c.path, storage_options=opts).files)
        assert {
            "model.safetensors",
            "config.json",
            "optimizer.pt",
            "scheduler.pt",
            "rng_state.pth",
            "trainer_state.json",
            "training_args.bin",
        } <= files
    # Nothing of txckpt's in the local output_dir: no log, no checkpoint, no staging leftover.
    assert not (out / ".txckpt").exists() and not list(out.glob("checkpoint-*"))
    assert local_leftovers(out) == []

    t = train(out, 6, s3_root, resume=True)
    assert t.begin.step == 4
    # It resumed from the local copy of checkpoint-4 (fetched, verified) ...
    assert [p.parent.name for p in t.begin.cached] == [cps[4].txid]
    # ... which is gone once the next checkpoint is committed.
    assert not (out / CACHE / cps[4].txid).exists()
    after = current(s3_root)
    assert sorted(after) == [2, 4, 6] and after[4].txid == cps[4].txid
    assert local_leftovers(out) == []

    # The resumed run continued exactly where the first one stopped (model, optimizer,
    # scheduler and rng state all came from the copy): same weights as one run of 6 steps.
    straight = tmp_path / "straight"
    torch.manual_seed(0)
    TransactionalTrainer(model=TinyModel(TinyConfig()), args=make_args(str(straight), 6), train_dataset=Data(0)).train()
    reference = txckpt.load_checkpoint(straight / "checkpoint-6", files=["model.safetensors"])["model.safetensors"]
    resumed = state_dict_of(after[6].path, opts)
    for k, v in reference.items():
        assert torch.equal(resumed[k], v), k


def test_best_model_checkpoint_names_the_committed_remote_checkpoint(tmp_path, s3_root, caplog):
    url, opts = s3_root
    out = tmp_path / "out"
    # greater_is_better=True on the loss: the best is the first evaluation, not the last, so
    # load_best_model_at_end must really load an older checkpoint (fetched from S3).
    best_args = dict(
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        load_best_model_at_end=True,
    )
    t = train(out, 4, s3_root, **best_args)
    cps = current(s3_root)
    best = t.state.best_model_checkpoint
    assert best == cps[2].path and best.startswith(url + "/.txckpt/tx/")
    for c in cps.values():
        assert remote_state(c.path, opts)["best_model_checkpoint"] == cps[2].path
        txckpt.verify_checkpoint(c.path, storage_options=opts)  # the rewritten state is the committed one
    loaded = {k: v for k, v in t.model.state_dict().items()}
    for k, v in state_dict_of(cps[2].path, opts).items():
        assert torch.equal(loaded[k], v), k
    assert any(not torch.equal(loaded[k], v) for k, v in state_dict_of(cps[4].path, opts).items())

    # A resumed run keeps the remote best (transformers 5.x would drop it as "not a directory").
    caplog.set_level(logging.WARNING)
    t = train(out, 6, s3_root, resume=True, **best_args)
    assert t.begin.step == 4 and t.begin.best == cps[2].path
    assert not [r for r in caplog.records if "does not exist anymore" in r.getMessage()]
    assert t.state.best_model_checkpoint == cps[2].path


@pytest.mark.parametrize("form", ["committed path", "<root>/checkpoint-2", "<output_dir>/checkpoint-2"])
def test_rollback_to_an_older_remote_checkpoint_forks_and_warns(tmp_path, s3_root, caplog, form):
    url, opts = s3_root
    out = tmp_path / "out"
    train(out, 4, s3_root)
    a = current(s3_root)
    a4 = remote_digests(a[4].path, opts)
    target = {
        "committed path": a[2].path,
        "<root>/checkpoint-2": f"{url}/checkpoint-2",
        "<output_dir>/checkpoint-2": str(out / "checkpoint-2"),
    }[form]
    caplog.set_level(logging.WARNING, logger="txckpt")
    t = train(out, 4, s3_root, resume=target, data_seed=1)
    assert t.begin.step == 2
    warnings = [r.getMessage() for r in caplog.records if "rolling back" in r.getMessage()]
    assert len(warnings) == 1 and a[4].txid in warnings[0], warnings
    b = current(s3_root)
    assert sorted(b) == [2, 4] and b[2].txid == a[2].txid and b[4].txid != a[4].txid
    assert everything(s3_root)[a[4].txid].state == "abandoned"
    assert remote_digests(a[4].path, opts) == a4
    assert_holds_exactly_its_manifest(a[4].path, opts)


def test_save_total_limit_on_a_remote_root(tmp_path, s3_root):
    url, opts = s3_root
    out = tmp_path / "out"
    train(out, 6, s3_root, save_total_limit=2)
    assert sorted(current(s3_root)) == [4, 6]
    gone = [c for c in everything(s3_root).values() if c.state == "retired"]
    assert [c.step for c in gone] == [2]
    storage = open_storage(url, opts)
    for c in gone:
        assert c.path is None
        assert not list(storage.walk_files(f".txckpt/tx/{c.txid}"))


def test_an_older_best_is_resolved_and_kept_alone_on_a_remote_root(tmp_path, s3_root):
    """eval_strategy="epoch", save_strategy="steps": the evaluation that makes step 4 the best
    runs after its commit; the best is resolved to step 4's committed remote key, survives
    rotation, and with save_total_limit=1 it alone remains at the end (its objects stay, the
    rest are deleted from the store)."""
    url, opts = s3_root
    torch.manual_seed(0)
    args = make_args(
        str(tmp_path / "out"),
        -1,
        num_train_epochs=3,
        eval_strategy="epoch",
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        metric_for_best_model="accuracy",
        greater_is_better=True,
    )
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=args,
        train_dataset=Data(0, n=16),
        eval_dataset=Data(7, n=8),
        txckpt_root=url,
        txckpt_storage_options=opts,
    )
    accuracies = iter([0.59, 0.57, 0.55])
    trainer._evaluate = lambda *a, **k: {"eval_accuracy": next(accuracies)}
    trainer.train()
    cps = current(s3_root)
    assert sorted(cps) == [4]
    assert trainer.state.best_model_checkpoint == cps[4].path
    assert txckpt.get_last_checkpoint(url, storage_options=opts) == cps[4].path
    txckpt.verify_checkpoint(cps[4].path, storage_options=opts)
    storage = open_storage(url, opts)
    for c in everything(s3_root).values():
        if c.state == "retired":
            assert not list(storage.walk_files(f".txckpt/tx/{c.txid}"))


def test_hub_push_from_a_remote_root_pushes_a_verified_local_copy(tmp_path, s3_root, monkeypatch):
    url, opts = s3_root
    pushed = []

    def init_hf_repo(self, *a, **k):
        self.push_in_progress = None

    def fake_push(self, checkpoint_folder):
        pushed.append((checkpoint_folder, txckpt.verify_checkpoint(checkpoint_folder).txid))

    monkeypatch.setattr(Trainer, "init_hf_repo", init_hf_repo)
    monkeypatch.setattr(Trainer, "_push_from_checkpoint", fake_push)
    out = tmp_path / "out"
    train(out, 4, s3_root, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="nobody/nothing")
    cps = current(s3_root)
    assert pushed == [(str(out / CACHE / "push" / cps[s].txid / f"checkpoint-{s}"), cps[s].txid) for s in (2, 4)]
    assert not list((out / CACHE / "push").iterdir())  # finished pushes' copies are removed


# ----- real processes: the seed report's torn crash, and a rank killed mid-save ---------------
def script_env(s3_root):
    url, opts = s3_root
    return dict(
        os.environ,
        TXCKPT_TEST_ROOT=url,
        TXCKPT_TEST_STORAGE_OPTIONS=json.dumps(opts),
        TXCKPT_COORDINATION_TIMEOUT="60",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )


def run(env, *args, expect_rc=0):
    # A plain subprocess, not the zygote: OMP_NUM_THREADS=1 (read when torch loads) would need a
    # zygote of its own (tests/harness/zygote.py, OWN_SERVER_VARIABLES), and this file launches one
    # child, so starting it costs what the fork saves (measured: test_torn_on_s3 22.2 s that way,
    # 19.6 s plain).
    p = subprocess.run(
        [sys.executable, str(HERE / "trainer_rollback.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(HERE),
    )
    if p.returncode != expect_rc:
        raise AssertionError(
            f"{args}: rc {p.returncode} (expected {expect_rc})\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-6000:]}"
        )
    return p


def begins_at(p):
    lines = [line for line in p.stdout.splitlines() if "training begins at global_step=" in line]
    assert len(lines) == 1, p.stdout
    return int(lines[0].rsplit("=", 1)[1])


def test_torn_on_s3(tmp_path, s3_root):
    """The seed report's torn scenario with the root on S3: run B (rolled back to step 2 with the
    seed's own spelling, <output_dir>/checkpoint-2) is SIGKILLed while re-saving step 4. Run A's
    checkpoint-4 is untouched, and the restart with resume_from_checkpoint=True resumes run B's
    lineage at step 2. Run A and the restart are the script's runs, in-process (as a fresh
    process would be: forget_roots); run B is a real process, really killed."""
    url, opts = s3_root
    out = tmp_path / "out"
    assert train(out, 4, s3_root).begin.step == 0  # trainer_rollback.py run-a OUT 4
    a = current(s3_root)
    assert sorted(a) == [2, 4]
    a4_before = remote_digests(a[4].path, opts)

    p = run(script_env(s3_root), "run-b", out, "torn", 4, "kill", expect_rc=-9)
    assert begins_at(p) == 2
    lines = p.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if "rolling back" in line and "abandons" in line]
    assert len(starts) == 1, p.stderr
    block = [lines[starts[0]]]  # the warning: its first line and the indented lines under it
    for line in lines[starts[0] + 1 :]:
        if not line.startswith("  "):
            break
        block.append(line)
    assert a[4].txid in "\n".join(block), p.stderr
    assert list((out / CACHE / "staging").iterdir())  # the killed save's local scratch

    old = everything(s3_root)
    assert [c.step for c in old.values() if c.state == "current"] == [2]
    assert old[a[4].txid].state == "abandoned"
    assert remote_digests(a[4].path, opts) == a4_before
    assert_holds_exactly_its_manifest(a[4].path, opts)
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(url, storage_options=opts) == a[2].path

    txckpt.forget_roots()
    assert train(out, 8, s3_root, resume=True, data_seed=1).begin.step == 2  # trainer_rollback.py restart OUT
    b = current(s3_root)
    assert sorted(b) == [2, 4, 6, 8] and b[2].txid == a[2].txid and b[4].txid != a[4].txid
    b4 = assert_holds_exactly_its_manifest(b[4].path, opts)
    assert b4.lineage != a[4].lineage
    b4_digests = remote_digests(b[4].path, opts)
    for f in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert b4_digests[f] != a4_before[f], f
    assert remote_digests(a[4].path, opts) == a4_before
    assert_holds_exactly_its_manifest(a[4].path, opts)
    # The restart removed the killed save's scratch at its start, and the resumed copy after its
    # first commit.
    assert local_leftovers(out) == []


@pytest.mark.distributed
def test_two_ranks_on_s3_rank_killed_mid_save_then_resume(tmp_path, s3_root):
    """torchrun, 2 ranks (gloo, CPU), root on S3: rank 1 dies while saving step 4, so nothing is
    committed for it; the restart fetches checkpoint-2 once into the shared cache and both ranks
    resume from it. Every committed manifest lists both ranks' rng files."""
    url, opts = s3_root
    out = tmp_path / "out"
    env = script_env(s3_root)

    def torchrun(*args, ok=True):
        return run_torchrun(str(HERE / "trainer_ddp.py"), *args, env=env, expect_ok=ok)

    p = torchrun(out, 4, "none", 4, ok=False)
    assert "rank 1: killing myself while saving step 4" in p.stdout
    assert [c.step for c in everything(s3_root).values()] == [2]

    p = torchrun(out, 4, "true")
    assert p.stdout.count("training begins at global_step=2") == 2, p.stdout
    assert "rank 0: finished at step 4" in p.stdout and "rank 1: finished at step 4" in p.stdout
    cps = current(s3_root)
    assert sorted(cps) == [2, 4]
    for c in cps.values():
        files = set(txckpt.verify_checkpoint(c.path, storage_options=opts).files)
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= files, files
    assert local_leftovers(out) == []
