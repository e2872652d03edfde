"""A 2-process (torchrun, gloo, CPU) Trainer run with TransactionalTrainer.

  torchrun --standalone --nproc_per_node 2 trainer_ddp.py OUT MAX_STEPS RESUME [KILL_STEP]

RESUME is "none" or "true". With KILL_STEP, rank 1 SIGKILLs itself in the middle of the save of
that step: after writing its rng_state_1.pth into staging, before the transaction commits.
TXCKPT_TEST_ROOT / TXCKPT_TEST_STORAGE_OPTIONS: a remote txckpt root; TXCKPT_TEST_ASYNC=1: async
saves, and rank 1 dies in the background save instead (see tests/harness/tiny.root_kwargs).
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

if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    out, max_steps, resume = sys.argv[1], int(sys.argv[2]), {"none": None, "true": True}[sys.argv[3]]
    kill_step = int(sys.argv[4]) if len(sys.argv) > 4 else None
    if kill_step is not None:
        real = Trainer._save_rng_state

        def _save_rng_state(self, output_dir):
            real(self, output_dir)
            if self.args.process_index == 1 and self.state.global_step == kill_step:
                print(f"rank 1: killing myself while saving step {kill_step} into {output_dir}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        if os.environ.get("TXCKPT_TEST_ASYNC") == "1":
            # Async: rank 1 dies in the background save, right after it wrote rng_state_1.pth
            # there (the background replays torch.save with the function it found at the save).
            import threading

            real_save = torch.save

            def background_save(obj, f, *args, **kwargs):
                real_save(obj, f, *args, **kwargs)
                if (
                    isinstance(f, str)
                    and os.path.basename(f) == "rng_state_1.pth"
                    and threading.current_thread() is not threading.main_thread()
                    and os.path.basename(os.path.dirname(f)) == f"checkpoint-{kill_step}"
                ):
                    print(f"rank 1: killing myself while saving step {kill_step} in the background", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            torch.save = background_save
        else:
            Trainer._save_rng_state = _save_rng_state
    torch.manual_seed(0)
    stock = bool(os.environ.get("TXCKPT_TEST_STOCK_TRAINER"))
    cls = Trainer if stock else TransactionalTrainer
    trainer = cls(
        model=TinyModel(TinyConfig()),
        args=make_args(out, max_steps),
        train_dataset=Data(0),
        callbacks=[Start()],
        **({} if stock else root_kwargs()),
    )
    trainer.train(resume_from_checkpoint=resume)
    print(f"rank {trainer.args.process_index}: finished at step {trainer.state.global_step}", flush=True)
    # Tear the process groups down (the default one and txckpt's coordination group) before the
    # interpreter exits: left to interpreter shutdown, a gloo group's threads can be destroyed
    # while joinable ("terminate called without an active exception", SIGABRT after a clean run;
    # seen once in CI on transformers 4.57). torch recommends this at the end of every script.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
