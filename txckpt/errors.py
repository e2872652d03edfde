"""Typed errors. Every message says what happened and what to do next.

All errors derive from :class:`TxckptError`, so ``except txckpt.errors.TxckptError`` catches them all.
"""

from __future__ import annotations

import pickle


class TxckptError(Exception):
    """Base class of every error txckpt raises on purpose."""


class InvalidArgumentError(TxckptError, ValueError):
    """A caller passed a value txckpt cannot accept (a bad file name, a negative step, ...)."""


class NotATxckptRootError(TxckptError):
    """The path is neither a txckpt root nor a legacy output_dir with checkpoint-N directories."""


class CheckpointNotFoundError(TxckptError, FileNotFoundError):
    """A checkpoint, or a file of one, that a caller or the log names does not exist."""


class LineageNotFoundError(CheckpointNotFoundError):
    """A lineage id that the root's log does not know (a typo, or another root's id).

    ``lineage``: the id asked for; ``known``: the root's lineage ids (``txckpt log`` shows them)."""

    def __init__(self, message: str, *, lineage: str | None = None, known: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.lineage = lineage
        self.known = list(known)


class StepConflictError(TxckptError):
    """A save names a step that is not newer than the newest committed step of the lineage.

    Saving it would overwrite or shadow a committed checkpoint. Call ``txckpt.resume(root, step=K)``
    for an older K first if you mean to roll back, or save a newer step.
    """


class ConcurrentWriterError(TxckptError):
    """Another writer committed to this lineage (or moved the head) between our read and our commit."""


class StaleLineageError(ConcurrentWriterError):
    """This process writes a lineage that is no longer the root's current lineage.

    Typical causes: a zombie job still running beside its restart, or an operator's rollback
    (``txckpt resume``) while this job runs. The stale writer must stop; nothing was lost.
    """


class IntegrityError(TxckptError):
    """Stored bytes do not match the manifest (size, checksum, missing file, edited manifest)."""


class ManifestError(IntegrityError):
    """A manifest is missing, unreadable, edited, of an unknown format, or names unsafe paths."""


class UnsafePathError(ManifestError, InvalidArgumentError):
    """A file name escapes its checkpoint: ``..``, an absolute path, or a symlink that leaves the root."""


class NotACheckpointError(ManifestError, InvalidArgumentError):
    """A path given as a checkpoint is a root (a Trainer ``output_dir`` with ``.txckpt/log`` or
    ``checkpoint-N`` directories), not one checkpoint. ``path``: the path given. Load the
    root's newest checkpoint with ``load_checkpoint(get_last_checkpoint(root))``."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class WeightsOnlyError(TxckptError, pickle.UnpicklingError):
    """A torch file of a checkpoint pickles an object that torch's ``weights_only=True`` loader
    (txckpt's default) refuses to build. ``path``: the file; ``global_name``: the global it
    refused (``"argparse.Namespace"``), None if torch did not name one. Nothing is wrong with
    the bytes (they matched their checksum). If you trust the checkpoint, allow the class with
    ``torch.serialization.add_safe_globals([...])`` or load with ``weights_only=False``."""

    def __init__(self, message: str, *, path: str | None = None, global_name: str | None = None):
        super().__init__(message)
        self.path = path
        self.global_name = global_name


class AdoptionError(TxckptError):
    """A legacy root (checkpoint-N directories, no log) cannot be adopted as it is.

    ``root``: the root; ``step``: the step concerned (None if several); ``paths``: the
    directories concerned. Nothing was committed and no committed data was touched."""

    def __init__(self, message: str, *, root: str | None = None, step: int | None = None,
                 paths: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.root = root
        self.step = step
        self.paths = list(paths)
        self.path = self.paths[0] if self.paths else None


class AmbiguousCheckpointNameError(AdoptionError):
    """Two directories of a legacy root name one step (``checkpoint-500`` and ``checkpoint-0500``):
    which one a resume should load is unknowable. Rename or remove one of ``paths``."""


class AdoptionInProgressError(AdoptionError, ConcurrentWriterError):
    """Another live process is adopting the same legacy root and found other bytes in it (its
    files changed between the two hashings). Wait for it to finish, then retry."""


class LogCorruptError(TxckptError):
    """The root's commit log (``.txckpt/log``) is unreadable or inconsistent."""


class TransactionAbortedError(TxckptError):
    """A transaction did not commit: a rank failed, raised, or a name collided. Nothing was
    committed; the previous checkpoint is still the newest."""


class CoordinationTimeoutError(TransactionAbortedError, TimeoutError):
    """A collective of a transaction failed: another rank died, raised, or was slower than the
    timeout. The message says what is known about the commit (a rank that loses contact after
    rank 0 passed the commit point cannot know); ``get_last_checkpoint`` tells for sure."""


class StorageError(TxckptError, OSError):
    """The storage backend refused an operation (full disk, read-only root, permissions)."""


_STORAGE_ADVICE = {
    "ENOSPC": "the disk is full: free space (`txckpt gc` reclaims leftover staging) or save elsewhere",
    "EDQUOT": "the disk quota is exhausted: free space or raise the quota",
    "EROFS": "the root is on a read-only filesystem: save to a writable root",
    "EACCES": "permission denied: check the root's ownership and mode",
    "EPERM": "operation not permitted: check the root's ownership and mode",
}


def storage_error(e: OSError, what: str) -> OSError:
    """A StorageError saying what to do, for the OSErrors a user can act on; else ``e``."""
    import errno as _errno

    name = _errno.errorcode.get(e.errno or 0, "")
    advice = _STORAGE_ADVICE.get(name)
    if advice is None or isinstance(e, StorageError):
        return e
    err = StorageError(e.errno, f"txckpt could not {what}: {e.strerror or e}; {advice}. Nothing was committed.")
    err.filename = e.filename
    return err
