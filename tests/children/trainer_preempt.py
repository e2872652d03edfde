"""A TransactionalTrainer run whose scheduler preempts it: SIGTERM, sent by the process to itself
at the end of global step AT (a callback, so the moment is exact and nothing sleeps).

  trainer_preempt.py OUT MAX_STEPS AT MODE     MODE: "save" (txckpt_save_on_preemption=True) or
                                               "stock" (without it: SIGTERM kills at once)
  trainer_preempt.py OUT MAX_STEPS 0 resume    the restart: resume_from_checkpoint=True, no signal

With TXCKPT_TEST_ASYNC=1 the Trainer saves asynchronously (tests/harness/tiny.root_kwargs). No
regular save happens before MAX_STEPS (save_steps is past it): a checkpoint before the end is
the preemption's.
"""

import os
import signal
import sys

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from tests.harness.tiny import Data, Start, TinyConfig, TinyModel, make_args, root_kwargs
from txckpt.integrations.transformers import TransactionalTrainer


class PreemptAt(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            print(f"  SIGTERM at global_step={state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    out, max_steps, at, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    callbacks = [Start()] + ([PreemptAt(at)] if at else [])
    kw = {"txckpt_save_on_preemption": True} if mode in ("save", "resume") else {}
    # The restart restores the callbacks' and the control's state from the checkpoint, where a
    # stopping run's control says should_training_stop (the mixin clears it on resume).
    extra = {"restore_callback_states_from_checkpoint": True} if mode == "resume" else {}
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(out, max_steps, save_steps=100, **extra),
        train_dataset=Data(0),
        callbacks=callbacks,
        **kw,
        **root_kwargs(),
    )
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    print(f"  finished at global_step={trainer.state.global_step}", flush=True)
