"""Adapters between txckpt and training frameworks.

Each submodule imports its framework; this package imports none of them, so ``import txckpt``
never pulls in transformers. Use ``from txckpt.integrations.transformers import
TransactionalCheckpointMixin``.
"""
