"""TransactionalTrainer(..., txckpt_async_save=True): the Trainer's saves in the background.

* The seed report's torn and abandoned scenarios (tests/test_trainer_rollback.py) with async
  saves, a real SIGKILL: torn dies inside the background save, right after model.safetensors.
* An async checkpoint (copy-first or lazy) holds the same files with the same bytes as a
  synchronous one of the same run (the state keeps changing after each snapshot: nothing of it may reach the checkpoint),
  the best checkpoint is named the same, on_save sees each committed checkpoint, in step order,
  and train() returns with every save committed and followed up (retention).
* A background failure (ENOSPC) is raised by train() at the next save, the sync path's error.
* Two ranks (torchrun, gloo): rank 1 dies inside the background save: nothing commits, the
  restart resumes on both ranks.
"""

import errno
import json
import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import txckpt  # noqa: E402
from tests import test_trainer_ddp as ddp  # noqa: E402
from tests import test_trainer_rollback as rollback  # noqa: E402

HERE = Path(__file__).parent / "children"
from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args  # noqa: E402

from txckpt.integrations.transformers import TransactionalTrainer  # noqa: E402

pytestmark = pytest.mark.trainer


@pytest.fixture
def async_env(monkeypatch):
    monkeypatch.setenv("TXCKPT_TEST_ASYNC", "1")  # the scripts' Trainer gets txckpt_async_save=True


@pytest.mark.process  # the rollback scripts run real Trainer processes
def test_torn(tmp_path, async_env):
    rollback.test_torn(tmp_path, "kill")


@pytest.mark.process
def test_abandoned(tmp_path, async_env):
    rollback.test_abandoned(tmp_path, "kill")


@pytest.mark.distributed
def test_rank_killed_in_background_save_commits_nothing(tmp_path, async_env):
    ddp.test_rank_killed_mid_save_commits_nothing_and_restart_resumes(tmp_path)


class Seen(TrainerCallback):
    """on_save: the step and whether checkpoint-<step> is committed and verifies then."""

    def __init__(self, out):
        self.out, self.saves = out, []

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(self.out, f"checkpoint-{state.global_step}")
        try:
            txckpt.verify_checkpoint(path)
            self.saves.append((state.global_step, True))
        except txckpt.TxckptError:
            self.saves.append((state.global_step, False))


def train(out, async_save, **overrides):
    torch.manual_seed(0)
    args = make_args(
        str(out),
        8,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        save_total_limit=2,
        **overrides,
    )
    seen = Seen(str(out))
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=args,
        train_dataset=Data(0),
        eval_dataset=Data(1, n=16),
        callbacks=[seen],
        txckpt_async_save=async_save,
    )
    trainer.train()
    return trainer, seen


def manifests(out):
    """Per committed step: every file's size and digest, but trainer_state.json's content with
    its timings left out (an evaluation's runtime differs from one run to the next), and
    training_args.bin's arguments (on transformers 4.x without the clock-named logging_dir)."""
    txckpt.forget_roots()
    result = {}
    for c in txckpt.CheckpointRoot(out).checkpoints():
        with open(os.path.join(c.path, txckpt.MANIFEST_NAME)) as f:
            files = json.load(f)["files"]
        result[c.step] = {name: (e["size"], e["xxh3_128"]) for name, e in files.items()}
        state = json.loads((Path(c.path) / "trainer_state.json").read_text())
        for entry in state["log_history"]:
            for k in [k for k in entry if k.endswith(("_runtime", "_per_second"))]:
                del entry[k]
        result[c.step]["trainer_state.json"] = state
        if "training_args.bin" in files:
            # The arguments themselves, but logging_dir: transformers 4.x derives its default from
            # the clock (runs/<date-time>_<host>), so the pickle differs between any two runs.
            saved = torch.load(Path(c.path) / "training_args.bin", weights_only=False).to_dict()
            if _CLOCKED_LOGGING_DIR:
                saved.pop("logging_dir", None)
            result[c.step]["training_args.bin"] = saved
    return result


#: transformers 4.x: TrainingArguments.logging_dir defaults to a directory named by the clock.
_CLOCKED_LOGGING_DIR = int(transformers.__version__.split(".")[0]) < 5


