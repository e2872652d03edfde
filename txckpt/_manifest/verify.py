"""Checking stored bytes against a manifest.

On a local disk a file that will be decoded (safetensors, torch) is read once, with
``readinto``, into the buffer its tensors will live in, and hashed chunk by chunk behind the
reader (:func:`txckpt._base.fileio.read_into_buffer`): verification adds the hash and nothing else to
the reads an unverified load does. A file that is only checked is hashed through one small
reused buffer. Other backends read each file whole.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Collection, Iterable, Iterator

from .._base import checksum
from .._base import fileio
from ..errors import CheckpointNotFoundError, IntegrityError, UnsafePathError
from .manifest import FileEntry, Manifest
from .tensor_index import Indexer
from .._storage.base import Storage

#: Kinds that are decoded into tensors: read into a tensor buffer, decoded without another copy.
_BUFFER_KINDS = ("safetensors", "torch")


#: What a message about a damaged checkpoint tells the user to do (errors and docs quote it).
FALLBACK_HINT = (
    'resume from another checkpoint: on a restart, txckpt.resume(root, on_damaged="fallback") '
    '(Trainer: txckpt_on_damaged="fallback") forks from the newest checkpoint that verifies and '
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


def wrong_checksum(where: str, name: str, damage: str = "") -> IntegrityError:
    return IntegrityError(
        f"{where}/{name} does not match its checksum (xxh3-128): its bytes changed after the "
        f"commit{f' ({damage})' if damage else ''}; the checkpoint is damaged; {FALLBACK_HINT}",
        path=f"{where}/{name}",
    )


def locate_damage(storage: Storage, key: str, name: str, entry: FileEntry) -> str:
    """Where the file ``key`` (``name`` in its checkpoint), whose checksum did not match
    ``entry``, differs from what the entry's index records (protocol §3b): its damaged chunks'
    byte ranges and, for a safetensors file, the tensors whose bytes changed, in words; "" where
    the entry has no index to tell by (a file written before it) or the file cannot be read
    again. Reads the file once more, through the index builder the save used: only ever on the
    path where the file was found damaged. Never raises."""
    index = entry.index
    if index is None or index.chunk_size <= 0:
        return ""
    # Records with an encoding are DCP items: their ranges come from the index, not a header.
    encoded = index.tensors if index.tensors and any(t.encoding is not None for t in index.tensors) else None
    indexer = Indexer(name, chunk_size=index.chunk_size, ranges=encoded)
    size = 0
    try:
        with storage.open_read(key) as f:
            for piece in iter(lambda: f.read(index.chunk_size), b""):
                indexer.update(piece)
                size += len(piece)
    except (OSError, ValueError):
        return ""
    found = indexer.finish(size)
    want = index.chunk_digests(entry.size, entry.checksum)
    # A file of one chunk records no chunk digests: its one chunk is the file, which did not match.
    got = list(found.chunks) if found.chunks else [""]
    bad = [i for i, d in enumerate(want) if i >= len(got) or got[i] != d]
    parts = []
    if len(want) > 1 and bad:
        shown = ", ".join(
            f"chunk {i} (bytes {start}-{start + length - 1})"
            for i in bad[:4]
            for start, length in [index.chunk_range(i, entry.size)]
        )
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        parts.append(f"{len(bad)} of its {len(want)} chunks of {index.chunk_size >> 20} MiB differ: {shown}{more}")
    if index.tensors is not None:
        now = {t.name: t for t in found.tensors or ()}
        if found.tensors is None or {t.name for t in index.tensors} != set(now):
            parts.append("its safetensors header changed" if encoded is None else "it is shorter than its items")
        else:
            changed = [
                t.name for t in index.tensors if (now[t.name].offset, now[t.name].checksum) != (t.offset, t.checksum)
            ]
            names = ", ".join(repr(n) for n in changed[:8]) + (
                f" and {len(changed) - 8} more" if len(changed) > 8 else ""
            )
            parts.append(
                f"{len(changed)} of its {len(index.tensors)} tensors changed"
                + (f": {names}" if changed else "")
                + (
                    "; the others verify on their own (txckpt.load_tensors)"
                    if changed and len(changed) < len(index.tensors)
                    else ""
                )
            )
    return "; ".join(parts)


@contextlib.contextmanager
def _as_file_problems() -> Iterator[None]:
    """What reading a stored file can raise, as the :class:`FileProblem` it means."""
    try:
        yield
    except fileio.SizeMismatch as e:
        raise FileProblem("size", size=e.actual) from None
    except IsADirectoryError:
        raise FileProblem("directory") from None
    except (FileNotFoundError, NotADirectoryError):
        raise FileProblem("missing") from None


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


class Deferred:
    """A file's content whose check may still be running: ``content`` (a ``torch.uint8``
    buffer or ``bytes``) can be read now; ``check()`` waits for the hash and raises
    :class:`FileProblem` unless it matches the manifest. Until check() has returned, the bytes
    are unchecked: decode them only with a decoder that is safe on any input, and hand nothing
    decoded out before it returned (:func:`load_checkpoint_files`)."""

    def __init__(self, content: Any, check: Callable[[], None]):
        self.content = content
        self._check = check
        self._checked = False

    def check(self) -> None:
        if not self._checked:
            self._check()
            self._checked = True


def _no_check() -> None:
    pass


def check_file(
    storage: Storage,
    key: str,
    entry: FileEntry,
    *,
    keep: bool = False,
    verify: bool = True,
    pipeline: bool = True,
    stream: bool = False,
) -> tuple[int, Any]:
    """The one check of a stored file against its manifest entry: ``(size, content)``, where
    content is None unless ``keep`` (see :func:`verify_checkpoint_files`); raises
    :class:`FileProblem`. ``verify=False`` checks sizes only. A FIFO, socket or device raises
    SpecialFileError (never opened for a blocking read); other read errors propagate as OSError.
    ``stream`` (a backend without local paths, ``keep`` off): hash while reading instead of
    holding the whole file (``txckpt verify`` reads every checkpoint of a root)."""
    if keep:
        got = read_file(storage, key, entry, verify=verify, pipeline=pipeline, overlap=False)
        got.check()
        return entry.size, got.content
    escapes, local = storage.read_location(key)
    if escapes:
        raise FileProblem("symlink")
    with _as_file_problems():
        if local is not None:
            if not verify:
                size = _stat_size(local)
                if size != entry.size:
                    raise FileProblem("size", size=size)
                return size, None
            size, digest = fileio.hash_file(local)
        elif stream:
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
            return size, None
    if size != entry.size:
        raise FileProblem("size", size=size, digest=digest)
    if digest != entry.checksum:
        raise FileProblem("checksum", size=size, digest=digest)
    return size, None


#: From this size up a file's hash is worth a thread of its own while the file is decoded
#: (below it, starting the thread costs about what the overlap saves).
_OVERLAP_MIN = 16 << 20


def read_file(
    storage: Storage,
    key: str,
    entry: FileEntry,
    *,
    verify: bool = True,
    pipeline: bool = True,
    overlap: bool = True,
    mmap: bool = False,
) -> Deferred:
    """Read one stored file whole, once, and start its check: a :class:`Deferred` whose
    ``check()`` raises :class:`FileProblem` (sizes are checked before this returns).

    A safetensors or torch file on a local disk is read into the buffer its tensors will be
    views of, hashed chunk by chunk as it lands (:func:`txckpt._base.fileio.start_read_into_buffer`;
    on an object store that offers it, :meth:`Storage.start_read`: S3's parallel ranged GETs);
    what the reader has not hashed yet when the last byte lands is hashed behind it, meanwhile
    the caller can decode. Any other file is read as ``bytes``; with ``overlap`` (a core to
    spare, a large file) its hash runs in a thread of its own while the caller decodes.

    With ``mmap``, such a local file is mapped instead of read (:func:`txckpt._base.fileio.start_map_file`):
    the buffer is the page cache's pages, hashed in place."""
    escapes, local = storage.read_location(key)
    if escapes:
        raise FileProblem("symlink")
    with _as_file_problems():
        pending = None
        if local is not None and entry.kind in _BUFFER_KINDS:
            start = fileio.start_map_file if mmap else fileio.start_read_into_buffer
            pending = start(local, entry.size, hash=verify, pipeline=pipeline)
        elif local is None and entry.kind in _BUFFER_KINDS:
            # An object store that reads faster in parallel parts (S3: ranged GETs into the
            # buffer, hashed as they land), or None: one GET below.
            pending = storage.start_read(key, entry.size, hash=verify)
        if pending is not None:
            read = pending

            def check_buffer() -> None:
                digest = read.digest()
                if verify and digest != entry.checksum:
                    raise FileProblem("checksum", size=entry.size, digest=digest)

            return Deferred(pending.buffer, check_buffer)
        if local is not None:
            with fileio.open_regular_file(local) as f:  # as the local backend reads it
                data = f.read()
        else:
            data = storage.read_bytes(key)
    size = len(data)
    if size != entry.size:
        raise FileProblem("size", size=size)
    if not verify:
        return Deferred(data, _no_check)
    if overlap and size >= _OVERLAP_MIN and _cpus() > 1:
        hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="txckpt-hash")
        digest_of = hashing.submit(checksum.digest_bytes, data)
        hashing.shutdown(wait=False)  # the thread ends with its one task

        def check_bytes() -> None:
            digest = digest_of.result()
            if digest != entry.checksum:
                raise FileProblem("checksum", size=size, digest=digest)

        return Deferred(data, check_bytes)
    digest = checksum.digest_bytes(data)
    if digest != entry.checksum:
        raise FileProblem("checksum", size=size, digest=digest)
    return Deferred(data, _no_check)


