"""Checking stored bytes against a manifest.

On a local disk a file that will be decoded (safetensors, torch) is read once, with
``readinto``, into the buffer its tensors will live in, and hashed chunk by chunk behind the
reader (:func:`txckpt.fileio.read_into_buffer`): verification adds the hash and nothing else to
the reads an unverified load does. A file that is only checked is hashed through one small
reused buffer. Other backends read each file whole.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from . import checksum, fileio
from .errors import CheckpointNotFoundError, IntegrityError, UnsafePathError
from .manifest import FileEntry, Manifest
from .storage.base import Storage

#: Kinds that are decoded into tensors: read into a tensor buffer, decoded without another copy.
_BUFFER_KINDS = ("safetensors", "torch")


#: What a message about a damaged checkpoint tells the user to do (errors and docs quote it).
FALLBACK_HINT = (
    "resume from another checkpoint: on a restart, txckpt.resume(root, on_damaged=\"fallback\") "
    "(Trainer: txckpt_on_damaged=\"fallback\") forks from the newest checkpoint that verifies and "
    "keeps this one on disk; or pick one with `txckpt ls` and `txckpt resume ROOT --step K`"
)


def _missing(where: str, name: str) -> IntegrityError:
    return IntegrityError(
        f"{where}/{name} is missing (the manifest lists it): the checkpoint is damaged; {FALLBACK_HINT}",
        path=f"{where}/{name}",
    )


def _wrong_size(where: str, name: str, actual: int, expected: int) -> IntegrityError:
    return IntegrityError(
        f"{where}/{name} has {actual} bytes, the manifest says {expected} (truncated or "
        f"rewritten): the checkpoint is damaged; {FALLBACK_HINT}",
        path=f"{where}/{name}",
    )


def _wrong_checksum(where: str, name: str) -> IntegrityError:
    return IntegrityError(
        f"{where}/{name} does not match its checksum (xxh3-128): its bytes changed after the "
        f"commit; the checkpoint is damaged; {FALLBACK_HINT}",
        path=f"{where}/{name}",
    )


class FileProblem(Exception):
    """What :func:`check_file` found wrong with one file; each caller words it its own way
    (:func:`verify_checkpoint_files` raises IntegrityError on the first, ``txckpt verify`` lists
    them all).

    ``kind``: "symlink" (a symlink that leaves the root: not read), "missing", "directory" (a
    directory where the manifest lists a file), "size" or "checksum". ``size``: the bytes the
    file has, as far as known (0 when nothing was read); ``digest``: its xxh3-128 when computed."""

    def __init__(self, kind: str, *, size: int = 0, digest: str | None = None):
        super().__init__(kind)
        self.kind = kind
        self.size = size
        self.digest = digest


def check_file(storage: Storage, key: str, entry: FileEntry, *, keep: bool = False, verify: bool = True,
               pipeline: bool = True, stream: bool = False) -> tuple[int, Any]:
    """The one check of a stored file against its manifest entry: ``(size, content)``, where
    content is None unless ``keep`` (see :func:`verify_checkpoint_files`); raises
    :class:`FileProblem`. ``verify=False`` checks sizes only. A FIFO, socket or device raises
    SpecialFileError (never opened for a blocking read); other read errors propagate as OSError.
    ``stream`` (a backend without local paths, ``keep`` off): hash while reading instead of
    holding the whole file (``txckpt verify`` reads every checkpoint of a root)."""
    if storage.is_symlink_escape(key):
        raise FileProblem("symlink")
    local = storage.local_path(key)
    try:
        if local is not None and keep and entry.kind in _BUFFER_KINDS:
            data, digest = fileio.read_into_buffer(local, entry.size, hash=verify, pipeline=pipeline)
            if verify and digest != entry.checksum:
                raise FileProblem("checksum", size=entry.size, digest=digest)
            return entry.size, data
        if local is not None and not keep:
            if not verify:
                size = _stat_size(local)
                if size != entry.size:
                    raise FileProblem("size", size=size)
                return size, None
            size, digest = fileio.hash_file(local)
        elif stream and not keep:
            with storage.open_read(key) as f:
                size, digest = checksum.digest_stream(f)
        else:
            data = storage.read_bytes(key)
            size = len(data)
            if size != entry.size:
                raise FileProblem("size", size=size)
            if verify:
                digest = checksum.digest_bytes(data)
                if digest != entry.checksum:
                    raise FileProblem("checksum", size=size, digest=digest)
            return size, (data if keep else None)
    except fileio.SizeMismatch as e:
        raise FileProblem("size", size=e.actual) from None
    except IsADirectoryError:
        raise FileProblem("directory") from None
    except (FileNotFoundError, NotADirectoryError):
        raise FileProblem("missing") from None
    if size != entry.size:
        raise FileProblem("size", size=size, digest=digest)
    if digest != entry.checksum:
        raise FileProblem("checksum", size=size, digest=digest)
    return size, None


def _read_one(storage: Storage, manifest: Manifest, where: str, name: str, keep: bool, verify: bool,
              pipeline: bool = True):
    entry = manifest.files[name]
    try:
        return name, check_file(storage, name, entry, keep=keep, verify=verify, pipeline=pipeline)[1]
    except FileProblem as p:
        if p.kind == "symlink":
            raise UnsafePathError(f"{where}/{name} is a symlink that leaves the root; refusing to read it") from None
        if p.kind == "directory":
            raise IntegrityError(
                f"{where}/{name} is a directory where the manifest lists a file: the checkpoint is damaged; "
                "resume from another checkpoint (`txckpt ls`)"
            ) from None
        if p.kind == "missing":
            raise _missing(where, name) from None
        if p.kind == "size":
            raise _wrong_size(where, name, p.size, entry.size) from None
        raise _wrong_checksum(where, name) from None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Below this many bytes in all, a checkpoint's files are read one after the other.
_PARALLEL_MIN = 8 << 20


def _stat_size(path: str) -> int:
    return fileio.regular_size(path)


def verify_checkpoint_files(
    storage: Storage,
    manifest: Manifest,
    where: str,
    *,
    names: Iterable[str] | None = None,
    keep_bytes: bool = False,
    verify: bool = True,
    workers: int = 2,
) -> dict[str, Any]:
    """Read and check each named file (default: all). With ``keep_bytes`` returns each file's
    content for :func:`txckpt.serialization.read_object`: ``bytes``, or for safetensors and torch
    files on a local disk a ``torch.uint8`` tensor holding the file."""
    names = sorted(manifest.files) if names is None else list(names)
    for n in names:
        if n not in manifest.files:
            raise CheckpointNotFoundError(f"{where} has no file {n!r}")
    out: dict[str, Any] = {}
    # Hashing in a thread of its own costs about twice the CPU of hashing in the reader, and is
    # free only on a core that is otherwise idle. With as many readers as cores, the largest
    # file is the one still being read when the others are done: its hash gets that thread
    # (and a core freed by the others' readers); the others are hashed by their readers. Each
    # core beyond the readers takes the hash of one more file, largest first.
    # Small checkpoints are read in this thread: starting threads costs more than they save
    # below a few MiB (a reader polling a root loads many small ones).
    total = sum(manifest.files[n].size for n in names)
    sequential = workers <= 1 or len(names) <= 1 or total < _PARALLEL_MIN
    readers = 1 if sequential else min(workers, len(names))
    spare = _cpus() - readers
    by_size = sorted(names, key=lambda n: -manifest.files[n].size)
    pipelined = set(by_size[:spare + 1]) if _cpus() > 1 else set()

    def one(n: str):
        return _read_one(storage, manifest, where, n, keep_bytes, verify, pipeline=n in pipelined)

    if sequential:
        results = [one(n) for n in names]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(one, names))
    for name, data in results:
        if keep_bytes:
            out[name] = data
    return out
