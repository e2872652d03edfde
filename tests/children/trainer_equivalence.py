"""A TransactionalTrainer run for the resume-equivalence matrix (tests/test_resume_equivalence.py):
a model with dropout (so the RNG state matters), a shuffled dataset, 12 steps of 24 per epoch
(mid-epoch), a checkpoint every 2 steps. Each logged (step, loss) is appended to OUT.losses; at
the end the final weights' SHA-1 is printed as ``WEIGHTS <hex>``.

  trainer_equivalence.py OUT WORKERS ASYNC STOP [resume]
      WORKERS  dataloader_num_workers; ASYNC  1: txckpt_async_save=True
      STOP     0: run to the end; "kill:K": SIGKILL itself at the end of step K;
               "term:K": SIGTERM itself there, with txckpt_save_on_preemption=True
      resume   resume_from_checkpoint=True (the restart)
"""
import hashlib
import json
import os
import signal
import sys

import torch
from torch import nn
from transformers import PreTrainedModel, TrainerCallback

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
    def __init__(self, path, stop):
        self.path = path
        self.how, _, at = stop.partition(":")
        self.at = int(at or 0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps([state.global_step, logs["loss"]]) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        if self.at and state.global_step == self.at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGTERM)


if __name__ == "__main__":
    out, workers, use_async, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    resume = len(sys.argv) > 5 and sys.argv[5] == "resume"
    torch.manual_seed(0)
    args = make_args(out, 12, save_steps=2, logging_strategy="steps", logging_steps=1,
                     dataloader_num_workers=workers, seed=42)
    trainer = TransactionalTrainer(model=DropoutModel(TinyConfig()), args=args, train_dataset=Data(0, n=96),
                                   callbacks=[Record(out + ".losses", stop)], txckpt_async_save=use_async,
                                   txckpt_save_on_preemption=stop.startswith("term"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    print("WEIGHTS", hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())).hexdigest())