def _problem_error(
    p: FileProblem, where: str, name: str, entry: FileEntry, storage: Storage | None = None, key: str = ""
) -> Exception:
    if p.kind == "symlink":
        return UnsafePathError(f"{where}/{name} is a symlink that leaves the root; refusing to read it")
    if p.kind == "directory":
        return IntegrityError(
            f"{where}/{name} is a directory where the manifest lists a file: the checkpoint is damaged; "
            "resume from another checkpoint (`txckpt ls`)"
        )
    if p.kind == "missing":
        return _missing(where, name)
    if p.kind == "size":
        return _wrong_size(where, name, p.size, entry.size)
    return wrong_checksum(where, name, locate_damage(storage, key, name, entry) if storage is not None else "")


def _read_one(
    storage: Storage,
    manifest: Manifest,
    where: str,
    name: str,
    keep: bool,
    verify: bool,
    pipeline: bool = True,
    at: str = "",
):
    entry = manifest.files[name]
    key = f"{at}/{name}" if at else name
    try:
        return name, check_file(storage, key, entry, keep=keep, verify=verify, pipeline=pipeline)[1]
    except FileProblem as p:
        raise _problem_error(p, where, name, entry, storage, key) from None


class DecodeFailed:
    """What the decoder raised on a file whose check then passed: handed back in the file's place
    by :func:`load_checkpoint_files`, for the caller to raise once the read is done (a file that
    does not decode is not a damaged or moved checkpoint)."""

    def __init__(self, error: Exception):
        self.error = error


