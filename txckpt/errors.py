"""Typed errors. Every message says what happened and what to do next.

All errors derive from :class:`TxckptError`, so ``except txckpt.errors.TxckptError`` catches them all.
"""

from __future__ import annotations

import builtins
import errno as _errno
import pickle
import sys
from typing import Any, ClassVar, cast


class TxckptError(Exception):
    """Base class of every error txckpt raises on purpose.

    A class's keyword fields are its annotated attributes (its bases' included): the constructor
    takes each one as a keyword (default None) and stores it, and pickling (errors cross process
    boundaries: worker pools, spawn) and the cross-rank codec (:func:`encode_error`,
    :func:`decode_error`) give it back. One mechanism for every class, so a field added to a class
    is never lost on the way to another process."""

    #: The keyword fields of this class, bases first (filled in by __init_subclass__).
    fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        own = [n for n in cls.__dict__.get("__annotations__", {}) if not n.startswith("_") and n != "fields"]
        inherited = [f for base in reversed(cls.__mro__[1:]) for f in getattr(base, "fields", ())]
        cls.fields = tuple(dict.fromkeys(inherited + own))

    def __init__(self, *args: Any, **fields: Any):
        unknown = sorted(set(fields) - set(self.fields))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {unknown}; its fields: {list(self.fields)}")
        super().__init__(*args)
        for name in self.fields:
            setattr(self, name, fields.get(name))

    def __reduce__(self) -> tuple[Any, ...]:
        # Not the default (type(self)(*self.args)): the classes' constructors take their fields as
        # keywords, and some (the OSError ones) put more than the message in args.
        return _restore, (type(self), _full_args(self), dict(self.__dict__))


