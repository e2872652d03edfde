"""txckpt: transactional, lineage-aware checkpoint storage for PyTorch and Hugging Face training.

Every checkpoint is written into a staging directory and committed through a manifest and one
create-if-absent log entry; a rollback forks a new lineage instead of overwriting another run's
checkpoints. See docs/protocol.md for the on-disk protocol.

The public API is what docs/api.md lists: the names below (``__all__``), :mod:`txckpt.errors`,
:mod:`txckpt.preemption`, and the integrations ``txckpt.integrations.transformers``,
``.accelerate`` and ``.dcp``. Every other module is internal, even where it can be imported;
tests/test_public_api.py checks both.
"""

from ._api import (
    async_save,
    get_last_checkpoint,
    load_checkpoint,
    new_lineage,
    read_manifest,
    resume,
    save_checkpoint,
    transaction,
    verify_checkpoint,
)
from ._read.fetch import fetch_checkpoint
from ._root.root import forget_roots, open_root
from . import preemption
from ._async.asyncsave import release_buffers, wait_for_saves
from ._base.coordination import SingleProcess
from .errors import TxckptError
from ._maintenance.gc import collect_garbage
from ._maintenance.retention import RetentionPolicy, apply_retention, plan_retention, rewind
from ._maintenance.leases import acquire_reader_lease, release_reader_lease
from ._base.layout import MANIFEST_NAME
from ._manifest.manifest import Manifest
from ._base.rngstate import rng_state, set_rng_state
from ._log.lineage import CheckpointInfo
from ._root.root import CheckpointRoot
from ._tiered.tiered import TieredRoot
from ._tensors.inspect import (
    CheckpointContents,
    CheckpointDiff,
    FileInfo,
    TensorChange,
    TensorInfo,
    diff_checkpoints,
    inspect_checkpoint,
)
from ._tensors.load import load_tensors

__version__ = "0.1.0"

__all__ = [
    # save and load
    "save_checkpoint",
    "transaction",
    "load_checkpoint",
    "get_last_checkpoint",
    "read_manifest",
    "verify_checkpoint",
    "fetch_checkpoint",
    "Manifest",
    "MANIFEST_NAME",
    # tensors: inspect, diff, verified partial loads (docs/inspect.md)
    "inspect_checkpoint",
    "diff_checkpoints",
    "load_tensors",
    "CheckpointContents",
    "CheckpointDiff",
    "TensorInfo",
    "FileInfo",
    "TensorChange",
    # roots and lineage
    "resume",
    "new_lineage",
    "CheckpointRoot",
    "CheckpointInfo",
    "TieredRoot",
    "open_root",
    "forget_roots",
    "SingleProcess",
    # asynchronous saves
    "async_save",
    "wait_for_saves",
    "release_buffers",
    # preemption and resumable loops
    "preemption",
    "rng_state",
    "set_rng_state",
    # retention and garbage collection
    "RetentionPolicy",
    "apply_retention",
    "plan_retention",
    "rewind",
    "acquire_reader_lease",
    "release_reader_lease",
    "collect_garbage",
    # errors (the rest: txckpt.errors)
    "TxckptError",
]
