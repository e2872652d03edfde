"""best_model_checkpoint and save_total_limit through the real Trainer, side by side with a stock
Trainer given the same arguments and the same evaluation results: for every combination of
eval/save strategy of transformers' own test_best_model_checkpoint_behavior (and save_strategy
"best"), the mixin ends with the same best checkpoint, the same checkpoint-N names and the same
best in every saved trainer_state.json, and txckpt's current lineage is exactly those names."""

import json
import os

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint as hf_get_last_checkpoint  # noqa: E402

import txckpt  # noqa: E402
from txckpt.integrations.transformers import TransactionalTrainer  # noqa: E402

from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args  # noqa: E402

pytestmark = pytest.mark.trainer

# 16 samples, batch 4: 4 steps per epoch, 12 steps in 3 epochs.
FALLING = [0.59, 0.57, 0.55]  # the first evaluation is the best
CASES = {
    "no-eval": dict(eval_strategy="no", save_strategy="steps", save_steps=1),
    "no-eval-limit-1": dict(eval_strategy="no", save_strategy="steps", save_steps=1, save_total_limit=1),
    "epoch-epoch": dict(eval_strategy="epoch", save_strategy="epoch"),
    # The case: the evaluation that makes step 4 the best runs after checkpoint-4 committed.
    "epoch-steps": dict(eval_strategy="epoch", save_strategy="steps", save_steps=1),
    "epoch-steps-limit-2": dict(eval_strategy="epoch", save_strategy="steps", save_steps=1, save_total_limit=2),
    "epoch-steps-limit-1": dict(eval_strategy="epoch", save_strategy="steps", save_steps=1, save_total_limit=1),
    # Best at step 1, save_total_limit=1: at the end only the best may remain, not the newest too.
    "steps-steps-limit-1": dict(
        eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, save_total_limit=1
    ),
    "steps-3-steps-2": dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=2),
    "epoch-best": dict(eval_strategy="epoch", save_strategy="best"),
}


def run(cls, out, overrides, accuracies=FALLING, resume=None):
    torch.manual_seed(0)
    args = make_args(
        str(out),
        -1,
        num_train_epochs=3,
        metric_for_best_model="accuracy",
        greater_is_better=True,
        load_best_model_at_end=False,
        **overrides,
    )
    trainer = cls(model=TinyModel(TinyConfig()), args=args, train_dataset=Data(0, n=16), eval_dataset=Data(7, n=8))
    values = iter(accuracies)
    last = {}

    def evaluate(*args, **kwargs):  # like upstream's test: canned metrics, one per evaluation
        last["eval_accuracy"] = next(values, last.get("eval_accuracy", accuracies[-1]))
        return dict(last)

    trainer._evaluate = evaluate
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def names(out):
    return sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))


def rel(path, out):
    return None if path is None else os.path.relpath(path, out)


def recorded_best(out):
    best = {}
    for d in names(out):
        with open(os.path.join(out, d, "trainer_state.json")) as f:
            best[d] = rel(json.load(f)["best_model_checkpoint"], out)
    return best


@pytest.mark.parametrize("case", sorted(CASES))
def test_best_checkpoint_and_rotation_match_a_stock_trainer(tmp_path, case):
    stock_out, tx_out = tmp_path / "stock", tmp_path / "tx"
    stock = run(Trainer, stock_out, CASES[case])
    tx = run(TransactionalTrainer, tx_out, CASES[case])
    assert tx.state.best_metric == stock.state.best_metric
    assert tx.state.best_global_step == stock.state.best_global_step
    assert rel(tx.state.best_model_checkpoint, tx_out) == rel(stock.state.best_model_checkpoint, stock_out)
    assert names(tx_out) == names(stock_out)
    assert recorded_best(tx_out) == recorded_best(stock_out)
    # The names are exactly the current lineage's kept checkpoints, and each one verifies.
    txckpt.forget_roots()
    current = txckpt.CheckpointRoot(str(tx_out)).checkpoints()
    assert [f"checkpoint-{c.step}" for c in current] == names(tx_out)
    for c in current:
        txckpt.verify_checkpoint(c.path)
    # A stock lookup and txckpt's agree with the stock Trainer's output_dir.
    newest = hf_get_last_checkpoint(str(stock_out))
    assert rel(txckpt.get_last_checkpoint(str(tx_out)), tx_out) == rel(newest, stock_out)
    if case == "epoch-steps-limit-2":  # the issue: the best (4) survives rotation, as on stock
        assert names(tx_out) == ["checkpoint-4", "checkpoint-12"]
    if case == "steps-steps-limit-1":
        assert names(tx_out) == ["checkpoint-1"]


def test_keeping_only_the_best_rolls_back_and_a_restart_resumes_it(tmp_path):
    """save_total_limit=1, best at step 1: the end of training rolls the lineage back to the
    best (a fork entry, then a retire entry): a restart with resume_from_checkpoint=True resumes
    the best, as a stock Trainer restarted on its output_dir does."""
    out = tmp_path / "tx"
    case = CASES["steps-steps-limit-1"]
    run(TransactionalTrainer, out, case)
    txckpt.forget_roots()
    h = txckpt.CheckpointRoot(str(out)).history()
    assert [e["action"] for e in h.entries[-2:]] == ["fork", "retire"]
    assert h.state.head_tip.step == 1
    began = []

    class Begin(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            began.append(state.global_step)

    torch.manual_seed(0)
    args = make_args(str(out), -1, num_train_epochs=3, metric_for_best_model="accuracy", greater_is_better=True, **case)
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=args,
        train_dataset=Data(0, n=16),
        eval_dataset=Data(7, n=8),
        callbacks=[Begin()],
    )
    trainer._evaluate = lambda *a, **k: {"eval_accuracy": 0.5}
    trainer.train(resume_from_checkpoint=True)
    assert began == [1]
    assert names(out) == ["checkpoint-1"]  # its best stays step 1 (0.5 < 0.59)
