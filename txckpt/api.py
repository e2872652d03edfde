"""The drop-in functional API. Each call opens the root through a per-process CheckpointRoot, so
the lineage a process resumed (or first saved to) is remembered across calls."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Mapping

from .errors import (
    CheckpointNotFoundError,
    IntegrityError,
    InvalidArgumentError,
    ManifestError,
    NotACheckpointError,
    RootNotFoundError,
    UnsafePathError,
)
from .asyncsave import wait_for_root
from .checksum import copy_hashing
from .coordination import SingleProcess, decide_on_rank0
from .fileio import open_regular_file
from .layout import LOG_DIR, is_url
from .manifest import MANIFEST_NAME, Manifest
from .naming import DEFAULT as DEFAULT_NAMING, read_naming
from .progress import Timer
from .reader import RootContext
from .retention import retired_error_at
# The per-process root cache is root.py's; open_root/forget_roots stay importable from here.
from .root import CheckpointRoot, forget_roots, open_root
from .serialization import read_object
from .storage import LocalStorage, local, open_storage
from .storage.base import Storage
from .verify import FALLBACK_HINT, load_checkpoint_files, verify_checkpoint_files

def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    files: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> str:
    """Save ``files`` as checkpoint ``step`` of the current lineage, all or nothing.

    ``files`` maps a file name to an object: ``bytes`` are written raw, ``.safetensors`` takes a
    dict of tensors, ``.json`` a JSON value, anything else goes through ``torch.save``. Returns
    the committed checkpoint's path. Raises StepConflictError if ``step`` is not newer than the
    lineage's newest checkpoint (call :func:`resume` with an older step first to roll back).
    Inside a torch.distributed group every rank calls it with its own files.
    """
    wait_for_root(root, storage_options)  # an async save of this root commits first
    return open_root(root, storage_options).save(step, files, metadata=metadata, timeout=timeout)


def transaction(
    root: str | os.PathLike,
    step: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    local_dir: str | os.PathLike | None = None,
):
    """A context manager for writers that need file handles or a directory; see
    :class:`txckpt.transactions.Transaction`. Commits on a clean exit, aborts on an exception.
    ``local_dir``: where a remote root's local scratch directory (``tx.directory``) goes."""
    wait_for_root(root, storage_options)  # an async save of this root commits first
    return open_root(root, storage_options).transaction(step, metadata=metadata, timeout=timeout,
                                                        local_dir=local_dir)


def get_last_checkpoint(root: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
                        missing_ok: bool = False) -> str | None:
    """Drop-in for ``transformers.trainer_utils.get_last_checkpoint``: the newest committed
    checkpoint of the current lineage, or None. Never a staging leftover, never an abandoned
    lineage's checkpoint.

    As transformers' does, it raises ``FileNotFoundError`` (:class:`RootNotFoundError`) for a
    root directory that does not exist (or a URL whose bucket does not exist), and returns the
    path in its form: ``os.path.join(root, "checkpoint-N")``, relative when ``root`` is.

    ``missing_ok=True`` (a script's first run and its restarts alike): None also for a root
    directory that does not exist yet, which the first save creates, as ``txckpt.resume(root)``
    answers there. A missing bucket (container) still raises: no save can create one."""
    wait_for_root(root, storage_options)  # the state an async save of this root is changing
    r = open_root(root, storage_options)
    try:
        key = r.last_checkpoint_key()
    except RootNotFoundError as e:
        if missing_ok and e.bucket is None:
            return None
        raise
    if key is None:
        return None
    given = os.fspath(root)
    if isinstance(r.storage, LocalStorage) and not given.startswith("file://"):
        return os.path.join(given, *key.split("/"))
    return r.storage.full_path(key)


def _on_rank0(fn, collective: bool | None, phase: str = "lineage change"):
    """Run a lineage change once per job: on rank 0, with the result broadcast to every rank.

    ``collective=None`` means "if a torch.distributed group is initialised, every rank calls
    this"; ``False`` means only this process calls it (e.g. a caller that already runs it on
    rank 0 alone and broadcasts the answer itself)."""
    return decide_on_rank0(fn, phase=phase, coordinator=SingleProcess() if collective is False else None)


