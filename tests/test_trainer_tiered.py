"""The Trainer on a TieredRoot (docs/tiered.md): ``txckpt_root=TieredRoot(fast, durable)`` saves
to the fast tier and each commit becomes durable; ``save_total_limit`` never retires a
checkpoint that is not durable; on a new node (the fast tier gone) ``resume_from_checkpoint=True``
restores the durable tip onto the fast tier and continues exactly where the run stopped."""

import shutil

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import txckpt  # noqa: E402
from txckpt.integrations.transformers import TransactionalTrainer  # noqa: E402
from txckpt._root.root import forget_roots  # noqa: E402
from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args  # noqa: E402

pytestmark = pytest.mark.trainer


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class Begin(TrainerCallback):
    step = None

    def on_train_begin(self, args, state, control, **kwargs):
        type(self).step = state.global_step


def train(tmp_path, root, steps, resume=None, **kw):
    torch.manual_seed(0)
    t = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(tmp_path / "out"), steps, **kw),
        train_dataset=Data(0),
        txckpt_root=root,
        callbacks=[Begin(), *kw.pop("cbs", [])],
    )
    t.train(resume_from_checkpoint=resume)
    return t


def tiered(tmp_path):
    forget_roots()
    return txckpt.TieredRoot(str(tmp_path / "fast"), str(tmp_path / "durable"))


def test_the_trainer_saves_through_a_tiered_root_and_a_new_node_resumes_from_the_durable_tier(tmp_path):
    root = tiered(tmp_path)
    torch.manual_seed(0)
    t = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(tmp_path / "out"), 6),
        train_dataset=Data(0),
        txckpt_root=root,
        callbacks=[StopAt(4)],
    )
    t.train()
    root.wait_durable()
    durable = txckpt.CheckpointRoot(root.durable)
    assert [c.step for c in durable.checkpoints("current")] == [2, 4]
    assert durable.state().head == root.fast_root.state().head

    shutil.rmtree(root.fast)  # a new node
    root = tiered(tmp_path)
    torch.manual_seed(0)
    t = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(tmp_path / "out"), 6),
        train_dataset=Data(0),
        txckpt_root=root,
        callbacks=[Begin()],
    )
    t.train(resume_from_checkpoint=True)
    assert Begin.step == 4  # restored onto the fast tier, then resumed
    root.wait_durable()
    assert [c.step for c in txckpt.CheckpointRoot(root.durable).checkpoints("current")] == [2, 4, 6]
    assert [c.step for c in root.fast_root.checkpoints("current")] == [4, 6]
    # Exactly where a straight run of 6 steps ends.
    torch.manual_seed(0)
    TransactionalTrainer(
        model=TinyModel(TinyConfig()), args=make_args(str(tmp_path / "straight"), 6), train_dataset=Data(0)
    ).train()
    ref = txckpt.load_checkpoint(tmp_path / "straight" / "checkpoint-6", files=["model.safetensors"])
    got = txckpt.load_checkpoint(root, files=["model.safetensors"])
    for k, v in ref["model.safetensors"].items():
        assert torch.equal(got["model.safetensors"][k], v), k


def test_save_total_limit_keeps_what_is_not_durable_yet(tmp_path, monkeypatch):
    monkeypatch.setattr(txckpt.TieredRoot, "_kick", lambda self: None)  # a durable tier that lags
    root = tiered(tmp_path)
    torch.manual_seed(0)
    TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(tmp_path / "out"), 6, save_total_limit=1),
        train_dataset=Data(0),
        txckpt_root=root,
    ).train()
    assert [c.step for c in root.fast_root.checkpoints("current")] == [2, 4, 6]  # none durable: all kept
    root.wait_durable()
    assert [c.step for c in txckpt.CheckpointRoot(root.durable).checkpoints("current")] == [2, 4, 6]
    assert [i.step for i in root.apply_retention(txckpt.RetentionPolicy(keep_last=1))] == [2, 4]


