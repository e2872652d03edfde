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


class RootNotFoundError(TxckptError, FileNotFoundError):
    """The root passed to a lookup does not exist: a local directory that is missing, or an
    fsspec URL whose bucket does not exist (a typo in ``output_dir``, usually). Like
    transformers' ``get_last_checkpoint``, txckpt raises instead of answering "no checkpoint",
    which would silently train from scratch. ``root``: the root as given; ``bucket``: the
    missing bucket (None for a local directory)."""

    def __init__(self, message: str, *, root: str | None = None, bucket: str | None = None):
        super().__init__(2, message, root)  # errno ENOENT and the name, as FileNotFoundError has
        self.root = root
        self.bucket = bucket

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"root": self.root, "bucket": self.bucket})


class LookupRaceError(TxckptError):
    """A lookup found the newest checkpoint retired and deleted under it again and again: a
    writer rotates (retention with a small keep_last) faster than this reader reads. Nothing is
    damaged; retry, keep more checkpoints, or take a reader lease. ``root``, ``attempts``."""

    def __init__(self, message: str, *, root: str | None = None, attempts: int | None = None):
        super().__init__(message)
        self.root = root
        self.attempts = attempts

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"root": self.root, "attempts": self.attempts})


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
    """Stored bytes do not match the manifest (size, checksum, missing file, edited manifest).

    ``path``: the file that failed (a checkpoint file, or its manifest), when known. On a restart,
    ``txckpt.resume(root, on_damaged="fallback")`` (Trainer: ``txckpt_on_damaged="fallback"``)
    forks from the newest checkpoint that verifies instead of raising."""

    def __init__(self, message: str = "", *, path: str | None = None):
        super().__init__(message)
        self.path = path

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"path": self.path})


class SpecialFileError(IntegrityError):
    """A name txckpt reads as a regular file is a FIFO, socket or device (something replaced the
    file). txckpt never opens it for a blocking read. ``.path``: where; ``.kind``: what it is."""

    def __init__(self, message: str = "", *, path: str | None = None, kind: str | None = None):
        if not message and path is not None:
            message = (
                f"{path} is a {kind or 'special file'}, not a regular file: something replaced a file "
                "txckpt reads (by hand, or another program), and txckpt does not read from it. Remove "
                "it; a checkpoint that lists it is damaged: resume from another one (`txckpt ls`)"
            )
        super().__init__(message)
        self.path = path
        self.kind = kind


class ManifestError(IntegrityError):
    """A manifest is missing, unreadable, edited, of an unknown format, or names unsafe paths."""


class NoIntactCheckpointError(IntegrityError):
    """``resume(root, on_damaged="fallback")`` found every checkpoint of the current lineage
    damaged (or missing): there is nothing to fall back to, and nothing was forked or changed.
    ``root``; ``damaged``: one ``{"step", "txid", "path", "error"}`` per checkpoint, newest
    first (``path``: the file that failed); ``path``: the newest one's failing file. Restore the
    files from a backup, or start a new lineage (``train(resume_from_checkpoint=None)``,
    ``txckpt.new_lineage``)."""

    def __init__(self, message: str = "", *, path: str | None = None, root: str | None = None,
                 damaged: list[dict] | tuple = ()):
        super().__init__(message, path=path)
        self.root = root
        self.damaged = list(damaged)

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"path": self.path, "root": self.root,
                                                      "damaged": self.damaged})


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


class TempFileRemovedError(StorageError):
    """The private temp file of a create-if-absent (or replace) write vanished before it got its
    name: another process deleted it (``txckpt gc --grace 0`` beside a running job, or by hand).
    Nothing was written under the final name. ``.path``: the temp file."""

    def __init__(self, message: str = "", *, path: str | None = None, target: str | None = None):
        import errno as _errno

        if not message:
            message = (
                f"the temp file {path} vanished before txckpt could link it to {target}: another process "
                "deleted it (`txckpt gc --grace 0` running beside this job, or by hand). Nothing was "
                f"written under {target} and nothing was lost; retry, and run gc with a grace period "
                "longer than a write takes (the default, 3600 s)"
            )
        super().__init__(_errno.ENOENT, message)
        self.path = path
        self.target = target


_STORAGE_ADVICE = {
    "ENOSPC": "the disk is full: free space (`txckpt gc ROOT` reclaims leftover staging; `txckpt gc ROOT "
              "--keep-last N` deletes older checkpoints, recording it in space txckpt reserves for that) or "
              "save elsewhere",
    "EDQUOT": "the disk quota is exhausted: free space or raise the quota",
    "EROFS": "the root is on a read-only filesystem: save to a writable root",
    "EACCES": "permission denied: check the root's ownership and mode",
    "EPERM": "operation not permitted: check the root's ownership and mode",
    "ENAMETOOLONG": "a path is longer than the file system allows: use shorter file names, or a root "
                    "with a shorter path",
}


def storage_error(e: OSError, what: str) -> OSError:
    """A StorageError saying what to do, for the OSErrors a user can act on; else ``e``."""
    import errno as _errno

    name = _errno.errorcode.get(e.errno or 0, "")
    advice = _STORAGE_ADVICE.get(name)
    if advice is None or isinstance(e, StorageError):
        return e
    err = StorageError(e.errno, f"txckpt could not {what}: {e.strerror or e}; {advice}. Nothing was committed.")
    if e.filename is not None:  # OSError's str() would end in ": None"
        err.filename = e.filename
    return err


class RemoteAccessError(TxckptError):
    """A remote root (S3, GCS, Azure) cannot be reached as configured. Not an OSError on
    purpose: code that tolerates a missing key must not take it for one. ``root``: the root;
    ``endpoint``: the endpoint the client used (None: the provider's default)."""

    def __init__(self, message: str, *, root: str | None = None, endpoint: str | None = None):
        super().__init__(message)
        self.root = root
        self.endpoint = endpoint

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"root": self.root, "endpoint": self.endpoint})


class CredentialsError(RemoteAccessError):
    """The client found no credentials for a remote root (none in the environment, the
    profile or ``storage_options``). The message names where it looks; docs/remote.md has the
    how-to."""


class EndpointUnreachableError(RemoteAccessError):
    """No connection to the storage endpoint could be made (a wrong ``endpoint_url``, a server
    that is not running, no network). ``attempts``: how many the client made; ``seconds``: how
    long they took."""

    def __init__(self, message: str, *, root: str | None = None, endpoint: str | None = None,
                 attempts: int | None = None, seconds: float | None = None):
        super().__init__(message, root=root, endpoint=endpoint)
        self.attempts = attempts
        self.seconds = seconds

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"root": self.root, "endpoint": self.endpoint,
                                                      "attempts": self.attempts, "seconds": self.seconds})


def _with_fields(cls: type, message: str, fields: dict) -> Exception:
    """Unpickle an error that carries keyword fields (errors cross process boundaries)."""
    return cls(message, **fields)


class NamingConflictError(InvalidArgumentError):
    """A root publishes its checkpoints under one naming (``checkpoint-N`` by default, recorded in
    ``.txckpt/naming``); a writer asked for another one (``checkpoint_N``, accelerate's). Two
    namings in one root would give one step two public names. Use the naming the root has, or
    another root. ``root``, ``recorded`` and ``requested``: the prefixes."""

    def __init__(self, message: str, *, root: str | None = None, recorded: str | None = None,
                 requested: str | None = None):
        super().__init__(message)
        self.root = root
        self.recorded = recorded
        self.requested = requested

    def __reduce__(self):
        return _with_fields, (type(self), str(self), {"root": self.root, "recorded": self.recorded,
                                                       "requested": self.requested})
