"""The seed report's rollback script (hf_trainer_rollback.py) with its Trainer replaced by
txckpt's TransactionalTrainer. One process per command, so that a crash is a real crash:

  trainer_rollback.py run-a OUT MAX_STEPS              run A: data seed 0, from scratch
  trainer_rollback.py run-b OUT MODE MAX_STEPS CRASH   run B: data seed 1, resumed from OUT/checkpoint-2,
                                               killed in MODE (torn: while re-saving
                                               checkpoint-4, after save_model; abandoned: at
                                               global_step 3, before its first save) by CRASH
                                               (exit: os._exit(137); kill: SIGKILL)
  trainer_rollback.py restart OUT                      run B's command with resume_from_checkpoint=True

With TXCKPT_TEST_ASYNC=1 the Trainer saves asynchronously, and torn dies in the background save
right after it wrote model.safetensors. With TXCKPT_TEST_ROOT (and TXCKPT_TEST_STORAGE_OPTIONS, JSON) set, the txckpt root is that URL
and OUT stays the local output_dir; run B still passes OUT/checkpoint-2, the stock spelling.
"""

import os
import signal
import sys

import torch
from transformers import Trainer

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repository: tests.harness
from tests.harness.tiny import Data, Start, TinyConfig, TinyModel, make_args, root_kwargs
from txckpt.integrations.transformers import TransactionalTrainer


def train(out, data_seed, max_steps, resume):
    torch.manual_seed(0)
    TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(out, max_steps),
        train_dataset=Data(data_seed),
        callbacks=[Start()],
        **root_kwargs(),
    ).train(resume_from_checkpoint=resume)


def die(how):
    sys.stdout.flush()
    sys.stderr.flush()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    cmd, out = sys.argv[1], sys.argv[2]
    if cmd == "run-a":
        train(out, data_seed=0, max_steps=int(sys.argv[3]), resume=None)
    elif cmd == "run-b":
        mode, max_steps, how = sys.argv[3], int(sys.argv[4]), sys.argv[5]
        if mode == "abandoned":
            real_step = Trainer.training_step

            def training_step(self, *args, **kwargs):
                if self.state.global_step == 3:
                    die(how)
                return real_step(self, *args, **kwargs)

            Trainer.training_step = training_step
        elif os.environ.get("TXCKPT_TEST_ASYNC") == "1":
            # An async save writes in the background: die there, right after model.safetensors
            # (the sync path's crash point), with the optimizer and the rest still unwritten.
            import threading

            import transformers.modeling_utils as mu

            real_write = mu.safe_save_file

            def safe_save_file(*args, **kwargs):
                real_write(*args, **kwargs)
                if threading.current_thread() is not threading.main_thread():
                    print("dying in the background save", flush=True)
                    die(how)

            mu.safe_save_file = safe_save_file
        else:
            Trainer._save_optimizer_and_scheduler = lambda self, output_dir: die(how)
        train(out, data_seed=1, max_steps=max_steps, resume=os.path.join(out, "checkpoint-2"))
    elif cmd == "restart":
        train(out, data_seed=1, max_steps=8, resume=True)
    else:
        sys.exit(__doc__)
    print("finished", flush=True)