def test_same_checkpoints_as_sync_and_train_returns_committed(tmp_path):
    # The same run twice in the same output_dir (training_args.bin records it), moved aside.
    out = tmp_path / "out"
    runs = {}
    for mode in ("sync", "async", "copy"):
        trainer, seen = train(out, {"sync": False, "async": True, "copy": "copy"}[mode])
        assert txckpt._async.asyncsave.pending_saves() == 0
        runs[mode] = (
            manifests(out),
            seen.saves,
            trainer.state.best_model_checkpoint,
            json.loads((Path(trainer.state.best_model_checkpoint) / "trainer_state.json").read_text()),
        )
        # True is lazy here (an AdamW): the optimizer step after each save but the last (the end
        # of training) waited for the background's copy of the parameters and optimizer state.
        assert len(trainer._txckpt_async.copy_waits) == (3 if mode == "async" else 0)
        txckpt.forget_roots()
        out.rename(tmp_path / mode)
    assert runs["copy"][0] == runs["async"][0]  # copy-first and lazy: the same bytes
    (sync, sync_seen, sync_best, sync_state), (asyn, async_seen, async_best, async_state) = runs["sync"], runs["async"]
    # Retention (save_total_limit=2, the best kept) ran after every commit: the same survivors.
    assert sorted(asyn) == sorted(sync) and 8 in asyn
    for step in sync:
        assert set(asyn[step]) >= {
            "model.safetensors",
            "optimizer.pt",
            "scheduler.pt",
            "rng_state.pth",
            "trainer_state.json",
            "training_args.bin",
        }
        assert asyn[step] == sync[step], step  # every file: same size and digest
    # on_save ran for every save, in step order, each time on a committed checkpoint.
    assert async_seen == sync_seen == [(2, True), (4, True), (6, True), (8, True)]
    # The best checkpoint is the published one (not the capture's scratch), named alike inside.
    assert os.path.basename(async_best) == os.path.basename(sync_best)
    assert os.path.dirname(async_best) == str(out)
    assert async_state["best_model_checkpoint"] == sync_state["best_model_checkpoint"] == async_best


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_background_enospc_is_raised_by_train_at_the_next_save(tmp_path, monkeypatch, mode):
    import transformers.modeling_utils as mu

    real = mu.safe_save_file
    where = {}

    def full_disk(tensors, filename, *args, **kwargs):
        if os.path.basename(os.path.dirname(filename)) == "checkpoint-4" and ".txckpt" in filename:
            where["thread"] = threading.current_thread()
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(mu, "safe_save_file", full_disk)
    out = tmp_path / "out"
    torch.manual_seed(0)
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(out), 8),
        train_dataset=Data(0),
        txckpt_async_save=mode == "async",
    )
    with pytest.raises(OSError) as info:
        trainer.train()
    assert info.value.errno == errno.ENOSPC
    assert (where["thread"] is threading.main_thread()) == (mode == "sync")
    # Raised where the next save begins (step 6), before it saved anything; nothing of step 4.
    assert trainer.state.global_step == (6 if mode == "async" else 4)
    txckpt.forget_roots()
    assert [c.step for c in txckpt.CheckpointRoot(out).checkpoints(lineage="all")] == [2]
    assert txckpt._async.asyncsave.pending_saves() == 0
    txckpt.wait_for_saves()  # train() reported the error: it is not raised a second time


