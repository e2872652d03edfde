"""The files of a Trainer checkpoint that each rank writes itself, claimed in the transaction
(``tx.claim_files``) so that the writing rank hashes them and the manifest records its rank:
rank 0 then reads none of the other ranks' bytes at commit (docs/distributed.md, "DeepSpeed").

* ``rng_state_{r}.pth``: upstream's ``_save_rng_state`` on every process of a multi-process run;
* ``__{r}_*.distcp``: torch.distributed.checkpoint's per-rank files (FSDP's sharded state dict
  through accelerate, in ``pytorch_model_fsdp_0/`` and ``optimizer_0/``);
* ``*zero_pp_rank_{dp}_mp_rank_{mp:02d}_*``: DeepSpeed's ZeRO files of this rank's data-parallel
  and model-parallel ranks (the engine's own naming), when DeepSpeed runs without a model-parallel
  unit (the Trainer's case: dp rank = global rank, mp rank 0). With an mpu (tensor, pipeline or
  sequence parallel) they are left unclaimed, and rank 0 hashes them at commit as before.

Whatever no rank claims (the model, ``trainer_state.json``, DeepSpeed's ``latest``) is written by
rank 0 and hashed by it at commit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

log = logging.getLogger("txckpt.transformers")


def rank_patterns(trainer: Any, rank: int) -> list[str]:
    """The globs of the files rank ``rank`` writes into a checkpoint of ``trainer``."""
    patterns = [f"rng_state_{rank}.pth", f"__{rank}_*.distcp"]
    if getattr(trainer, "is_deepspeed_enabled", False):
        patterns += _deepspeed_patterns(getattr(trainer, "model_wrapped", None))
    return patterns


def _deepspeed_patterns(engine: Any) -> list[str]:
    if engine is None or getattr(engine, "mpu", None) is not None or not hasattr(engine, "checkpoint_mp_rank"):
        return []
    try:
        dp = dist.get_rank(group=engine.optimizer.dp_process_group)
        mp = int(engine.checkpoint_mp_rank)
    except Exception as e:  # noqa: BLE001 - unclaimed is correct too: rank 0 hashes them at commit
        log.debug("DeepSpeed's ranks are unknown (%s: %s); its files are hashed by rank 0", type(e).__name__, e)
        return []
    return [f"*zero_pp_rank_{dp}_mp_rank_{mp:02d}_*"]


def claim_rank_files(trainer: Any, tx: Any) -> None:
    """Claim in ``tx`` the files this rank writes into the checkpoint (one process: no-op, its
    files are rank 0's anyway)."""
    if tx.world_size > 1:
        tx.claim_files(rank_patterns(trainer, tx.rank))