def _restore(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An error of class ``cls`` with ``args`` and attributes ``state``, built without calling
    the class's own constructor (which may compute a message or take keywords only)."""
    e: BaseException = cls.__new__(cls, *args)
    (OSError if issubclass(cls, OSError) else BaseException).__init__(e, *args)
    e.__dict__.update(state)
    return e


def _full_args(e: BaseException) -> tuple[Any, ...]:
    """What rebuilds ``e``'s base: its args, and for an OSError its file names too (OSError keeps
    only errno and strerror in args once a file name is given)."""
    if isinstance(e, OSError) and e.errno is not None and (e.filename is not None or e.filename2 is not None):
        extra = (e.filename,) if e.filename2 is None else (e.filename, None, e.filename2)
        return (e.errno, e.strerror, *extra)
    return tuple(e.args)


class InvalidArgumentError(TxckptError, ValueError):
    """A caller passed a value txckpt cannot accept (a bad file name, a negative step, ...)."""


class NotATxckptRootError(TxckptError):
    """The path is neither a txckpt root nor a legacy output_dir with checkpoint-N directories."""


class CheckpointNotFoundError(TxckptError, FileNotFoundError):
    """A checkpoint, or a file of one, that a caller or the log names does not exist."""


class CheckpointRetiredError(CheckpointNotFoundError):
    """The checkpoint a path names was committed, then retired by the retention policy (its data
    is deleted, or being deleted): it cannot be loaded or resumed from. ``txckpt ls ROOT --all``
    lists it. ``path``: as given; ``root``; ``step``, ``lineage``, ``txid``: the checkpoint's;
    ``retired_seq``: the log entry that retired it."""

    path: str | None
    root: str | None
    step: int | None
    lineage: str | None
    txid: str | None
    retired_seq: int | None


class RootNotFoundError(TxckptError, FileNotFoundError):
    """The root passed to a lookup does not exist: a local directory that is missing, or an
    fsspec URL whose bucket does not exist (a typo in ``output_dir``, usually). Like
    transformers' ``get_last_checkpoint``, txckpt raises instead of answering "no checkpoint",
    which would silently train from scratch. ``root``: the root as given; ``bucket``: the
    missing bucket (None for a local directory)."""

    root: str | None
    bucket: str | None

    def __init__(self, message: str, *, root: str | None = None, bucket: str | None = None):
        # errno ENOENT and the name, as FileNotFoundError has
        super().__init__(2, message, root, root=root, bucket=bucket)

    def __str__(self) -> str:
        # strerror alone (no "[Errno 2] ...: root"); a copy reworded by the codec has only args.
        return str(self.strerror) if self.strerror is not None else super().__str__()


class MissingDependencyError(TxckptError, ImportError):
    """A root URL needs a package that is not installed (or does not import): s3fs for
    ``s3://``, gcsfs for ``gs://``, adlfs for ``az://``. ``root``: the root as given;
    ``protocol``: the URL scheme that needs it; ``package``: what to install; ``extra``: the
    txckpt extra that brings it (``pip install 'txckpt[s3]'``), None where txckpt has none (the
    message then passes on what fsspec says is needed)."""

    root: str | None
    protocol: str | None
    package: str | None
    extra: str | None


class LookupRaceError(TxckptError):
    """A lookup found the newest checkpoint retired and deleted under it again and again: a
    writer rotates (retention with a small keep_last) faster than this reader reads. Nothing is
    damaged; retry, keep more checkpoints, or take a reader lease. ``root``, ``attempts``."""

    root: str | None
    attempts: int | None


class LineageNotFoundError(CheckpointNotFoundError):
    """A lineage id that the root's log does not know (a typo, or another root's id).

    ``lineage``: the id asked for; ``known``: the root's lineage ids (``txckpt log`` shows them)."""

    lineage: str | None
    known: list[str]

    def __init__(self, message: str, *, lineage: str | None = None, known: list[str] | tuple[str, ...] = ()):
        super().__init__(message, lineage=lineage, known=list(known))


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

    path: str | None


class SpecialFileError(IntegrityError):
    """A name txckpt reads as a regular file is a FIFO, socket or device (something replaced the
    file). txckpt never opens it for a blocking read. ``.path``: where; ``.kind``: what it is."""

    kind: str | None

    def __init__(self, message: str = "", *, path: str | None = None, kind: str | None = None):
        if not message and path is not None:
            message = (
                f"{path} is a {kind or 'special file'}, not a regular file: something replaced a file "
                "txckpt reads (by hand, or another program), and txckpt does not read from it. Remove "
                "it; a checkpoint that lists it is damaged: resume from another one (`txckpt ls`)"
            )
        super().__init__(message, path=path, kind=kind)


class ManifestError(IntegrityError):
    """A manifest is missing, unreadable, edited, of an unknown format, or names unsafe paths."""


class NoIntactCheckpointError(IntegrityError):
    """``resume(root, on_damaged="fallback")`` found every checkpoint of the current lineage
    damaged (or missing): there is nothing to fall back to, and nothing was forked or changed.
    ``root``; ``damaged``: one ``{"step", "txid", "path", "error"}`` per checkpoint, newest
    first (``path``: the file that failed); ``path``: the newest one's failing file. Restore the
    files from a backup, or start a new lineage (``train(resume_from_checkpoint=None)``,
    ``txckpt.new_lineage``)."""

    root: str | None
    damaged: list[dict[str, Any]]

    def __init__(
        self,
        message: str = "",
        *,
        path: str | None = None,
        root: str | None = None,
        damaged: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
    ):
        super().__init__(message, path=path, root=root, damaged=list(damaged))


class TensorIntegrityError(IntegrityError):
    """The bytes of one tensor (or one chunk) of a checkpoint's file do not match the digest
    its manifest's tensor index records (``txckpt.load_tensors``). ``path``: the file;
    ``file``: its name in the checkpoint; ``tensor``: the tensor's name (None for a chunk).
    Nothing was returned. The file is damaged: ``txckpt verify`` the checkpoint, load another
    one, or restore the file from a copy."""

    file: str | None
    tensor: str | None


class TensorNotFoundError(InvalidArgumentError):
    """``txckpt.load_tensors`` was asked for a tensor that the checkpoint's tensor index does
    not hold. ``path``: the checkpoint; ``tensor``: the name asked for; ``close_names``: the
    index's names closest to it (difflib), maybe empty. ``txckpt inspect PATH`` lists them all."""

    path: str | None
    tensor: str | None
    close_names: list[str] | None


class UnsafePathError(ManifestError, InvalidArgumentError):
    """A file name escapes its checkpoint: ``..``, an absolute path, or a symlink that leaves the root."""


class NotACheckpointError(ManifestError, InvalidArgumentError):
    """A path given as a checkpoint is a root (a Trainer ``output_dir`` with ``.txckpt/log`` or
    ``checkpoint-N`` directories), not one checkpoint. ``path``: the path given. Load the
    root's newest checkpoint with ``load_checkpoint(get_last_checkpoint(root))``."""


class WeightsOnlyError(TxckptError, pickle.UnpicklingError):
    """A torch file of a checkpoint pickles an object that torch's ``weights_only=True`` loader
    (txckpt's default) refuses to build. ``path``: the file; ``global_name``: the global it
    refused (``"argparse.Namespace"``), None if torch did not name one. Nothing is wrong with
    the bytes (they matched their checksum). If you trust the checkpoint, allow the class with
    ``torch.serialization.add_safe_globals([...])`` or load with ``weights_only=False``."""

    path: str | None
    global_name: str | None


class AdoptionError(TxckptError):
    """A legacy root (checkpoint-N directories, no log) cannot be adopted as it is.

    ``root``: the root; ``step``: the step concerned (None if several); ``paths``: the
    directories concerned. Nothing was committed and no committed data was touched."""

    root: str | None
    step: int | None
    paths: list[str]
    path: str | None  # the first of paths

    def __init__(
        self,
        message: str,
        *,
        root: str | None = None,
        step: int | None = None,
        paths: list[str] | tuple[str, ...] = (),
        path: str | None = None,
    ):
        paths = list(paths)
        super().__init__(
            message, root=root, step=step, paths=paths, path=path if path is not None else (paths[0] if paths else None)
        )


class AmbiguousCheckpointNameError(AdoptionError):
    """Two directories of a legacy root name one step (``checkpoint-500`` and ``checkpoint-0500``):
    which one a resume should load is unknowable. Rename or remove one of ``paths``."""


class AdoptionInProgressError(AdoptionError, ConcurrentWriterError):
    """Another live process is adopting the same legacy root and found other bytes in it (its
    files changed between the two hashings). Wait for it to finish, then retry."""


class ReplicationError(TxckptError):
    """A tiered root's checkpoint could not be made durable (committed on the durable tier,
    protocol §14). It stays committed on the fast tier, whose retention keeps it until it is
    durable; the next save (or ``TieredRoot.wait_durable``) retries. ``txid``: the checkpoint,
    where one is to blame; ``durable``: the durable tier's URL."""

    txid: str | None
    durable: str | None


class LogCorruptError(TxckptError):
    """The root's commit log (``.txckpt/log``) is unreadable or inconsistent."""


class TransactionAbortedError(TxckptError):
    """A transaction did not commit: a rank failed, raised, or a name collided. Nothing was
    committed; the previous checkpoint is still the newest."""


class CoordinationTimeoutError(TransactionAbortedError, TimeoutError):
    """A collective of a transaction failed: another rank died, raised, or was slower than the
    timeout. The message says what is known about the commit (a rank that loses contact after
    rank 0 passed the commit point cannot know); ``get_last_checkpoint`` tells for sure.
    ``phase``: what the ranks were doing when it failed (``"save plan"``, ``"resume"``, or the
    collective of a save: ``"gather"``, ``"broadcast"``)."""

    phase: str | None


class StorageError(TxckptError, OSError):
    """The storage backend refused an operation (full disk, read-only root, permissions)."""


class TempFileRemovedError(StorageError):
    """The private temp file of a create-if-absent (or replace) write vanished before it got its
    name: another process deleted it (``txckpt gc --grace 0`` beside a running job, or by hand).
    Nothing was written under the final name. ``.path``: the temp file."""

    path: str | None
    target: str | None

    def __init__(self, message: str = "", *, path: str | None = None, target: str | None = None):
        if not message:
            message = (
                f"the temp file {path} vanished before txckpt could link it to {target}: another process "
                "deleted it (`txckpt gc --grace 0` running beside this job, or by hand). Nothing was "
                f"written under {target} and nothing was lost; retry, and run gc with a grace period "
                "longer than a write takes (the default, 3600 s)"
            )
        super().__init__(_errno.ENOENT, message, path=path, target=target)


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

    root: str | None
    endpoint: str | None


class CredentialsError(RemoteAccessError):
    """The client found no credentials for a remote root (none in the environment, the
    profile or ``storage_options``). The message names where it looks; docs/remote.md has the
    how-to."""


class EndpointUnreachableError(RemoteAccessError):
    """No connection to the storage endpoint could be made (a wrong ``endpoint_url``, a server
    that is not running, no network). ``attempts``: how many the client made; ``seconds``: how
    long they took."""

    attempts: int | None
    seconds: float | None


class NamingConflictError(InvalidArgumentError):
    """A root publishes its checkpoints under one naming (``checkpoint-N`` by default, recorded in
    ``.txckpt/naming``); a writer asked for another one (``checkpoint_N``, accelerate's). Two
    namings in one root would give one step two public names. Use the naming the root has, or
    another root. ``root``, ``recorded`` and ``requested``: the prefixes."""

    root: str | None
    recorded: str | None
    requested: str | None


class RngStateError(InvalidArgumentError):
    """``txckpt.set_rng_state(state)`` got a state it cannot restore exactly: another format
    version, or another layout of generators than this process has (numpy captured but not
    importable here, another number of CUDA devices, CUDA generators captured where CUDA is not
    available). Nothing was restored. Restore in a process laid out as the one that captured
    it (the same rank's state, the same devices), or pass ``strict=False`` to restore the
    generators both have. ``state_layout``, ``process_layout``: what each has (``{"version":
    1, "numpy": True, "cuda": 2}``)."""

    state_layout: dict[str, Any] | None
    process_layout: dict[str, Any] | None


class FileNameConflictError(InvalidArgumentError):
    """Two file names of one checkpoint of which one is a directory of the other (``a`` and
    ``a/b``; protocol §3): no file system can hold both. Raised when one rank writes both, and
    when two ranks do (the second to create its file finds the other's file, or directory, in
    the shared staging). Nothing commits; rename one of them. ``name``: the name that would
    have to be a directory; ``nested``: the name below it."""

    name: str | None
    nested: str | None


class SignalNotCatchableError(InvalidArgumentError):
    """``txckpt.preemption.install`` was given a signal no handler can replace (SIGKILL,
    SIGSTOP: the kernel acts on them itself), or one this platform refuses. Install the signal
    the scheduler sends before its SIGKILL (SIGTERM; SIGUSR1 with SLURM's ``--signal``).
    ``signals``: the numbers refused."""

    signals: list[int] | None


# ----- the cross-rank codec ---------------------------------------------------------------------
# One rank's error travels to the others as plain data (an object collective pickles it, and a
# rank must never unpickle arbitrary classes of another's): a txckpt error comes back as the same
# class with the same message and fields, through the same state pickling uses; any other error
# as the nearest builtin exception class it derives from (ValueError, OSError, ...), else
# RuntimeError, with its message.


def encode_error(e: BaseException, *, rank: int | None = None) -> dict[str, Any]:
    """``e`` as plain data for another rank: ``type`` (a class of this module, or a builtin
    exception), ``message`` (``str(e)``), ``args`` and ``state`` (what rebuilds it exactly;
    None/{} when only the message travels) and ``rank`` (where it was raised, None if unknown)."""
    for cls in type(e).__mro__:
        if getattr(_this_module(), cls.__name__, None) is cls and issubclass(cls, TxckptError):
            args: tuple[Any, ...] | None = _full_args(e)
            state = {k: v for k, v in vars(e).items() if k != "__notes__"}
            try:
                pickle.dumps((args, state))
            except Exception:  # noqa: BLE001 - a field that cannot travel: the message does
                args, state = None, {}
            return {"type": cls.__name__, "message": str(e), "args": args, "state": state, "rank": rank}
    base = _nearest_builtin(type(e))
    exact = base is type(e)
    args = _full_args(e) if exact else None
    if args is not None:
        try:
            pickle.dumps(args)
        except Exception:  # noqa: BLE001
            args = None
    return {"type": base.__name__, "message": str(e), "args": args, "state": {}, "rank": rank}


def decode_error(d: dict[str, Any]) -> BaseException:
    """The error :func:`encode_error` described (a RuntimeError for an unknown type)."""
    name = str(d.get("type", ""))
    message = str(d.get("message", ""))
    args = d.get("args")
    args = (message,) if args is None else tuple(args)
    cls = getattr(_this_module(), name, None)
    if isinstance(cls, type) and issubclass(cls, TxckptError):
        return _restore(cls, args, dict(d.get("state") or {}))
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        try:
            return builtin(*args)
        except Exception:  # noqa: BLE001 - a builtin whose args do not fit: the message does
            return builtin(message)
    return RuntimeError(message)


def reworded(d: dict[str, Any], message: str) -> dict[str, Any]:
    """Encoded error ``d`` with another message (same class and fields)."""
    return dict(d, message=message, args=None)


def is_txckpt_error(d: dict[str, Any]) -> bool:
    """Whether encoded error ``d`` decodes to a :class:`TxckptError`."""
    cls = getattr(_this_module(), str(d.get("type", "")), None)
    return isinstance(cls, type) and issubclass(cls, TxckptError)


def _nearest_builtin(cls: type) -> type:
    for c in cls.__mro__:
        if getattr(builtins, c.__name__, None) is c and issubclass(c, Exception) and c is not Exception:
            return cast(type, c)  # `is` against getattr's Any made c Any to the checker
    return RuntimeError


def _this_module() -> Any:
    return sys.modules[__name__]


#: The public errors (docs/api.md, "Errors"): every class above. The codec (encode_error,
#: decode_error, reworded, is_txckpt_error) and storage_error are internal.
__all__ = [
    "TxckptError",
    "InvalidArgumentError",
    "NamingConflictError",
    "RngStateError",
    "FileNameConflictError",
    "SignalNotCatchableError",
    "NotATxckptRootError",
    "CheckpointNotFoundError",
    "CheckpointRetiredError",
    "LineageNotFoundError",
    "RootNotFoundError",
    "MissingDependencyError",
    "LookupRaceError",
    "StepConflictError",
    "ConcurrentWriterError",
    "StaleLineageError",
    "IntegrityError",
    "SpecialFileError",
    "ManifestError",
    "NoIntactCheckpointError",
    "TensorIntegrityError",
    "TensorNotFoundError",
    "UnsafePathError",
    "NotACheckpointError",
    "WeightsOnlyError",
    "AdoptionError",
    "AmbiguousCheckpointNameError",
    "AdoptionInProgressError",
    "LogCorruptError",
    "ReplicationError",
    "TransactionAbortedError",
    "CoordinationTimeoutError",
    "StorageError",
    "TempFileRemovedError",
    "RemoteAccessError",
    "CredentialsError",
    "EndpointUnreachableError",
]