def resume(
    root: str | os.PathLike,
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
    """
    wait_for_root(root, storage_options)  # an async save of this root commits first
    return _on_rank0(lambda: open_root(root, storage_options).resume(step, path=path, on_damaged=on_damaged),
                     collective)


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
    return _on_rank0(
        lambda: open_root(root, storage_options).new_lineage(external_parent=external_parent), collective
    )


def _read_own_manifest(storage: Storage, path: str | os.PathLike) -> tuple[Manifest, bytes]:
    """The manifest in ``storage`` (opened at the checkpoint ``path``), its own digest checked,
    and its bytes as stored (what a copy writes)."""
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError):
        if not storage.exists(""):
            raise CheckpointNotFoundError(f"no checkpoint at {os.fspath(path)}") from None
        if _is_a_root(storage):
            raise NotACheckpointError(
                f"{os.fspath(path)} is a checkpoint root (an output_dir), not a checkpoint: load its "
                f"newest checkpoint with load_checkpoint(get_last_checkpoint({os.fspath(path)!r})), or "
                "give one checkpoint directory (`txckpt ls ROOT` lists them)",
                path=os.fspath(path),
            ) from None
        raise ManifestError(
            f"{os.fspath(path)} has no {MANIFEST_NAME}: it is not a committed txckpt checkpoint "
            "(a staging leftover, or written by another tool; `txckpt adopt` records legacy ones)"
        ) from None
    return Manifest.decode(data, f"{os.fspath(path)}/{MANIFEST_NAME}"), data


def _is_a_root(storage: Storage) -> bool:
    """A txckpt root (it has a log) or a legacy output_dir (it has checkpoint-N directories)."""
    if storage.list_dir(LOG_DIR):
        return True
    naming = read_naming(storage) or DEFAULT_NAMING  # a root names its checkpoints its own way (§2)
    return any(naming.step_of(name) is not None for name in storage.list_subdirs(""))


def read_manifest(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the checkpoint at ``path``, with its own digest verified; and, when
    ``path`` lies in a txckpt root, checked against the digest the root's log committed (an
    edited, replaced or never-committed manifest raises IntegrityError / ManifestError)."""
    return _following_moves(path, storage_options, _checked_manifest)


def _following_moves(path: str | os.PathLike, storage_options: Mapping[str, Any] | None, attempt):
    """The one read path: resolve ``path`` to its root once (txckpt.reader), open one storage at
    the checkpoint, and run ``attempt(path, ctx, storage, seen)``, which reads the checkpoint
    from that storage (and records the manifest's txid in ``seen["txid"]`` once it has it). If it fails because the checkpoint moved since its path
    was looked up (published, or unpublished by a fork, while this process read), locate it
    again by its txid and run ``attempt`` where it is now: a healthy checkpoint is never called
    damaged because a rename raced the read (docs/protocol.md §6a). Each path is tried once."""
    path = os.fspath(path)
    ctx = RootContext.open(path, storage_options)
    tried = {path}
    while True:
        seen: dict[str, Any] = {}
        try:
            return attempt(path, ctx, open_storage(path, storage_options), seen)
        except (IntegrityError, ManifestError, CheckpointNotFoundError) as e:
            moved = ctx.moved_to(seen.get("txid")) if ctx is not None else None
            if moved is None or moved in tried:
                if ctx is not None and "txid" not in seen and isinstance(e, CheckpointNotFoundError):
                    # Nothing there: if retention retired what was, say so (not "no checkpoint").
                    raise retired_error_at(ctx.root, ctx.root.history(), ctx.where.key, path) or e
                raise
            tried.add(moved)
            path = moved
            ctx = RootContext.open(path, storage_options)


def _checked_manifest(path: str, ctx: RootContext | None, storage: Storage, seen: dict[str, Any]) -> Manifest:
    """The manifest at ``path`` (read from ``storage``), checked against the log when ``ctx``."""
    manifest, seen["manifest_bytes"] = _read_own_manifest(storage, path)
    seen["txid"] = manifest.txid
    if ctx is not None:
        ctx.check_committed(manifest, path)
    return manifest


def _read_checkpoint(
    path: str | os.PathLike,
    storage_options: Mapping[str, Any] | None,
    names: list[str] | None,
    keep_bytes: bool,
    verify: bool,
    timer: Timer | None = None,
    read: Callable[[Storage, Manifest, str, list[str]], Any] | None = None,
) -> tuple[Manifest, Any]:
    """Read (and verify) a checkpoint's manifest and files, following it if it moves.
    ``read(storage, manifest, path, names)``: what reads the files (default:
    :func:`verify_checkpoint_files`)."""

    def attempt(path: str, ctx: RootContext | None, storage: Storage, seen: dict[str, Any]):
        manifest = _checked_manifest(path, ctx, storage, seen)
        if timer is not None:
            timer.label = f"step {manifest.step}"
            timer.phase("manifest")
        wanted = sorted(manifest.files) if names is None else names
        unknown = [n for n in wanted if n not in manifest.files]
        if unknown:
            raise InvalidArgumentError(f"{path} has no file(s) {unknown}; it holds {sorted(manifest.files)}")
        if read is not None:
            return manifest, read(storage, manifest, path, wanted)
        blobs = verify_checkpoint_files(storage, manifest, path, names=wanted,
                                        keep_bytes=keep_bytes, verify=verify)
        return manifest, blobs

    return _following_moves(path, storage_options, attempt)


def verify_checkpoint(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Check every file's size and checksum (and, inside a root, the manifest against the log);
    raises IntegrityError (naming the file) on damage."""
    return _read_checkpoint(path, storage_options, None, keep_bytes=False, verify=True)[0]


def _resume_verify(root: CheckpointRoot):
    """The check a load makes, applied ahead of it by ``resume(on_damaged="fallback")``: every
    file's size and checksum, and the manifest against the log (:func:`verify_checkpoint`).
    Handed to the root (txckpt/fallback.py), which sits below this module."""

    def verify(path: str) -> str:
        verify_checkpoint(path, storage_options=root.storage_options or None)
        return path

    return verify


CheckpointRoot.default_verify = _resume_verify


def load_checkpoint(
    path: str | os.PathLike,
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
    (docs/troubleshooting.md, "Loading with `mmap=True`"). Elsewhere (object stores) files are read."""
    names = None if files is None else list(files)
    timer = Timer("load", os.fspath(path))
    base = os.fspath(path).rstrip("/")

    def decode(manifest: Manifest, name: str, content: Any) -> Any:
        return read_object(name, manifest.files[name].kind, content, map_location=map_location,
                           weights_only=weights_only, where=f"{base}/{name}")

    def early(kind: str) -> bool:
        # Decoders that are safe on bytes nobody checked yet: they start while the hash ends,
        # and nothing they produce is returned unless it matched. An unrestricted pickle
        # (weights_only=False) runs code: it is decoded only once its file is checked.
        return kind == "safetensors" or (kind == "torch" and weights_only)

    def decode_early(manifest: Manifest, name: str, content: Any) -> Any:
        try:
            return decode(manifest, name, content)
        except Exception as e:
            # Raised only once the file's hash matched (a damaged file is reported as damaged),
            # and after the read, as before: a file that does not decode is not a checkpoint
            # that moved while it was read (_following_moves looks for those).
            return _DecodeFailed(e)

    def read(storage: Storage, manifest: Manifest, checkpoint: str, wanted: list[str]) -> Any:
        return load_checkpoint_files(storage, manifest, checkpoint, names=wanted, verify=verify, early=early,
                                     decode=lambda n, content: decode_early(manifest, n, content), mmap=mmap)

    manifest, loaded = _read_checkpoint(path, storage_options, names, keep_bytes=True, verify=verify, timer=timer,
                                        read=read)
    wanted = sorted(manifest.files) if names is None else names
    nbytes = sum(manifest.files[n].size for n in wanted)
    # "data": reading, checking and, for the files decoded on the way, decoding; "decode": the
    # files decoded only once checked.
    timer.phase("data", nbytes)
    out = {}
    for n in wanted:
        decoded, value = loaded[n]
        if isinstance(value, _DecodeFailed):
            raise value.error
        out[n] = value if decoded else decode(manifest, n, value)
    timer.phase("decode")
    timer.done("loaded", nbytes, len(wanted), os.fspath(path))
    return out


class _DecodeFailed:
    """What decoding a checked file raised, carried out of the read to be raised after it."""

    def __init__(self, error: Exception):
        self.error = error


def fetch_checkpoint(
    path: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    dest_storage_options: Mapping[str, Any] | None = None,
    with_manifest: bool = True,
    durable: bool = False,
    progress: Callable[[int], Any] | None = None,
) -> str:
    """Copy a committed checkpoint (any root, e.g. S3) to ``dest`` and return it, verifying every
    file's size and checksum on the way.

    A local ``dest``: a ``dest`` that already holds the same manifest and verifies is reused, so a
    cache keyed by txid downloads each checkpoint once. Files land in a scratch directory beside
    it and are renamed into place only once verified (an empty directory at ``dest`` is
    replaced). An fsspec URL ``dest`` (``dest_storage_options``), new or empty: files are
    written into it directly, and on a damaged source the ones written are removed again.

    ``with_manifest``: also write the manifest (so the copy loads and verifies on its own);
    ``durable``: fsync what was written; ``progress``: called with each block's size."""
    given = os.fspath(dest)
    url = is_url(given)
    dest = given if url else os.path.abspath(given)
    timer = Timer("fetch", os.fspath(path))

    def attempt(path: str, ctx: RootContext | None, src: Any, seen: dict[str, Any]) -> str:
        manifest = _checked_manifest(path, ctx, src, seen)
        timer.label = f"step {manifest.step}"
        timer.phase("manifest")
        if url:
            _fetch_into(src, path, manifest, open_storage(dest, dest_storage_options),
                        seen["manifest_bytes"] if with_manifest else None, durable, progress)
            timer.phase("data", manifest.total_bytes)
        elif not _fetch_local(src, path, manifest, dest, seen["manifest_bytes"] if with_manifest else None,
                              durable, progress, timer):
            return dest  # the cached copy
        timer.done("fetched", manifest.total_bytes, len(manifest.files), dest)
        return dest

    return _following_moves(path, storage_options, attempt)


def _fetch_local(src: Any, path: str, manifest: Manifest, dest: str, manifest_bytes: bytes | None,
                 durable: bool, progress: Callable[[int], Any] | None, timer: Timer) -> bool:
    """Copy into a scratch directory beside local ``dest`` and install it; False: ``dest``
    already held the same checkpoint, verified."""
    if manifest_bytes is not None and os.path.exists(os.path.join(dest, MANIFEST_NAME)):
        try:
            with open_regular_file(os.path.join(dest, MANIFEST_NAME)) as f:
                cached = Manifest.decode(f.read())
            if cached.digest == manifest.digest:
                verify_checkpoint(dest)
                timer.phase("cached", manifest.total_bytes)
                timer.done("fetched (cached copy verified)", manifest.total_bytes, len(manifest.files), dest)
                return False
        except Exception:
            pass  # a damaged or different cache entry: fetch again
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".txckpt-fetch-", dir=parent)

    def open_out(name: str):
        target = os.path.join(scratch, *name.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return open(target, "wb")

    try:
        _copy_files(src, path, manifest, open_out, progress)
        if manifest_bytes is not None:
            with open(os.path.join(scratch, MANIFEST_NAME), "wb") as out:
                out.write(manifest_bytes)
        if durable:
            _fsync_tree(scratch)
        timer.phase("data", manifest.total_bytes)
        _install_fetched(scratch, dest, manifest)
        if durable:
            local.fsync_dir(parent)
        timer.phase("install")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return True


def _fetch_into(src: Any, path: str, manifest: Manifest, dest: Any, manifest_bytes: bytes | None,
                durable: bool, progress: Callable[[int], Any] | None) -> None:
    """Copy into storage ``dest`` (an object store has no rename to install with); what was
    written is removed again if the source turns out damaged."""
    written: list[str] = []

    def open_out(name: str):
        out = dest.open_write(name, durable=durable)
        written.append(name)
        return out

    try:
        _copy_files(src, path, manifest, open_out, progress)
    except BaseException:
        for name in written:
            try:
                dest.delete_file(name)
            except OSError:
                pass  # reported by the error being raised; the caller sees what is left
        raise
    if manifest_bytes is not None:
        dest.create_exclusive(MANIFEST_NAME, manifest_bytes, durable=durable)
    if durable:
        for d in sorted({n.rsplit("/", 1)[0] for n in manifest.files if "/" in n}, key=len, reverse=True):
            dest.sync_dir(d)
        dest.sync_dir("")


def _copy_files(src: Any, path: str, manifest: Manifest, open_out: Callable[[str], Any],
                progress: Callable[[int], Any] | None) -> None:
    """Copy each file of ``manifest`` from ``src`` to ``open_out(name)``, hashing on the way;
    IntegrityError (naming the file) on the first that is missing or does not match."""
    for name, entry in sorted(manifest.files.items()):
        if src.is_symlink_escape(name):
            raise UnsafePathError(f"{path}/{name} is a symlink that leaves the root; refusing to read it")
        try:
            reader = src.open_read(name)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise IntegrityError(
                f"{path}/{name} is missing (the manifest lists it): the stored checkpoint is "
                f"damaged; {FALLBACK_HINT}", path=f"{path}/{name}",
            ) from None
        with reader:
            out = open_out(name)
            try:
                size, digest = _copy_hashing(reader if progress is None else _Reporting(reader, progress), out)
                out.close()
            except BaseException:
                abort = getattr(out, "abort", None)
                abort() if abort is not None else out.close()  # an upload left unfinished
                raise
        if size != entry.size or digest != entry.checksum:
            raise IntegrityError(
                f"{path}/{name} has {size} bytes / xxh3-128 {digest}, the manifest says "
                f"{entry.size} / {entry.checksum}: the stored checkpoint is damaged; "
                f"{FALLBACK_HINT}", path=f"{path}/{name}",
            )


class _Reporting:
    """A reader that tells ``progress`` the size of each block read (a progress bar)."""

    def __init__(self, reader: Any, progress: Callable[[int], Any]):
        self._reader, self._progress = reader, progress

    def read(self, n: int = -1) -> bytes:
        block = self._reader.read(n)
        self._progress(len(block))
        return block


def _fsync_tree(top: str) -> None:
    for dirpath, _dirs, files in os.walk(top):
        for n in files:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        local.fsync_dir(dirpath)


def _install_fetched(scratch: str, dest: str, manifest: Manifest) -> None:
    """Rename a verified copy into place without ever deleting a copy another process may be
    reading: an empty directory at ``dest`` is replaced; if ``dest`` appeared meanwhile and holds
    the same verified checkpoint, keep it; if it holds something else, move it aside first."""
    for _ in range(8):
        try:
            local.rename_noreplace(scratch, dest)  # local's: the crash tests patch it there
            return
        except FileExistsError:
            pass
        try:
            os.rmdir(dest)  # an empty directory (an export's DEST made beforehand) holds no copy
            continue
        except OSError:
            pass
        try:
            same = read_manifest(dest).digest == manifest.digest
            if same:
                verify_checkpoint(dest)
        except Exception:
            same = False
        if same:
            shutil.rmtree(scratch, ignore_errors=True)
            return
        try:
            os.rename(dest, f"{dest}.stale-{uuid.uuid4().hex[:8]}")
        except FileNotFoundError:
            continue
    raise OSError(f"could not install the fetched checkpoint at {dest}: it keeps changing")


def _copy_hashing(reader, out) -> tuple[int, str]:
    # checksum's one hash-while-copy loop, under a name of the fetch path's own (a test counts
    # the bytes a fetch reads through it).
    return copy_hashing(reader, out, chunk=8 << 20)


#: open_root and forget_roots are root.py's (the per-process root cache); re-exported here.
__all__ = ["save_checkpoint", "transaction", "get_last_checkpoint", "resume", "new_lineage", "read_manifest",
           "verify_checkpoint", "load_checkpoint", "fetch_checkpoint", "open_root", "forget_roots"]
