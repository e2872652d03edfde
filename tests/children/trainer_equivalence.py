"""A Trainer run for the resume-equivalence matrix (tests/test_resume_equivalence.py): a model
with dropout (so the RNG state matters), a shuffled dataset of 96 rows, 12 steps (mid-epoch on
one rank: 24 steps an epoch; on two ranks the stop at step 5 is mid-epoch too), a checkpoint
every 2 steps. Each rank appends each logged ``[step, loss]`` to ``OUT.losses.r{rank}``; at the
end every rank prints the final weights' SHA-1 as ``WEIGHTS <hex>``.

  trainer_equivalence.py OUT WORKERS ASYNC STOP [resume]
  torchrun --standalone --nproc_per_node 2 trainer_equivalence.py OUT WORKERS ASYNC STOP [resume]
      WORKERS  dataloader_num_workers; ASYNC  1: txckpt_async_save=True
      STOP     0: run to the end; "kill:K": every rank SIGKILLs itself at the end of step K;
               "term:K": the last rank (rank 1 of 2) alone sends itself SIGTERM there, with
               txckpt_save_on_preemption=True (the agreement at the step boundary makes every
               rank save that step and exit 143)
      resume   resume_from_checkpoint=True (the restart)

Under torchrun (RANK / WORLD_SIZE set) the Trainer runs gloo DDP on CPU, as
tests/children/trainer_ddp.py. ``TXCKPT_TEST_STOCK_TRAINER=1``: the same run with stock
``transformers.Trainer`` (its own checkpoint-<step> directories; SIGTERM then simply kills it),
for the "stock vs txckpt" column of docs/preemption.md's table.
"""

import hashlib
import json
import os
import signal
import sys

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from tests.harness.tiny import Data, TinyConfig, make_args
from txckpt.integrations.transformers import TransactionalTrainer


class DropoutModel(PreTrainedModel):
    config_class = TinyConfig
    main_input_name = "x"

    def __init__(self, config):
        super().__init__(config)
        self.fc, self.out, self.drop = nn.Linear(8, 16), nn.Linear(16, 1), nn.Dropout(0.5)
        self.post_init()

    def forward(self, x=None, labels=None):
        y = self.out(self.drop(torch.relu(self.fc(x)))).squeeze(-1)
        return {"loss": nn.functional.mse_loss(y, labels), "logits": y}


class Record(TrainerCallback):
    def __init__(self, path, stop, rank, world):
        self.path = path
        self.how, _, at = stop.partition(":")
        self.at = int(at or 0)
        self.signalled = self.how == "kill" or rank == world - 1  # SIGTERM: one rank only

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # every rank logs the loss averaged over the ranks
            with open(self.path, "a") as f:
                f.write(json.dumps([state.global_step, logs["loss"]]) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        if self.at and state.global_step == self.at and self.signalled:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGTERM)


if __name__ == "__main__":
    out, workers, use_async, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    resume = len(sys.argv) > 5 and sys.argv[5] == "resume"
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    stock = os.environ.get("TXCKPT_TEST_STOCK_TRAINER") == "1"
    torch.manual_seed(0)
    args = make_args(
        out, 12, save_steps=2, logging_strategy="steps", logging_steps=1, dataloader_num_workers=workers, seed=42
    )
    common = dict(
        model=DropoutModel(TinyConfig()),
        args=args,
        train_dataset=Data(0, n=96),
        callbacks=[Record(f"{out}.losses.r{rank}", stop, rank, world)],
    )
    trainer = (
        Trainer(**common)
        if stock
        else TransactionalTrainer(
            **common, txckpt_async_save=use_async, txckpt_save_on_preemption=stop.startswith("term")
        )
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())).hexdigest()
    sys.stdout.write(f"WEIGHTS {digest}\n")  # one write: two ranks share torchrun's unbuffered stdout
    sys.stdout.flush()
    if torch.distributed.is_initialized():  # as trainer_ddp.py: no gloo threads left to interpreter shutdown
        torch.distributed.destroy_process_group()
