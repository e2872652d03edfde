"""Choose a storage backend for a root path or URL."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..layout import is_local_path
from .base import Storage, WriteBatch, check_relative_key, join
from .fsspec import FsspecStorage
from .local import LocalStorage
from .memory import MemoryStorage
from .s3 import S3Storage

__all__ = ["Storage", "WriteBatch", "LocalStorage", "FsspecStorage", "MemoryStorage", "S3Storage", "open_storage",
           "check_relative_key", "join"]


def open_storage(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """A Storage for ``root``: a local path, ``file://`` URL, or any fsspec URL (chained too)."""
    root = os.fspath(root)
    if is_local_path(root):
        if root.startswith("file://"):
            root = root[len("file://"):]
        return LocalStorage(root)
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **dict(storage_options or {}))
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return LocalStorage(path)
    return FsspecStorage(root, fs, path)  # S3Storage / MemoryStorage where one handles ``fs``