@pytest.mark.s3
def test_async_saves_on_s3_commit_and_resume(tmp_path, s3_root):
    """A remote root: the background uploads and commits; retention and the local cache follow
    each commit; resume_from_checkpoint=True continues from the newest one."""
    url, opts = s3_root
    out = tmp_path / "out"

    def run(max_steps, resume=None):
        torch.manual_seed(0)
        trainer = TransactionalTrainer(
            model=TinyModel(TinyConfig()),
            args=make_args(str(out), max_steps, save_total_limit=2),
            train_dataset=Data(0),
            txckpt_root=url,
            txckpt_storage_options=opts,
            txckpt_async_save=True,
        )
        trainer.train(resume_from_checkpoint=resume)
        txckpt.forget_roots()
        return trainer, {c.step: c for c in txckpt.CheckpointRoot(url, opts).checkpoints()}

    _, cps = run(4)
    assert sorted(cps) == [2, 4]
    trainer, cps = run(8, resume=True)
    assert sorted(cps) == [6, 8]  # save_total_limit=2 after every commit
    for c in cps.values():
        assert c.path.startswith(url + "/.txckpt/tx/")
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(
            txckpt.verify_checkpoint(c.path, storage_options=opts).files
        )
    # Nothing of txckpt's left in the local output_dir (scratch uploads and cached copies gone).
    assert not (out / ".txckpt").exists()
    assert [p for p in out.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(
    "optim, mode",
    [
        ("adamw_torch", "lazy"),
        ("adafactor", "lazy"),
        ("galore_adamw_layerwise", "copy"),
        ("adalomo", "copy"),
        ("lomo", "copy"),
    ],
)
def test_true_is_lazy_unless_the_optimizer_changes_parameters_in_backward(optim, mode):
    from types import SimpleNamespace

    from transformers.training_args import OptimizerNames

    from txckpt.integrations._trainer import async_saves as trainer_async

    t = SimpleNamespace(
        args=SimpleNamespace(optim=OptimizerNames(optim)),
        optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
        txckpt_async_save=True,
    )
    assert trainer_async.snapshot_mode(t) == mode
    t.txckpt_async_save = "lazy"  # asked for: as asked
    assert trainer_async.snapshot_mode(t) == "lazy"

    class LayerWiseDummyOptimizer(torch.optim.SGD):  # transformers' placeholder's name
        pass

    t.txckpt_async_save = True
    t.args.optim, t.optimizer = "adamw_torch", LayerWiseDummyOptimizer([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert trainer_async.snapshot_mode(t) == "copy"


def test_lazy_snapshot_keeps_the_live_storages_and_copies_the_rest():
    """The eager half of a lazy snapshot: parameters' and optimizer state's storages stay live
    (the background copies them), everything else is copied at once."""
    from txckpt._async.snapshot import SnapshotPool

    weight, buffer = torch.ones(4), torch.zeros(2)
    view = weight[1:]
    snap = SnapshotPool().snapshot(
        {"model.safetensors": {"w": view, "b": buffer}}, live=frozenset({weight.untyped_storage().data_ptr()})
    )["model.safetensors"]
    assert snap["w"] is view
    assert snap["b"].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    buffer.add_(1)
    assert torch.equal(snap["b"], torch.zeros(2))


@pytest.mark.parametrize("save_steps", [100, 3])
def test_jit_checkpoint_is_committed_before_training_goes_on(tmp_path, save_steps):
    """transformers 5.x JIT checkpoint (a preemption's): committed before the next step runs; one
    requested right after a regular async save of the same step is skipped, not a conflict."""
    from tests.test_trainer_mixin import TF5, RequestJIT

    if not TF5:
        pytest.skip("JIT checkpointing is transformers 5.x only")
    out = tmp_path / "out"

    class CommittedAt4(TrainerCallback):
        """At the end of step 4 (the JIT save ran at its begin): nothing in flight, checkpoint-3 committed."""

        seen = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                self.seen = (
                    txckpt._async.asyncsave.pending_saves(),
                    txckpt.verify_checkpoint(out / "checkpoint-3").step,
                )

    torch.manual_seed(0)
    req, check = RequestJIT(3), CommittedAt4()
    t = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(out), 8, enable_jit_checkpoint=True, save_steps=save_steps),
        train_dataset=Data(0),
        callbacks=[req, check],
        txckpt_async_save=True,
    )
    req.trainer = t
    t.train()
    assert t.state.global_step == 4
    assert check.seen == (0, 3)
    txckpt.forget_roots()
    assert [c.step for c in txckpt.CheckpointRoot(out).checkpoints()] == [3]
    assert not list(out.rglob("checkpoint-is-incomplete.txt"))


@pytest.mark.parametrize("engine", ["is_deepspeed_enabled", "is_fsdp_enabled"])
def test_async_mode_refuses_engines_that_write_their_own_shards(engine):
    """DeepSpeed's and FSDP's sharded saves are written by the engine itself, which the recorded
    writes do not capture: the mixin refuses the combination when it is set up, naming the way
    that works, instead of committing a checkpoint without the shards."""
    from types import SimpleNamespace

    from txckpt.errors import InvalidArgumentError
    from txckpt.integrations._trainer.async_saves import AsyncSaves

    handler = SimpleNamespace(on_save=lambda *a, **k: None)
    trainer = SimpleNamespace(txckpt_async_save=True, callback_handler=handler, **{engine: True})
    with pytest.raises(InvalidArgumentError, match="txckpt_async_save is not supported") as e:
        AsyncSaves(trainer).install()
    assert "TransactionalWriter" in str(e.value)
    ok = SimpleNamespace(txckpt_async_save=True, callback_handler=handler, **{engine: False})
    AsyncSaves(ok).install()  # without the engine the hook goes in
    assert handler.on_save.func.__name__ == "on_save"
