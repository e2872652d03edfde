"""Transactional checkpoints and lineage-aware resume for transformers' ``Trainer`` (public module).

::

    from transformers import Trainer
    from txckpt.integrations.transformers import TransactionalCheckpointMixin

    class MyTrainer(TransactionalCheckpointMixin, Trainer):   # the mixin goes leftmost
        pass

or use :class:`TransactionalTrainer`. docs/trainer.md is the guide; the implementation lives in
the package txckpt.integrations._trainer (``mixin`` and its helper rooms), whose modules are
internal: this module's ``__all__`` is the integration's public surface.
"""

from __future__ import annotations

from ._trainer.mixin import TransactionalCheckpointMixin, TransactionalTrainer

__all__ = ["TransactionalCheckpointMixin", "TransactionalTrainer"]
