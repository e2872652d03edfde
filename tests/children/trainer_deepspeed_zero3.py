"""A 2-process (torchrun, gloo, CPU) Trainer run with DeepSpeed ZeRO-3 through TransactionalTrainer.

  torchrun --standalone --nproc_per_node 2 trainer_deepspeed_zero3.py OUT MAX_STEPS RESUME DATA_SEED KILL_STEP LIMIT

RESUME: "none", "true" or a checkpoint path (a rollback when it is older than the newest).
KILL_STEP ("-": none): rank 1 SIGKILLs itself in the middle of the save of that step, after
DeepSpeed wrote its ZeRO shards (global_stepN/zero_pp_rank_1_*) into staging, before the commit.
LIMIT ("-": none): save_total_limit.

The DeepSpeed config is CPU-friendly: ZeRO stage 3, fp32, no offload, and the Trainer's own
torch AdamW (no DeepSpeed optimizer, so no fused or JIT-built optimizer op).
"""

import os
import signal
import sys

import torch
from transformers import Trainer

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repository: tests.harness
from tests.harness.tiny import Data, Start, TinyConfig, TinyModel, make_args
from txckpt.integrations.transformers import TransactionalTrainer

ZERO3 = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_allow_untested_optimizer": True,
}

if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    out, max_steps, resume, seed, kill, limit = sys.argv[1:7]
    resume = {"none": None, "true": True}.get(resume, resume)
    kill_step = None if kill == "-" else int(kill)
    if kill_step is not None:
        real = Trainer._save_optimizer_and_scheduler

        def _save_optimizer_and_scheduler(self, output_dir):
            real(self, output_dir)  # DeepSpeed's save_checkpoint: this rank's ZeRO shards
            if self.args.process_index == 1 and self.state.global_step == kill_step:
                shards = sorted(os.listdir(os.path.join(output_dir, f"global_step{kill_step}")))
                print(f"rank 1: killing myself while saving step {kill_step}; staged {shards}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        Trainer._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
    torch.manual_seed(0)
    args = make_args(out, int(max_steps), deepspeed=ZERO3, save_total_limit=None if limit == "-" else int(limit))
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()), args=args, train_dataset=Data(int(seed)), callbacks=[Start()]
    )
    trainer.train(resume_from_checkpoint=resume)
    print(f"rank {trainer.args.process_index}: finished at step {trainer.state.global_step}", flush=True)
    if torch.distributed.is_initialized():  # see ddp.py: tear the groups down before exit
        torch.distributed.destroy_process_group()
