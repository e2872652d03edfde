"""TransactionalCheckpointMixin in-process, through the real Trainer (tiny model, CPU)."""

import json
import logging
import os
import types

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint as hf_get_last_checkpoint  # noqa: E402

import txckpt  # noqa: E402
from txckpt.integrations.transformers import TransactionalCheckpointMixin, TransactionalTrainer  # noqa: E402
from txckpt._base.refs import ExternalParent  # noqa: E402

from tests.harness.tiny import Data, TinyConfig, TinyModel, digests, make_args  # noqa: E402

pytestmark = pytest.mark.trainer
TF5 = int(transformers.__version__.split(".")[0]) >= 5


class Begin(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def train(out, max_steps, resume=None, data_seed=0, cls=TransactionalTrainer, callbacks=(), **overrides):
    torch.manual_seed(0)
    begin = Begin()
    trainer = cls(
        model=TinyModel(TinyConfig()),
        args=make_args(str(out), max_steps, **overrides),
        train_dataset=Data(data_seed),
        eval_dataset=Data(7, n=16),
        callbacks=[begin, *callbacks],
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.begin_step = begin.steps[0]
    return trainer


def current(out):
    txckpt.forget_roots()
    return {c.step: c for c in txckpt.CheckpointRoot(str(out)).checkpoints()}


def all_checkpoints(out):
    txckpt.forget_roots()
    return txckpt.CheckpointRoot(str(out)).checkpoints(lineage="all")


def state_json(path):
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def test_on_save_sees_the_committed_checkpoint(tmp_path):
    out = tmp_path / "out"
    seen = []

    class OnSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            seen.append((state.global_step, txckpt.verify_checkpoint(path).txid))

    train(out, 6, callbacks=[OnSave()])
    cps = current(out)
    assert sorted(cps) == [2, 4, 6]
    assert seen == [(s, cps[s].txid) for s in (2, 4, 6)]
    for c in cps.values():
        assert os.path.realpath(c.path) == os.path.realpath(out / f"checkpoint-{c.step}")
        files = set(txckpt.read_manifest(c.path).files)
        assert {
            "model.safetensors",
            "config.json",
            "optimizer.pt",
            "scheduler.pt",
            "rng_state.pth",
            "trainer_state.json",
            "training_args.bin",
        } <= files
    # Nothing but published checkpoints and txckpt's own directory in the output_dir.
    assert sorted(os.listdir(out)) == [".txckpt", "checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_best_model_checkpoint_is_the_published_path(tmp_path):
    out = tmp_path / "out"
    t = train(
        out,
        6,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        load_best_model_at_end=True,
    )
    best = t.state.best_model_checkpoint
    assert best is not None and ".txckpt" not in best
    cps = current(out)
    assert os.path.realpath(best) in {os.path.realpath(c.path) for c in cps.values()}
    # Step 2's save is always a new best (the first eval): upstream derived it from staging.
    assert state_json(cps[2].path)["best_model_checkpoint"] == str(out / "checkpoint-2")
    for c in cps.values():
        recorded = state_json(c.path)["best_model_checkpoint"]
        assert recorded is not None and ".txckpt" not in recorded
        assert os.path.isdir(recorded)
        txckpt.verify_checkpoint(c.path)  # the rewritten trainer_state.json is the committed one


def test_save_total_limit_1_never_deletes_other_lineages_newest_or_best(tmp_path):
    out = tmp_path / "out"
    # (transformers 4.x restores eval_steps from the resumed trainer_state.json: same args for A and B.)
    evaluate = dict(
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        load_best_model_at_end=True,
    )
    train(out, 6, **evaluate)  # run A: 2, 4, 6
    a = current(out)
    a_digests = {s: digests(a[s].path) for s in (4, 6)}
    t = train(out, 8, resume=str(out / "checkpoint-2"), data_seed=1, save_total_limit=1, **evaluate)
    assert t.begin_step == 2
    # Run A's checkpoints: untouched by rotation, the end-of-training cleanup, or retention.
    by_txid = {c.txid: c for c in all_checkpoints(out)}
    for s in (4, 6):
        c = by_txid[a[s].txid]
        assert c.state == "abandoned" and digests(c.path) == a_digests[s]
        txckpt.verify_checkpoint(c.path)
    # The end of training keeps only the best of the current lineage, as upstream does (it deletes
    # the newest too), by rolling the lineage back to it; the fork point 2 stays (run A needs it).
    cps = current(out)
    best = t.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    best_step = int(os.path.basename(best).split("-")[1])
    assert sorted(cps) == sorted({2, best_step})
    txckpt.verify_checkpoint(best)
    assert hf_get_last_checkpoint(str(out)) == txckpt.get_last_checkpoint(str(out)) == best


def test_save_total_limit_counts_the_current_lineage(tmp_path):
    out = tmp_path / "out"
    train(out, 6)
    a = current(out)
    train(out, 12, resume=str(out / "checkpoint-2"), data_seed=1, save_total_limit=2)
    live = current(out)
    # The two newest of the current lineage, plus the fork point (checkpoint-2, which run A's
    # lineage needs too); run B's 4, 6, 8 are gone, run A's abandoned 4 and 6 are kept.
    assert sorted(live) == [2, 10, 12]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == [
        "checkpoint-10",
        "checkpoint-12",
        "checkpoint-2",
    ]
    by_txid = {c.txid: c for c in all_checkpoints(out)}
    for s in (4, 6):
        assert by_txid[a[s].txid].state == "abandoned"
        txckpt.verify_checkpoint(by_txid[a[s].txid].path)
    assert sum(c.state == "retired" for c in by_txid.values()) == 3


def test_save_total_limit_keeps_the_best(tmp_path):
    out = tmp_path / "out"
    t = train(
        out,
        10,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        load_best_model_at_end=True,
    )
    live = current(out)
    best = t.state.best_model_checkpoint
    # As upstream: the best alone remains at the end of training (the newest goes if it is not it).
    assert [os.path.realpath(c.path) for c in live.values()] == [os.path.realpath(best)]


def test_from_pretrained_and_a_stock_trainer_resume_a_mixin_checkpoint(tmp_path):
    out = tmp_path / "out"
    t = train(out, 4)
    ckpt = out / "checkpoint-4"
    assert hf_get_last_checkpoint(str(out)) == str(ckpt)
    loaded = TinyModel.from_pretrained(str(ckpt))
    for k, v in t.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    stock = train(tmp_path / "stock", 6, resume=str(ckpt), cls=Trainer)
    assert stock.begin_step == 4 and stock.state.global_step == 6


def test_resume_none_on_a_root_with_checkpoints_starts_a_new_lineage(tmp_path, caplog):
    out = tmp_path / "out"
    train(out, 4)
    a = current(out)
    caplog.set_level(logging.WARNING, logger="txckpt")
    t = train(out, 4)
    assert t.begin_step == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("resume_from_checkpoint=None" in w and "checkpoint-4" in w for w in warnings), warnings
    assert any(a[4].txid in w and a[2].txid in w for w in warnings), warnings  # core names them
    b = current(out)
    assert sorted(b) == [2, 4] and {b[2].txid, b[4].txid}.isdisjoint({a[2].txid, a[4].txid})


def test_resume_true_continues_the_current_lineage(tmp_path):
    out = tmp_path / "out"
    train(out, 4)
    t = train(out, 6, resume=True)
    assert t.begin_step == 4
    assert sorted(current(out)) == [2, 4, 6]


def test_resume_true_without_checkpoints_raises_like_upstream(tmp_path):
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        train(tmp_path / "out", 2, resume=True)


def test_resume_from_outside_the_root_records_an_external_parent(tmp_path):
    other = tmp_path / "other"
    train(other, 4)
    txckpt.forget_roots()
    before = txckpt.CheckpointRoot(str(other)).state().seq
    out = tmp_path / "out"
    os.makedirs(out)
    t = train(out, 6, resume=str(other / "checkpoint-2"))
    assert t.begin_step == 2
    assert sorted(current(out)) == [4, 6]
    txckpt.forget_roots()
    head = txckpt.CheckpointRoot(str(out)).state().head_info
    assert head.parent == ExternalParent(str(other / "checkpoint-2"))
    assert txckpt.CheckpointRoot(str(other)).state().seq == before  # the other root is only read


def test_a_legacy_output_dir_is_adopted(tmp_path):
    out = tmp_path / "out"
    train(out, 4, cls=Trainer)
    assert not (out / ".txckpt").exists()
    t = train(out, 6, resume=True)
    assert t.begin_step == 4
    cps = current(out)
    assert sorted(cps) == [2, 4, 6]
    assert cps[2].adopted and cps[4].adopted and not cps[6].adopted


def test_a_failed_save_commits_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = Trainer._save_rng_state

    def failing(self, output_dir):
        if self.state.global_step == 4:
            raise OSError(28, "No space left on device (injected)")
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", failing)
    with pytest.raises(OSError, match="injected"):
        train(out, 6)
    monkeypatch.setattr(Trainer, "_save_rng_state", real)
    assert [c.step for c in all_checkpoints(out)] == [2]
    assert not (out / "checkpoint-4").exists()
    assert not list((out / ".txckpt" / "tx").glob("4-*/checkpoint-4"))  # staging removed on abort
    t = train(out, 6, resume=True)
    assert t.begin_step == 2 and sorted(current(out)) == [2, 4, 6]


def test_hub_push_runs_after_the_commit_from_the_committed_directory(tmp_path, monkeypatch):
    pushed = []
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, *a, **k: None)

    def fake_push(self, checkpoint_folder):
        pushed.append((checkpoint_folder, os.path.isfile(os.path.join(checkpoint_folder, txckpt.MANIFEST_NAME))))

    monkeypatch.setattr(Trainer, "_push_from_checkpoint", fake_push)
    out = tmp_path / "out"
    train(out, 4, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="nobody/nothing")
    assert pushed == [(str(out / "checkpoint-2"), True), (str(out / "checkpoint-4"), True)]


def test_the_mixin_must_come_first():
    with pytest.raises(TypeError, match="before Trainer"):

        class Wrong(Trainer, TransactionalCheckpointMixin):
            pass


def test_save_on_each_node_across_nodes_is_refused(monkeypatch):
    args = types.SimpleNamespace(save_on_each_node=True, world_size=4)
    from txckpt.integrations._trainer import paths

    for v in paths._LOCAL_WORLD_SIZE_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="save_on_each_node"):
        paths.check_save_on_each_node(args)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    paths.check_save_on_each_node(args)  # one node: fine
    paths.check_save_on_each_node(types.SimpleNamespace(save_on_each_node=False, world_size=4))


class RequestJIT(TrainerCallback):
    """Stands in for SIGTERM + kill_wait: ask for a JIT checkpoint at the end of ``at``."""

    def __init__(self, at):
        self.at = at
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            for cb in self.trainer.callback_handler.callbacks:
                if getattr(cb, "jit_manager", None) is not None:
                    cb.jit_manager.is_checkpoint_requested = True


def jit_train(out, at, **overrides):
    torch.manual_seed(0)
    req = RequestJIT(at)
    t = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(out), 8, enable_jit_checkpoint=True, **overrides),
        train_dataset=Data(0),
        callbacks=[req],
    )
    req.trainer = t
    t.train()
    return t


