"""Choose a storage backend for a root path or URL."""

from __future__ import annotations

import os
from typing import Any, Mapping

from .._base import deps
from ..errors import MissingDependencyError
from .._base.layout import is_local_path
from .base import Storage
from .fsspec.store import FsspecStorage
from .local.store import LocalStorage
from .fsspec import memory  # noqa: F401  (registers MemoryStorage with FsspecStorage)
from .s3 import store as s3_store  # noqa: F401  (registers S3Storage with FsspecStorage)

__all__ = ["open_storage", "missing_dependency"]


def open_storage(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """A Storage for ``root``: a local path, ``file://`` URL, or any fsspec URL (chained too)."""
    root = os.fspath(root)
    if is_local_path(root):
        if root.startswith("file://"):
            root = root[len("file://") :]
        return LocalStorage(root)
    try:
        fs, path = deps.fsspec.core.url_to_fs(root, **dict(storage_options or {}))
    except ImportError as e:
        raise missing_dependency(root, e) from e
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return LocalStorage(path)
    return FsspecStorage(root, fs, path)  # S3Storage / MemoryStorage where one handles ``fs``


#: fsspec protocol -> (the package that implements it, the txckpt extra that installs it).
BACKEND_EXTRAS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}


def missing_dependency(root: str, error: ImportError) -> MissingDependencyError:
    """The typed error for fsspec's ImportError while opening ``root``: which protocol of the
    URL (of each part of a chained one) could not load its filesystem, and what installs it."""
    fsspec = deps.fsspec
    protocol = None
    for part in root.split("::"):
        p = part.split("://", 1)[0] if "://" in part else part
        try:
            fsspec.get_filesystem_class(p)
        except ImportError:
            protocol = p
            break
        except ValueError:  # not a protocol (a chained URL's options part): not the cause
            continue
    cause = error.__cause__ if isinstance(error.__cause__, ImportError) else error
    why = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}".rstrip(": ")
    package, extra = BACKEND_EXTRAS.get(protocol or "", (None, None))
    if extra is not None:
        message = (
            f"{root} needs {package}, which cannot be imported ({why}): "
            f"pip install 'txckpt[{extra}]' (or pip install {package})"
        )
    else:
        message = f"{root}: fsspec cannot load the filesystem of {protocol or 'this URL'}: {error}"
        if cause is not error:
            message += f" ({why})"
    return MissingDependencyError(message, root=root, protocol=protocol, package=package, extra=extra)
