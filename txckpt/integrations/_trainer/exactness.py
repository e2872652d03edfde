"""What a resume of this run cannot make exact, said once at its first save (issue 32).

txckpt restores everything a Trainer checkpoint holds (docs/preemption.md, "What is restored"),
and a resumed run then logs the uninterrupted run's losses bit for bit. Two settings break that
for reasons no checkpoint can hold, and a user learns of them only when a resumed run diverges:
so the first save of a run names them, with what to do, while the run is young.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("txckpt")


def inexact_resume_reasons(trainer: Any) -> list[str]:
    """Why a resume of ``trainer``'s checkpoints would not continue it exactly (empty: none known)."""
    reasons = []
    if getattr(trainer.args, "ignore_data_skip", False):
        reasons.append(
            "args.ignore_data_skip=True: a resumed run trains its epoch from the first batch again "
            "instead of skipping the batches it already trained on (leave it False for an exact resume)"
        )
    data = getattr(trainer, "train_dataset", None)
    if isinstance(data, torch.utils.data.IterableDataset) and not callable(getattr(data, "state_dict", None)):
        reasons.append(
            f"train_dataset is an IterableDataset ({type(data).__name__}) without state_dict(): a resumed "
            "run reads it again from its start and skips the batches already seen, which are the same "
            "batches only if it yields the same items in the same order every time (give it "
            "state_dict()/load_state_dict() and save them, or use a map-style Dataset)"
        )
    return reasons


def warn_inexact_resume_once(trainer: Any) -> None:
    """Log :func:`inexact_resume_reasons` at WARNING at the trainer's first save; later saves say nothing."""
    if getattr(trainer, "_txckpt_inexact_checked", False):
        return
    trainer._txckpt_inexact_checked = True
    reasons = inexact_resume_reasons(trainer)
    if reasons:
        log.warning("a run resumed from this run's checkpoints will not continue it exactly: %s", "; ".join(reasons))
