"""txckpt: transactional, lineage-aware checkpoint storage for PyTorch and Hugging Face training.

Every checkpoint is written into a staging directory and committed through a manifest and one
create-if-absent log entry; a rollback forks a new lineage instead of overwriting another run's
checkpoints. See docs/protocol.md for the on-disk protocol.
"""

from .api import (
    fetch_checkpoint,
    forget_roots,
    get_last_checkpoint,
    load_checkpoint,
    new_lineage,
    open_root,
    read_manifest,
    resume,
    save_checkpoint,
    transaction,
    verify_checkpoint,
)
from .asyncsave import async_save, wait_for_saves
from .errors import TxckptError
from .gc import collect_garbage
from .retention import RetentionPolicy, apply_retention
from .manifest import MANIFEST_NAME, Manifest
from .root import CheckpointInfo, CheckpointRoot

__version__ = "0.1.0"

__all__ = [
    "save_checkpoint",
    "async_save",
    "wait_for_saves",
    "transaction",
    "load_checkpoint",
    "get_last_checkpoint",
    "resume",
    "new_lineage",
    "verify_checkpoint",
    "fetch_checkpoint",
    "read_manifest",
    "open_root",
    "forget_roots",
    "CheckpointRoot",
    "CheckpointInfo",
    "Manifest",
    "MANIFEST_NAME",
    "TxckptError",
    "RetentionPolicy",
    "apply_retention",
    "collect_garbage",
]
