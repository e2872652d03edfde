"""Fetching a committed checkpoint: a verified copy of it (any root, e.g. S3) in a local
directory or another store (``fetch_checkpoint``, ``txckpt export``, the Trainer's cache of a
remote root). It reads through the one read path (:func:`txckpt._read.reader.read_checked`)."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Mapping

from .._base import fileio
from .._manifest import parts
from .._base.checksum import copy_hashing
from ..errors import IntegrityError, UnsafePathError
from .._base.fileio import SizeMismatch
from .._base.layout import is_url
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import Manifest
from .._base.progress import Timer
from .reader import Found, read_checked, read_manifest, verify_checkpoint
from .._storage import open_storage
from .._storage.base import Storage
from .._manifest.verify import FALLBACK_HINT

#: The block a fetch copies at a time.
_CHUNK = 8 << 20


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

    def attempt(found: Found) -> str:
        manifest = found.manifest
        timer.label = f"step {manifest.step}"
        timer.phase("manifest")
        manifest_bytes = found.manifest_bytes if with_manifest else None
        if url:
            _fetch_into(found, open_storage(dest, dest_storage_options), manifest_bytes, durable, progress)
            timer.phase("data", manifest.total_bytes)
        elif not _fetch_local(found, dest, manifest_bytes, durable, progress, timer):
            return dest  # the cached copy
        timer.done("fetched", manifest.total_bytes, len(manifest.files), dest)
        return dest

    return read_checked(path, storage_options, attempt)


def _fetch_local(
    found: Found,
    dest: str,
    manifest_bytes: bytes | None,
    durable: bool,
    progress: Callable[[int], Any] | None,
    timer: Timer,
) -> bool:
    """Copy into a scratch directory beside local ``dest`` and install it; False: ``dest``
    already held the same checkpoint, verified."""
    manifest = found.manifest
    if manifest_bytes is not None and os.path.exists(os.path.join(dest, MANIFEST_NAME)):
        try:
            with fileio.open_regular_file(os.path.join(dest, MANIFEST_NAME)) as f:
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
        return open(target, "w+b")  # read too: a fetch may hash the file it wrote (read_to_file)

    try:
        _copy_files(found, open_out, progress)
        if manifest_bytes is not None:
            with open(os.path.join(scratch, MANIFEST_NAME), "wb") as out:
                out.write(manifest_bytes)
        if durable:
            fileio.fsync_tree(scratch)
        timer.phase("data", manifest.total_bytes)
        _install_fetched(scratch, dest, manifest)
        if durable:
            fileio.fsync_dir(parent)
        timer.phase("install")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return True


def _fetch_into(
    found: Found, dest: Storage, manifest_bytes: bytes | None, durable: bool, progress: Callable[[int], Any] | None
) -> None:
    """Copy into storage ``dest`` (an object store has no rename to install with); what was
    written is removed again if the source turns out damaged."""
    manifest = found.manifest
    written: list[str] = []

    def open_out(name: str):
        out = dest.open_write(name, durable=durable)
        written.append(name)
        return out

    try:
        _copy_files(found, open_out, progress)
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
        names = list(manifest.files) + manifest.meta_files()
        for d in sorted({n.rsplit("/", 1)[0] for n in names if "/" in n}, key=len, reverse=True):
            dest.sync_dir(d)
        dest.sync_dir("")


def _copy_files(found: Found, open_out: Callable[[str], Any], progress: Callable[[int], Any] | None) -> None:
    """Copy each file of the checkpoint ``found`` to ``open_out(name)``, hashing on the way;
    IntegrityError (naming the file) on the first that is missing or does not match."""
    src, path = found.storage, found.path
    for name, entry in sorted(found.manifest.files.items()):
        if src.is_symlink_escape(found.file_key(name)):
            raise UnsafePathError(f"{path}/{name} is a symlink that leaves the root; refusing to read it")
        key = found.file_key(name)
        out = open_out(name)
        try:
            size, digest = _copy_one(src, key, entry.size, out, progress)
            out.close()
        except BaseException as e:
            abort = getattr(out, "abort", None)
            abort() if abort is not None else out.close()  # an upload left unfinished
            if isinstance(e, SizeMismatch):
                size, digest = e.actual, "(not read: wrong size)"
            elif isinstance(e, IsADirectoryError):
                # A directory where the manifest lists a file is damage (what verify calls it),
                # not an OSError for the caller to decode.
                raise IntegrityError(
                    f"{path}/{name} is a directory where the manifest lists a file of {entry.size} bytes: "
                    f"the stored checkpoint is damaged; {FALLBACK_HINT}",
                    path=f"{path}/{name}",
                ) from None
            elif isinstance(e, (FileNotFoundError, NotADirectoryError)) and not src.exists(key):
                raise IntegrityError(
                    f"{path}/{name} is missing (the manifest lists it): the stored checkpoint is "
                    f"damaged; {FALLBACK_HINT}",
                    path=f"{path}/{name}",
                ) from None
            else:
                raise
        if size != entry.size or digest != entry.checksum:
            raise IntegrityError(
                f"{path}/{name} has {size} bytes / xxh3-128 {digest}, the manifest says "
                f"{entry.size} / {entry.checksum}: the stored checkpoint is damaged; "
                f"{FALLBACK_HINT}",
                path=f"{path}/{name}",
            )
    _copy_parts(found, open_out)


def _copy_parts(found: Found, open_out: Callable[[str], Any]) -> None:
    """A /2 manifest's parts (protocol §3a), each checked against the Merkle root again as it
    is copied, and the tree rebuilt from them: the copy reads like the original."""
    info = found.manifest.parts
    if info is None:
        return
    leaves = []
    for rank in range(info.count):
        name = parts.part_name(rank)
        data = found.storage.read_bytes(found.file_key(name))
        leaves.append(parts.node_digest(data))
        out = open_out(name)
        out.write(data)
        out.close()
    tree = parts.build_tree(leaves)
    if parts.tree_root(tree).hex() != info.merkle_root:
        raise IntegrityError(
            f"{found.path}/{parts.PARTS_DIR} changed while it was copied (its parts no longer "
            f"match the manifest's Merkle root); {FALLBACK_HINT}",
            path=found.path,
        )
    out = open_out(parts.TREE_NAME)
    out.write(tree)
    out.close()


def _copy_one(src: Any, key: str, size: int, out: Any, progress: Callable[[int], Any] | None) -> tuple[int, str]:
    """Copy the file at ``key`` of ``src`` (``size`` bytes by its manifest) to ``out``, hashing:
    ``(size, xxh3-128)``. Through the storage's own fast read where it has one (S3: parallel
    ranged GETs, :meth:`Storage.read_to_file` written at their offsets into a local file,
    :meth:`Storage.read_through` into another store), else a stream of ``open_read``."""

    def write(chunk: memoryview) -> None:
        out.write(chunk)
        if progress is not None:
            progress(len(chunk))

    if isinstance(out, io.BufferedRandom):  # a new local file (a fetch to a local directory)
        copied = src.read_to_file(key, size, out.fileno(), progress)
        if copied is not None:
            return copied
    copied = src.read_through(key, size, write)
    if copied is not None:
        return copied
    with src.open_read(key) as reader:
        stream: Any = reader if progress is None else _Reporting(reader, progress)
        return copy_hashing(stream, out, chunk=_CHUNK)


class _Reporting:
    """A reader that tells ``progress`` the size of each block read (a progress bar)."""

    def __init__(self, reader: Any, progress: Callable[[int], Any]):
        self._reader, self._progress = reader, progress

    def read(self, n: int = -1) -> bytes:
        block = self._reader.read(n)
        self._progress(len(block))
        return block


def _install_fetched(scratch: str, dest: str, manifest: Manifest) -> None:
    """Rename a verified copy into place without ever deleting a copy another process may be
    reading: an empty directory at ``dest`` is replaced; if ``dest`` appeared meanwhile and holds
    the same verified checkpoint, keep it; if it holds something else, move it aside first."""
    for _ in range(8):
        try:
            fileio.rename_noreplace(scratch, dest)  # through the module: the crash tracer patches it there
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


__all__ = ["fetch_checkpoint"]
