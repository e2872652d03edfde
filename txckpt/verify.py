"""Checking stored bytes against a manifest."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from . import checksum
from .errors import CheckpointNotFoundError, IntegrityError, UnsafePathError
from .manifest import Manifest
from .storage.base import Storage


def _read_one(storage: Storage, manifest: Manifest, where: str, name: str, keep: bool, verify: bool):
    entry = manifest.files[name]
    if storage.is_symlink_escape(name):
        raise UnsafePathError(f"{where}/{name} is a symlink that leaves the root; refusing to read it")
    try:
        data = storage.read_bytes(name)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise IntegrityError(
            f"{where}/{name} is missing (the manifest lists it): the checkpoint is damaged; "
            "resume from another checkpoint (`txckpt ls`)"
        ) from None
    if len(data) != entry.size:
        raise IntegrityError(
            f"{where}/{name} has {len(data)} bytes, the manifest says {entry.size} (truncated or "
            "rewritten): the checkpoint is damaged; resume from another checkpoint"
        )
    if verify and checksum.digest_bytes(data) != entry.checksum:
        raise IntegrityError(
            f"{where}/{name} does not match its checksum (xxh3-128): its bytes changed after the "
            "commit; the checkpoint is damaged; resume from another checkpoint"
        )
    return name, (data if keep else None)


def verify_checkpoint_files(
    storage: Storage,
    manifest: Manifest,
    where: str,
    *,
    names: Iterable[str] | None = None,
    keep_bytes: bool = False,
    verify: bool = True,
    workers: int = 2,
) -> dict[str, bytes]:
    """Read and check each named file (default: all); returns their bytes when ``keep_bytes``."""
    names = sorted(manifest.files) if names is None else list(names)
    for n in names:
        if n not in manifest.files:
            raise CheckpointNotFoundError(f"{where} has no file {n!r}")
    out: dict[str, bytes] = {}
    if workers <= 1 or len(names) <= 1:
        results = [_read_one(storage, manifest, where, n, keep_bytes, verify) for n in names]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda n: _read_one(storage, manifest, where, n, keep_bytes, verify), names))
    for name, data in results:
        if keep_bytes:
            out[name] = data  # type: ignore[assignment]
    return out