#: ``decode(name, kind, content, where=path_of_the_file)``: what :func:`load_checkpoint_files`
#: decodes with (:func:`txckpt._save.serialization.read_object`, its options bound).
Decoder = Callable[..., Any]


def _load_one(
    storage: Storage,
    manifest: Manifest,
    where: str,
    name: str,
    verify: bool,
    pipeline: bool,
    decode: Decoder,
    early: Collection[str],
    mmap: bool,
    at: str = "",
) -> tuple[str, bool, Any]:
    """``(name, decoded?, value)``: read ``name`` once and check it; a file whose kind is in
    ``early`` is decoded while its hash finishes, and what it decoded is dropped unless the hash
    matches."""
    entry = manifest.files[name]
    got: Deferred | None = None
    value: Any = None
    try:
        got = read_file(storage, f"{at}/{name}" if at else name, entry, verify=verify, pipeline=pipeline, mmap=mmap)
        if entry.kind not in early:
            got.check()
            return name, False, got.content
        try:
            value = decode(name, entry.kind, got.content, where=f"{where.rstrip('/')}/{name}")
        except Exception as e:
            # A damaged file is reported as damaged, not as whatever its damage made the
            # decoder say (a flipped byte in a pickle reads as a forbidden global).
            got.check()
            return name, True, DecodeFailed(e)
        got.check()
        return name, True, value
    except FileProblem as p:
        error = _problem_error(p, where, name, entry, storage, f"{at}/{name}" if at else name)
    # Raised outside the handler, with these locals gone: the error's traceback and context would
    # otherwise keep the damaged buffer and what was decoded from it for as long as the caller
    # keeps the error.
    got = value = None
    raise error


def _cpus() -> int:
    # checksum.usable_cores, asked in this module: a verified load's walk stays at its 45 hops.
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Below this many bytes in all, a checkpoint's files are read one after the other.
_PARALLEL_MIN = 8 << 20


def _stat_size(path: str) -> int:
    return fileio.regular_size(path)


#: Files read at once from a store where every read is a round trip (``Storage.overlap_requests``):
#: a checkpoint of many small files (a Trainer's config, scheduler, RNG and trainer states) then
#: costs about one round trip rather than one per file. The hash threads stay as many as the
#: cores allow (``_plan``): these readers mostly wait on the network.
_REMOTE_READERS = 8


