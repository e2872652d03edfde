"""How the ranks of one job agree on a transaction.

Without an initialised torch.distributed process group everything is single-process and this
module never imports torch.distributed. With one, a transaction needs O(1) collectives per save:

* ``broadcast`` of the staging name from the committing rank (rank 0),
* ``gather`` of every rank's file list (names, sizes, checksums; never file data) to rank 0,
* ``broadcast`` of the outcome (committed path, or the reason for aborting) to every rank.

A rank that raises inside a transaction still takes part in the gather, carrying its error, so
every rank learns the same outcome. A rank that dies makes the others' collectives fail or time
out; they raise :class:`~txckpt.errors.CoordinationTimeoutError` instead of hanging.
"""

from __future__ import annotations

import abc
import os
from datetime import timedelta
from typing import Any

from .errors import CoordinationTimeoutError, TransactionAbortedError

DEFAULT_TIMEOUT_S = float(os.environ.get("TXCKPT_COORDINATION_TIMEOUT", "600"))


class Coordinator(abc.ABC):
    """The collectives a transaction needs. Rank 0 commits."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_committer(self) -> bool:
        return self.rank == 0

    @abc.abstractmethod
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    @abc.abstractmethod
    def gather(self, obj: Any) -> list[Any] | None:
        """On rank 0, every rank's ``obj`` in rank order; None on other ranks."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return when every rank has called it."""


class SingleProcess(Coordinator):
    rank = 0
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        return None


class TorchDistributed(Coordinator):
    """Object collectives over a gloo group (CPU), whatever the default backend is.

    NCCL object collectives need tensors on the right CUDA device and cannot time out cleanly; a
    dedicated gloo group carries txckpt's small metadata on the CPU for every backend, with a
    timeout of its own.
    """

    _groups: dict[tuple[int, float], Any] = {}

    def __init__(self, timeout_s: float | None = None):
        import torch.distributed as dist

        self._dist = dist
        self.timeout_s = float(timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        key = (id(dist.distributed_c10d._get_default_group()), self.timeout_s)
        group = self._groups.get(key)
        if group is None:
            if dist.get_backend() == "gloo":
                group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            else:
                group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self._groups[key] = group
        self.group = group

    def _run(self, what: str, fn):
        try:
            return fn()
        except (RuntimeError, ValueError, OSError) as e:  # gloo reports a dead peer or a timeout so
            raise CoordinationTimeoutError(
                f"txckpt: {what} across {self.world_size} ranks failed on rank {self.rank}: {e}. "
                "Another rank died, raised, or is slower than the timeout "
                f"({self.timeout_s:.0f} s; set TXCKPT_COORDINATION_TIMEOUT or timeout=). "
                "Nothing was committed by this transaction."
            ) from e

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        self._run("broadcast", lambda: self._dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] = [None] * self.world_size
        self._run("gather", lambda: self._dist.all_gather_object(out, obj, group=self.group))
        return out if self.rank == 0 else None

    def barrier(self) -> None:
        self._run("barrier", lambda: self._dist.barrier(group=self.group))


def current_coordinator(timeout_s: float | None = None) -> Coordinator:
    """TorchDistributed inside an initialised process group, else SingleProcess.

    torch.distributed is imported only if torch is already imported and a group is initialised.
    """
    import sys

    if "torch" not in sys.modules:
        return SingleProcess()
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return SingleProcess()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributed(timeout_s)
    return SingleProcess()


__all__ = [
    "Coordinator",
    "SingleProcess",
    "TorchDistributed",
    "current_coordinator",
    "TransactionAbortedError",
]