def test_storage_options_belong_to_the_tiered_root(tmp_path):
    with pytest.raises(txckpt.errors.InvalidArgumentError, match="give the storage options to the TieredRoot"):
        TransactionalTrainer(
            model=TinyModel(TinyConfig()),
            args=make_args(str(tmp_path / "out"), 2),
            train_dataset=Data(0),
            txckpt_root=tiered(tmp_path),
            txckpt_storage_options={},
        )


def test_a_hyperparameter_search_trial_is_replicated_to_the_same_sub_path_of_the_durable_tier(tmp_path):
    """A trial saves into ``<fast>/run-<id>`` (upstream's run directory under the root): that
    sub-root is replicated to ``<durable>/run-<id>`` and its retention guarded, as the run's root."""
    from transformers.trainer_utils import HPSearchBackend

    class Trial:  # what Trainer._get_output_dir reads of an optuna trial
        number = 3

    root = tiered(tmp_path)
    torch.manual_seed(0)
    t = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(tmp_path / "out"), 2, save_total_limit=1),
        train_dataset=Data(0),
        txckpt_root=root,
    )
    t.hp_search_backend = HPSearchBackend.OPTUNA
    t.create_optimizer_and_scheduler(num_training_steps=2)  # what train() makes before its saves
    trial_root = t._txckpt_root(Trial())
    assert trial_root == str(tmp_path / "fast" / "run-3")
    sub = t._txckpt_tiered_trials[trial_root]
    sub._kick = lambda: None  # a durable tier that lags: retention must keep what is not durable
    for step in (1, 2):
        t.state.global_step = step
        t._save_checkpoint(t.model, Trial())
    # save_total_limit=1 ran after each commit: nothing durable yet, so nothing retired
    assert [c.step for c in txckpt.CheckpointRoot(trial_root).checkpoints("current")] == [1, 2]
    sub.wait_durable()
    durable = txckpt.CheckpointRoot(str(tmp_path / "durable" / "run-3"))
    assert [c.step for c in durable.checkpoints("current")] == [1, 2]
    assert txckpt.verify_checkpoint(durable.locate(durable.history().find(step=2).ref)) is not None
    assert not txckpt.CheckpointRoot(root.durable).checkpoints("current")  # the run's own root: untouched


def test_the_documented_restart_line_resumes_a_new_node_in_the_same_lineage(tmp_path, caplog):
    """docs/trainer.md's one line for the first run, each restart and a new node:
    ``train(resume_from_checkpoint=txckpt.get_last_checkpoint(root, missing_ok=True))``. On a new
    node the lookup answers the durable tier's path; the Trainer resumes it, never forks from it."""

    def line(root, cbs):
        torch.manual_seed(0)
        t = TransactionalTrainer(
            model=TinyModel(TinyConfig()),
            args=make_args(str(tmp_path / "out"), 6),
            train_dataset=Data(0),
            txckpt_root=root,
            callbacks=[Begin(), *cbs],
        )
        t.train(resume_from_checkpoint=txckpt.get_last_checkpoint(root, missing_ok=True))

    root = tiered(tmp_path)
    line(root, [StopAt(2)])  # the first run: the lookup answers None
    assert Begin.step == 0
    root.wait_durable()
    lineage = txckpt.CheckpointRoot(root.durable).state().head

    root = tiered(tmp_path)  # a restart on the same node, one fast file lost meanwhile
    (tmp_path / "fast" / "checkpoint-2" / "model.safetensors").unlink()
    line(root, [StopAt(4)])
    assert Begin.step == 2
    assert list(root.last_fetched) == ["model.safetensors"]
    root.wait_durable()

    shutil.rmtree(root.fast)  # a new node
    root = tiered(tmp_path)
    with caplog.at_level("WARNING"):
        line(root, [])
    assert Begin.step == 4
    assert not [r for r in caplog.records if "abandons" in r.getMessage()]
    root.wait_durable()
    durable = txckpt.CheckpointRoot(root.durable)
    assert durable.state().head == lineage == root.fast_root.state().head  # no fork
    assert [c.step for c in durable.checkpoints("current")] == [2, 4, 6]