@pytest.mark.skipif(not TF5, reason="JIT checkpointing is transformers 5.x only")
def test_jit_checkpoint_goes_through_a_transaction(tmp_path):
    out = tmp_path / "out"
    t = jit_train(out, 3, save_steps=100)
    # Requested at the end of step 3, saved at the next on_step_begin (global_step still 3);
    # upstream then finishes that step before it stops.
    assert t.state.global_step == 4
    cps = current(out)
    assert sorted(cps) == [3]
    txckpt.verify_checkpoint(cps[3].path)
    assert not list(out.rglob("checkpoint-is-incomplete.txt"))
    assert sorted(os.listdir(out)) == [".txckpt", "checkpoint-3"]


@pytest.mark.skipif(not TF5, reason="JIT checkpointing is transformers 5.x only")
def test_jit_checkpoint_of_an_already_committed_step_is_skipped(tmp_path):
    out = tmp_path / "out"
    t = jit_train(out, 3, save_steps=3)
    assert t.state.global_step == 4  # no StepConflictError: the JIT save of step 3 was skipped
    cps = current(out)
    assert sorted(cps) == [3]
    assert not list(out.rglob("checkpoint-is-incomplete.txt"))


@pytest.mark.parametrize("strategy", ["every_save", "all_checkpoints"])
def test_hub_uploads_leave_out_txckpt_internals(tmp_path, monkeypatch, strategy):
    """Upstream uploads output_dir itself, ignoring only "_*" and "checkpoint-*": the root's
    .txckpt/ (log, abandoned checkpoints) must not go to the Hub."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    uploaded = []

    def init_hf_repo(self, *a, **k):
        self.hub_model_id = "nobody/nothing"
        self.push_in_progress = None

    def prepare(self, folder_path, path_in_repo, allow_patterns=None, ignore_patterns=None, **kw):
        rel = [os.path.relpath(os.path.join(d, f), folder_path) for d, _, fs in os.walk(folder_path) for f in fs]
        uploaded.append(
            (
                os.path.basename(folder_path),
                sorted(filter_repo_objects(rel, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)),
            )
        )
        raise RuntimeError("no network in tests")

    monkeypatch.setattr(Trainer, "init_hf_repo", init_hf_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "_prepare_upload_folder_additions", prepare)
    out = tmp_path / "out"
    train(out, 4)  # a first run, so that .txckpt/ holds more than one lineage's data
    train(out, 4, resume=str(out / "checkpoint-2"), data_seed=1, push_to_hub=True, hub_strategy=strategy)
    assert uploaded, "no upload was attempted"
    for folder, files in uploaded:
        assert not [f for f in files if ".txckpt" in f], (folder, files)
    assert ("out",) == tuple({folder for folder, _ in uploaded} - {"checkpoint-4"})