def _plan(
    storage: Storage, manifest: Manifest, where: str, names: Iterable[str] | None, workers: int
) -> tuple[list[str], int, set[str]]:
    """(names, how many to read at once (1: one after the other, in this thread), the names
    whose hash gets a thread of its own)."""
    names = sorted(manifest.files) if names is None else list(names)
    for n in names:
        if n not in manifest.files:
            raise CheckpointNotFoundError(f"{where} has no file {n!r}")
    # Hashing in a thread of its own costs about twice the CPU of hashing in the reader, and is
    # free only on a core that is otherwise idle. With as many readers as cores, the largest
    # file is the one still being read when the others are done: its hash gets that thread
    # (and a core freed by the others' readers); the others are hashed by their readers. Each
    # core beyond the readers takes the hash of one more file, largest first.
    # Small checkpoints are read in this thread: starting threads costs more than they save
    # below a few MiB (a reader polling a root loads many small ones), except where each read
    # is a network round trip.
    total = sum(manifest.files[n].size for n in names)
    remote = storage.overlap_requests
    sequential = workers <= 1 or len(names) <= 1 or (total < _PARALLEL_MIN and not remote)
    readers = 1 if sequential else min(workers, len(names))
    cores = _cpus()
    by_size = sorted(names, key=lambda n: -manifest.files[n].size)
    pipelined = set(by_size[: cores - readers + 1]) if cores > 1 else set()
    at_once = 1 if sequential else min(max(workers, _REMOTE_READERS) if remote else workers, len(names))
    return names, at_once, pipelined


def verify_checkpoint_files(
    storage: Storage,
    manifest: Manifest,
    where: str,
    *,
    names: Iterable[str] | None = None,
    keep_bytes: bool = False,
    verify: bool = True,
    workers: int = 2,
    at: str = "",
) -> dict[str, Any]:
    """Read and check each named file (default: all). With ``keep_bytes`` returns each file's
    content for :func:`txckpt._save.serialization.read_object`: ``bytes``, or for safetensors and torch
    files on a local disk a ``torch.uint8`` tensor holding the file. ``at``: the checkpoint's key
    in ``storage`` ("" when ``storage`` is the checkpoint's own; ``where`` names it in messages)."""
    names, at_once, pipelined = _plan(storage, manifest, where, names, workers)
    out: dict[str, Any] = {}

    def one(n: str):
        return _read_one(storage, manifest, where, n, keep_bytes, verify, pipeline=n in pipelined, at=at)

    if at_once == 1:
        results = [one(n) for n in names]
    else:
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            results = list(pool.map(one, names))
    for name, data in results:
        if keep_bytes:
            out[name] = data
    return out


def load_checkpoint_files(
    storage: Storage,
    manifest: Manifest,
    where: str,
    *,
    names: Iterable[str] | None = None,
    decode: Decoder,
    early: Collection[str],
    verify: bool = True,
    workers: int = 2,
    mmap: bool = False,
    at: str = "",
) -> dict[str, tuple[bool, Any]]:
    """Read each named file (default: all) once and check it, decoding on the way: returns
    ``name -> (decoded?, value)``, ``value`` being ``decode(name, kind, content, where=...)`` for
    a file whose kind is in ``early`` (or the :class:`DecodeFailed` the decoder raised on it),
    else the checked content (as :func:`verify_checkpoint_files` gives).

    ``early``: the kinds whose decoder is safe on any bytes (safetensors; torch files with
    ``weights_only``): such a file is decoded while the last of its hash is still running, in
    its reader's thread while the other files are still being read. Nothing is returned before
    every hash matched: the first file that does not match raises IntegrityError naming it, and
    whatever was decoded is dropped. A file whose decoder is not safe on unchecked bytes (an
    unrestricted pickle) is only handed back once checked, never decoded here. ``mmap``: local
    safetensors and torch files are mapped, not read (:func:`read_file`). ``at``: as
    :func:`verify_checkpoint_files`'s."""
    names, at_once, pipelined = _plan(storage, manifest, where, names, workers)

    def one(n: str) -> tuple[str, bool, Any]:
        return _load_one(storage, manifest, where, n, verify, n in pipelined, decode, early, mmap, at)

    results: dict[str, tuple[bool, Any]] = {}
    errors: dict[str, BaseException] = {}
    if at_once == 1:
        for n in names:
            try:
                results[n] = one(n)[1:]
            except Exception as e:
                errors[n] = e
                break
    else:
        # Largest first: the file read longest starts first, and the others fill in beside it.
        order = sorted(names, key=lambda n: -manifest.files[n].size)
        with ThreadPoolExecutor(max_workers=at_once) as pool:
            futures = {n: pool.submit(one, n) for n in order}
        _collect(futures, results, errors)
        futures.clear()
    if errors:
        # The first failing file in name order (what a sequential read would have hit first).
        # Nothing decoded outlives the failed load: no frame of the error's traceback holds it.
        error = errors[min(errors)]
        results.clear()
        errors.clear()
        raise error
    return results


def _collect(futures: dict[str, Any], results: dict[str, tuple[bool, Any]], errors: dict[str, BaseException]) -> None:
    for n, f in futures.items():
        e = f.exception()
        if e is None:
            results[n] = f.result()[1:]
        else:
            errors[n] = e
