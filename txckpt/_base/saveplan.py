"""The save plan: what rank 0 decides before a save's staging exists (protocol §8 steps 1-3).

:func:`txckpt._log.commit.plan_save` makes it, the transaction runs on it, every rank
receives it (broadcast, pickled: a frozen dataclass of plain fields) and the intent record holds
its :meth:`SavePlan.to_json` form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .refs import Parent


@dataclass(frozen=True)
class SavePlan:
    txid: str
    lineage: str
    step: int
    #: What the checkpoint follows (its manifest's parent): the lineage's tip when the save was
    #: planned, or the lineage's own parent before its first commit.
    parent: Parent
    #: The staging key (the checkpoint's home, ``tx/<txid>/checkpoint-N``).
    key: str
    #: The writer session that planned it (the commit is fenced by it).
    writer: str | None

    def to_json(self) -> dict[str, Any]:
        """What the intent record says of the plan (§8 step 2): which save it is."""
        return {"txid": self.txid, "step": self.step, "lineage": self.lineage}


__all__ = ["SavePlan"]
