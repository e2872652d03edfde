"""The drop-in functional API, as facades over one root interface (txckpt/_root/interface.py):
each call becomes one call of a RootInterface, a :class:`PathRoot` for a path or URL (the
process's CheckpointRoot, so the lineage a process resumed, or first saved to, is remembered
across calls) or a :class:`txckpt.TieredRoot`; reads of plain paths go through
txckpt._read.reader, the read path's owner."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any, Mapping

import functools

from ._async import asyncsave
from ._read import reader
from ._async.asyncsave import wait_for_root
from ._base.coordination import decide_once
from .errors import RootNotFoundError
from ._base.issued import issue, issued, options_for
from ._manifest.manifest import Manifest

from ._root.interface import RootInterface
from ._root.root import open_root
from ._tiered.tiered import TieredRoot
from ._save.transactions import Transaction


class PathRoot(RootInterface):
    """A root named by a path or URL: the process's CheckpointRoot for it (txckpt/_root/root.py),
    asked only once any asynchronous save of it has committed (that save changes its state)."""

    def __init__(self, root: str | os.PathLike, storage_options: Mapping[str, Any] | None):
        self.root = root
        self.storage_options = storage_options

    def _open(self):
        wait_for_root(self.root, self.storage_options)
        return open_root(self.root, self.storage_options)

    def save(self, step, files, *, metadata=None, timeout=None, incremental=False) -> str:
        return self._open().save(step, files, metadata=metadata, timeout=timeout, incremental=incremental)

    def transaction(self, step, *, metadata=None, timeout=None, local_dir=None, incremental=False):
        return self._open().transaction(
            step, metadata=metadata, timeout=timeout, local_dir=local_dir, incremental=incremental
        )

    def async_target(self, step):
        return self.root, self.storage_options

    def last_checkpoint(self, *, missing_ok: bool = False) -> str | None:
        r = self._open()
        try:
            key = r.last_checkpoint_key()
        except RootNotFoundError as e:
            if missing_ok and e.bucket is None:
                return None
            raise
        if key is None:
            return None
        given = os.fspath(self.root)
        if r.storage.local_path("") is not None and not given.startswith("file://"):
            return issue(os.path.join(given, *key.split("/")), self.storage_options)
        return issue(r.storage.full_path(key), self.storage_options)

    def resume_at(self, step, *, path=None, on_damaged="raise", collective=None) -> str | None:
        wait_for_root(self.root, self.storage_options)
        root, options = self.root, self.storage_options
        return issue(
            decide_once(lambda: open_root(root, options).resume(step, path=path, on_damaged=on_damaged), collective),
            options,
        )

    def read(self, path, **options: Any) -> dict[str, Any]:
        assert path is not None  # a plain root reads the path a caller gives
        return reader.load(path, storage_options=self.storage_options, **options)


def _as_root(root: str | os.PathLike | RootInterface, storage_options: Mapping[str, Any] | None) -> RootInterface:
    return root if isinstance(root, RootInterface) else PathRoot(root, storage_options)


def save_checkpoint(
    root: str | os.PathLike | TieredRoot,
    step: int,
    files: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    incremental: bool = False,
) -> str:
    """Save ``files`` as checkpoint ``step`` of the current lineage, all or nothing.

    ``files`` maps a file name to an object: ``bytes`` are written raw, ``.safetensors`` takes a
    dict of tensors, ``.json`` a JSON value, anything else goes through ``torch.save``. Returns
    the committed checkpoint's path. Raises StepConflictError if ``step`` is not newer than the
    lineage's newest checkpoint (call :func:`resume` with an older step first to roll back).
    Inside a torch.distributed group every rank calls it with its own files.

    ``incremental=True``: a file whose bytes equal a file of one of the root's newest committed
    checkpoints is not written again but shared with it (a hard link on a local disk, a
    server-side copy on an object store); every checkpoint stays whole (docs/incremental.md). A
    dict of two or more tensors named ``*.safetensors`` is then saved with the tensors unchanged
    since the previous checkpoint in a stock shard of their own, which is shared (the sharded
    layout; ``load_checkpoint`` returns the one file as saved: docs/incremental.md, "A frozen
    base in one file").

    ``root`` may be a :class:`txckpt.TieredRoot`: the save commits on its fast tier and is
    replicated to its durable tier in the background (docs/tiered.md).
    """
    return _as_root(root, storage_options).save(
        step, files, metadata=metadata, timeout=timeout, incremental=incremental
    )


@functools.wraps(asyncsave.async_save)
def async_save(root: str | os.PathLike | TieredRoot, step: int, files: Mapping[str, Any], **kwargs: Any):
    target, options = _as_root(root, kwargs.get("storage_options")).async_target(step)
    return asyncsave.async_save(target, step, files, **{**kwargs, "storage_options": options})


async_save.__doc__ = (
    (asyncsave.async_save.__doc__ or "")
    + """
    ``root`` may be a :class:`txckpt.TieredRoot`: the save commits on its fast tier, and its
    durable tier receives it in the background after that (docs/tiered.md).
    """
)


def transaction(
    root: str | os.PathLike | TieredRoot,
    step: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    local_dir: str | os.PathLike | None = None,
    incremental: bool = False,
) -> AbstractContextManager[Transaction]:
    """A context manager for writers that need file handles or a directory; see
    :class:`txckpt._save.transactions.Transaction`. Commits on a clean exit, aborts on an exception.
    ``local_dir``: where a remote root's local scratch directory (``tx.directory``) goes.
    ``incremental``: ``tx.save`` shares unchanged files, as :func:`save_checkpoint`. A
    :class:`txckpt.TieredRoot` commits on its fast tier and replicates in the background."""
    return _as_root(root, storage_options).transaction(
        step, metadata=metadata, timeout=timeout, local_dir=local_dir, incremental=incremental
    )


def get_last_checkpoint(
    root: str | os.PathLike | TieredRoot, *, storage_options: Mapping[str, Any] | None = None, missing_ok: bool = False
) -> str | None:
    """Drop-in for ``transformers.trainer_utils.get_last_checkpoint``: the newest committed
    checkpoint of the current lineage, or None. Never a staging leftover, never an abandoned
    lineage's checkpoint.

    As transformers' does, it raises ``FileNotFoundError`` (:class:`RootNotFoundError`) for a
    root directory that does not exist (or a URL whose bucket does not exist), and returns the
    path in its form: ``os.path.join(root, "checkpoint-N")``, relative when ``root`` is.

    ``missing_ok=True`` (a script's first run and its restarts alike): None also for a root
    directory that does not exist yet, which the first save creates, as ``txckpt.resume(root)``
    answers there. A missing bucket (container) still raises: no save can create one.

    A :class:`txckpt.TieredRoot`: the newest checkpoint of its current lineage committed on
    either tier, never older than the durable tier's (docs/tiered.md).

    The path returned is a ``str`` that also carries what reading it needs (the root's storage
    options, a tiered root's tier): ``load_checkpoint(get_last_checkpoint(root))`` reads it
    whatever the root (txckpt/_base/issued.py)."""
    return _as_root(root, storage_options).last_checkpoint(missing_ok=missing_ok)


def resume(
    root: str | os.PathLike | TieredRoot,
    step: int | None = None,
    *,
    path: str | os.PathLike | None = None,
    on_damaged: str = "raise",
    storage_options: Mapping[str, Any] | None = None,
    collective: bool | None = None,
) -> str | None:
    """Declare where this process continues from, and return that checkpoint's path.

    ``step=None`` (and no ``path``): the newest checkpoint of the current lineage, as on a
    restart. An older committed step of the current lineage, or the ``path`` of any committed
    checkpoint of the root, forks a new lineage; one warning names the checkpoints it abandons.
    Abandoned checkpoints are kept intact and never returned by get_last_checkpoint again.

    ``on_damaged`` (restarts only): ``"raise"`` (default) checks nothing beyond today's lookup;
    loading a damaged checkpoint raises IntegrityError naming the file. ``"fallback"`` verifies
    the newest checkpoint first (one read of its bytes) and, if it is damaged, forks from the
    newest checkpoint of the current lineage that verifies, with one warning naming each damaged
    checkpoint and its failing file; the damaged ones stay on disk untouched. If none verifies:
    NoIntactCheckpointError, and nothing changes.

    Inside an initialised torch.distributed group every rank calls it: rank 0 changes the
    lineage once and every rank gets its answer (pass ``collective=False`` to call it from one
    rank alone).

    A :class:`txckpt.TieredRoot` never resumes older than its durable tier: a fast tier that is
    behind (a new node, or a requeue after another node continued or left the lineage) follows
    the durable tier; a rollback to a step only the durable tier holds forks there. It starts
    replicating what a previous process left pending (docs/tiered.md).
    """
    return _as_root(root, storage_options).resume_at(step, path=path, on_damaged=on_damaged, collective=collective)


def new_lineage(
    root: str | os.PathLike,
    *,
    external_parent: str | os.PathLike | None = None,
    storage_options: Mapping[str, Any] | None = None,
    collective: bool | None = None,
) -> str:
    """Start a new root lineage (training from scratch, or from a checkpoint outside the root,
    recorded as ``external_parent``). Returns its id; warns if it abandons checkpoints. Called
    on every rank of a torch.distributed group, like :func:`resume`."""
    wait_for_root(root, storage_options)  # an async save of this root commits first
    return decide_once(
        lambda: open_root(root, storage_options).new_lineage(external_parent=external_parent), collective
    )


def read_manifest(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the checkpoint at ``path``, with its own digest verified; and, when
    ``path`` lies in a txckpt root, checked against the digest the root's log committed (an
    edited, replaced or never-committed manifest raises IntegrityError / ManifestError)."""
    return reader.read_manifest(path, storage_options=options_for(path, storage_options))


def verify_checkpoint(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Check every file's size and checksum (and, inside a root, the manifest against the log);
    raises IntegrityError (naming the file) on damage."""
    return reader.verify_checkpoint(path, storage_options=options_for(path, storage_options))


def load_checkpoint(
    path: str | os.PathLike | TieredRoot,
    *,
    files: list[str] | None = None,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
    weights_only: bool = True,
    verify: bool = True,
    mmap: bool = False,
) -> dict[str, Any]:
    """Load a committed checkpoint's files (all, or the names in ``files``) after verifying
    each one's size and checksum against the manifest (and, inside a root, the manifest against
    the log's commit entry). torch files load with ``weights_only=True`` unless told otherwise.

    ``mmap=True``: on a local disk, safetensors and torch files are mapped (copy-on-write), not
    read into memory: their tensors are views of the page cache's pages, hashed in place before
    anything is returned. No copy, and RAM only for the pages a tensor write touches; but the
    kernel may later read a hashed page from the disk again, and a file shortened under the
    mapping (txckpt never does: committed files are only unlinked) fails the process with SIGBUS
    (docs/troubleshooting.md, "Loading with `mmap=True`"). Elsewhere (object stores) files are read.

    ``path`` may be a :class:`txckpt.TieredRoot`: its newest checkpoint, read from the fast tier,
    with any file missing or damaged there fetched from the durable tier first (docs/tiered.md).
    So is a path a tiered root's lookup returned; a path a lookup returned is read with the
    storage options of its root unless ``storage_options`` is given (txckpt/_base/issued.py)."""
    options = dict(files=files, map_location=map_location, weights_only=weights_only, verify=verify, mmap=mmap)
    if isinstance(path, RootInterface):  # a root itself: its newest checkpoint
        return path.read(None, **options)
    # A path a lookup issued is read by the root that issued it (a tiered root repairs it first)
    # and with the storage options it carries, unless the caller names storage options.
    known = issued(path) if storage_options is None else None
    if known is not None and isinstance(known.owner, RootInterface):
        return known.owner.read(path, **options)
    return PathRoot(path, known.storage_options if known is not None else storage_options).read(path, **options)


__all__ = [
    "save_checkpoint",
    "async_save",
    "transaction",
    "get_last_checkpoint",
    "resume",
    "new_lineage",
    "read_manifest",
    "verify_checkpoint",
    "load_checkpoint",
]
