"""The root interface: what the functional API asks of a root, whatever its kind.

txckpt/_api.py turns each user call into exactly one call of a :class:`RootInterface`, and never
asks which kind of root it holds::

    save_checkpoint(root, ...)      -> save(step, files, ...)
    transaction(root, ...)          -> transaction(step, ...)
    async_save(root, ...)           -> async_target(step), then the asynchronous save there
    get_last_checkpoint(root, ...)  -> last_checkpoint(missing_ok=...)
    resume(root, ...)               -> resume_at(step, path=..., on_damaged=..., collective=...)
    load_checkpoint(root or path)   -> read(path or None, ...)

Two implementations: a root named by a path or URL (``txckpt._api.PathRoot``, the process's
:class:`~txckpt._root.root.CheckpointRoot` for it) and a tiered root (:class:`txckpt.TieredRoot`,
a fast tier replicated to a durable one). Every path they return is issued
(txckpt/_base/issued.py): it carries what reads it, so ``read`` of a path a lookup returned
goes through the root that returned it.
"""

from __future__ import annotations

import abc
import os
from contextlib import AbstractContextManager
from typing import Any, Mapping

from .._save.transactions import Transaction


class RootInterface(abc.ABC):
    """A root as the functional API uses it. Called from the user's thread; each method may
    block on the root's storage. Lookups and lineage changes inside a torch.distributed group
    are decided on rank 0 (``resume_at``'s ``collective``), saves run on every rank."""

    @abc.abstractmethod
    def save(
        self,
        step: int,
        files: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        incremental: bool = False,
    ) -> str:
        """Commit ``files`` as checkpoint ``step`` of the current lineage; the committed path."""

    @abc.abstractmethod
    def transaction(
        self,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        local_dir: str | os.PathLike | None = None,
        incremental: bool = False,
    ) -> AbstractContextManager[Transaction]:
        """A transaction of checkpoint ``step``: commits on a clean exit, aborts on an exception."""

    @abc.abstractmethod
    def async_target(self, step: int) -> tuple[str | os.PathLike, Mapping[str, Any] | None]:
        """Where an asynchronous save of ``step`` commits: (root, storage options). Called once,
        before the save is queued; the root is ready to take it (a tiered root's fast tier
        follows its durable tier's lineage first)."""

    @abc.abstractmethod
    def last_checkpoint(self, *, missing_ok: bool = False) -> str | None:
        """The newest committed checkpoint of the current lineage, or None."""

    @abc.abstractmethod
    def resume_at(
        self,
        step: int | None,
        *,
        path: str | os.PathLike | None = None,
        on_damaged: str = "raise",
        collective: bool | None = None,
    ) -> str | None:
        """Declare where this process continues from (a fork for an older step or a path);
        decided once per job on rank 0 unless ``collective`` is False; every rank gets the path."""

    @abc.abstractmethod
    def read(self, path: str | os.PathLike | None, **options: Any) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (None: the newest), verified; ``options`` are
        :func:`txckpt.load_checkpoint`'s (files, map_location, weights_only, verify, mmap)."""


__all__ = ["RootInterface"]
