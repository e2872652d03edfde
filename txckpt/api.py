"""The drop-in functional API. Each call opens the root through a per-process CheckpointRoot, so
the lineage a process resumed (or first saved to) is remembered across calls."""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping

from .errors import (
    CheckpointNotFoundError,
    IntegrityError,
    InvalidArgumentError,
    ManifestError,
    NotACheckpointError,
)
from .fileio import open_regular_file
from .manifest import MANIFEST_NAME, Manifest
from .progress import Timer
from .reader import RootContext
from .root import CheckpointRoot
from .serialization import read_object
from .storage import LocalStorage, open_storage
from .verify import FALLBACK_HINT, verify_checkpoint_files

_roots: dict[tuple[Any, ...], CheckpointRoot] = {}
_lock = threading.Lock()


def open_root(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> CheckpointRoot:
    """The process's CheckpointRoot for ``root`` (created on first use)."""
    key = (os.getpid(), os.fspath(root) if "://" in os.fspath(root) else os.path.abspath(os.fspath(root)),
           repr(sorted((storage_options or {}).items())))
    with _lock:
        r = _roots.get(key)
        if r is None:
            r = _roots[key] = CheckpointRoot(root, storage_options)
        return r


def forget_roots() -> None:
    """Drop what this process remembers about every root (as a fresh process would start)."""
    with _lock:
        _roots.clear()


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
    return open_root(root, storage_options).transaction(step, metadata=metadata, timeout=timeout,
                                                        local_dir=local_dir)


def get_last_checkpoint(root: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Drop-in for ``transformers.trainer_utils.get_last_checkpoint``: the newest committed
    checkpoint of the current lineage, or None. Never a staging leftover, never an abandoned
    lineage's checkpoint.

    As transformers' does, it raises ``FileNotFoundError`` (:class:`RootNotFoundError`) for a
    root directory that does not exist (or a URL whose bucket does not exist), and returns the
    path in its form: ``os.path.join(root, "checkpoint-N")``, relative when ``root`` is."""
    r = open_root(root, storage_options)
    key = r.last_checkpoint_key()
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
    from .coordination import SingleProcess, decide_on_rank0

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
    return _on_rank0(
        lambda: open_root(root, storage_options).new_lineage(external_parent=external_parent), collective
    )


def _read_own_manifest(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> Manifest:
    storage = open_storage(path, storage_options)
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
    return Manifest.decode(data, f"{os.fspath(path)}/{MANIFEST_NAME}")


def _is_a_root(storage: Any) -> bool:
    """A txckpt root (it has a log) or a legacy output_dir (it has checkpoint-N directories)."""
    if storage.list_dir(".txckpt/log"):
        return True
    from .naming import DEFAULT, read_naming

    naming = read_naming(storage) or DEFAULT  # a root names its checkpoints its own way (§2)
    return any(naming.step_of(name) is not None for name in storage.list_dir(""))


def read_manifest(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the checkpoint at ``path``, with its own digest verified; and, when
    ``path`` lies in a txckpt root, checked against the digest the root's log committed (an
    edited, replaced or never-committed manifest raises IntegrityError / ManifestError)."""
    return _following_moves(
        path, storage_options, lambda p, ctx, seen: _checked_manifest(p, ctx, seen, storage_options)
    )


def _following_moves(path: str | os.PathLike, storage_options: Mapping[str, Any] | None, attempt):
    """Run ``attempt(path, ctx, seen)``, which reads a checkpoint (and records the manifest's txid
    in ``seen["txid"]`` once it has it). If it fails because the checkpoint moved since its path
    was looked up (published, or unpublished by a fork, while this process read), locate it
    again by its txid and run ``attempt`` where it is now: a healthy checkpoint is never called
    damaged because a rename raced the read (docs/protocol.md §6a). Each path is tried once."""
    path = os.fspath(path)
    ctx = RootContext.open(path, storage_options)
    tried = {path}
    while True:
        seen: dict[str, Any] = {}
        try:
            return attempt(path, ctx, seen)
        except (IntegrityError, ManifestError, CheckpointNotFoundError):
            moved = ctx.moved_to(seen.get("txid")) if ctx is not None else None
            if moved is None or moved in tried:
                raise
            tried.add(moved)
            path = moved
            ctx = RootContext.open(path, storage_options)


def _checked_manifest(path: str, ctx: RootContext | None, seen: dict[str, Any],
                      storage_options: Mapping[str, Any] | None) -> Manifest:
    manifest = _read_own_manifest(path, storage_options)
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
) -> tuple[Manifest, dict[str, bytes]]:
    """Read (and verify) a checkpoint's manifest and files, following it if it moves."""

    def attempt(path: str, ctx: RootContext | None, seen: dict[str, Any]):
        manifest = _checked_manifest(path, ctx, seen, storage_options)
        if timer is not None:
            timer.label = f"step {manifest.step}"
            timer.phase("manifest")
        wanted = sorted(manifest.files) if names is None else names
        unknown = [n for n in wanted if n not in manifest.files]
        if unknown:
            raise InvalidArgumentError(f"{path} has no file(s) {unknown}; it holds {sorted(manifest.files)}")
        blobs = verify_checkpoint_files(open_storage(path, storage_options), manifest, path, names=wanted,
                                        keep_bytes=keep_bytes, verify=verify)
        return manifest, blobs

    return _following_moves(path, storage_options, attempt)


def verify_checkpoint(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Check every file's size and checksum (and, inside a root, the manifest against the log);
    raises IntegrityError (naming the file) on damage."""
    return _read_checkpoint(path, storage_options, None, keep_bytes=False, verify=True)[0]


def load_checkpoint(
    path: str | os.PathLike,
    *,
    files: list[str] | None = None,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
    weights_only: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a committed checkpoint's files (all, or the names in ``files``) after verifying
    each one's size and checksum against the manifest (and, inside a root, the manifest against
    the log's commit entry). torch files load with ``weights_only=True`` unless told otherwise."""
    names = None if files is None else list(files)
    timer = Timer("load", os.fspath(path))
    manifest, blobs = _read_checkpoint(path, storage_options, names, keep_bytes=True, verify=verify, timer=timer)
    wanted = sorted(manifest.files) if names is None else names
    nbytes = sum(manifest.files[n].size for n in wanted)
    timer.phase("data", nbytes)
    out = {
        n: read_object(n, manifest.files[n].kind, blobs[n], map_location=map_location, weights_only=weights_only,
                       where=f"{os.fspath(path).rstrip('/')}/{n}")
        for n in wanted
    }
    timer.phase("decode")
    timer.done("loaded", nbytes, len(wanted), os.fspath(path))
    return out


def fetch_checkpoint(
    path: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Copy a committed checkpoint (any root, e.g. S3) into local directory ``dest`` and return
    it, verifying every file's size and checksum on the way. A ``dest`` that already holds the
    same manifest and verifies is reused, so a cache keyed by txid downloads each checkpoint once.
    Files land under temporary names and are renamed into place only once verified."""
    import shutil
    import tempfile

    dest = os.path.abspath(os.fspath(dest))
    timer = Timer("fetch", os.fspath(path))

    def attempt(path: str, ctx: RootContext | None, seen: dict[str, Any]) -> str:
        manifest = _checked_manifest(path, ctx, seen, storage_options)
        timer.label = f"step {manifest.step}"
        timer.phase("manifest")
        if os.path.exists(os.path.join(dest, MANIFEST_NAME)):
            try:
                with open_regular_file(os.path.join(dest, MANIFEST_NAME)) as f:
                    cached = Manifest.decode(f.read())
                if cached.digest == manifest.digest:
                    verify_checkpoint(dest)
                    timer.phase("cached", manifest.total_bytes)
                    timer.done("fetched (cached copy verified)", manifest.total_bytes, len(manifest.files), dest)
                    return dest
            except Exception:
                pass  # a damaged or different cache entry: fetch again
        src = open_storage(path, storage_options)
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".txckpt-fetch-", dir=parent)
        try:
            for name, entry in sorted(manifest.files.items()):
                target = os.path.join(scratch, *name.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                try:
                    with src.open_read(name) as reader, open(target, "wb") as out:
                        size, digest = _copy_hashing(reader, out)
                except FileNotFoundError:
                    raise IntegrityError(
                        f"{path}/{name} is missing (the manifest lists it): the stored checkpoint is "
                        f"damaged; {FALLBACK_HINT}", path=f"{path}/{name}",
                    ) from None
                if size != entry.size or digest != entry.checksum:
                    raise IntegrityError(
                        f"{path}/{name} has {size} bytes / xxh3-128 {digest}, the manifest says "
                        f"{entry.size} / {entry.checksum}: the stored checkpoint is damaged; "
                        f"{FALLBACK_HINT}", path=f"{path}/{name}",
                    )
            with open(os.path.join(scratch, MANIFEST_NAME), "wb") as out:
                out.write(manifest.encode())
            timer.phase("data", manifest.total_bytes)
            _install_fetched(scratch, dest, manifest)
            timer.phase("install")
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        timer.done("fetched", manifest.total_bytes, len(manifest.files), dest)
        return dest

    return _following_moves(path, storage_options, attempt)


def _install_fetched(scratch: str, dest: str, manifest: Manifest) -> None:
    """Rename a verified copy into place without ever deleting a copy another process may be
    reading: if ``dest`` appeared meanwhile and holds the same verified checkpoint, keep it; if it
    holds something else, move it aside first."""
    import shutil
    import uuid

    from .storage.local import rename_noreplace

    for _ in range(8):
        try:
            rename_noreplace(scratch, dest)
            return
        except FileExistsError:
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
    from .checksum import new_hasher

    hasher = new_hasher()
    size = 0
    while True:
        block = reader.read(8 << 20)
        if not block:
            break
        hasher.update(block)
        out.write(block)
        size += len(block)
    return size, hasher.hexdigest()
