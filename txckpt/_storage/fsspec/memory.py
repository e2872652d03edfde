"""fsspec ``memory://``, made to behave like an object store: a file appears whole at
``close()``, and create-if-absent is atomic between threads (in-process only)."""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from ..._base import deps
from ..._base.checksum import AbortOnError
from .store import FsspecStorage


class MemoryStorage(FsspecStorage):
    """fsspec's in-process memory filesystem, made to behave like an object store.

    ``MemoryFileSystem.open("wb")`` publishes an empty file at open and fills it in place, and its
    ``"xb"`` is check-then-set: neither is what the contract asks. Here a file is published whole
    by one dict assignment at ``close()``, and create-if-absent is one ``dict.setdefault`` (atomic
    under the GIL), so of several threads exactly one wins. In-process only, by nature.
    """

    overlap_requests = False  # no round trips to hide

    @classmethod
    def handles(cls, fs: Any) -> bool:
        try:
            memory = deps.fsspec_memory
        except ImportError:  # pragma: no cover
            return False
        return isinstance(fs, memory.MemoryFileSystem)

    def missing_root(self) -> str | None:
        return None  # memory:// has no buckets: every path can be written

    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        return _MemoryWriter(self.fs, self._p(key))  # type: ignore[return-value]

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        path = self.fs._strip_protocol(self._p(key))
        f = deps.fsspec_memory.MemoryFile(self.fs, path, bytes(data))
        if self.fs.store.setdefault(path, f) is not f:
            raise FileExistsError(17, "already exists", self.full_path(key))

    def replace(self, key: str, data: bytes, *, durable: bool = False) -> None:
        self.fs.pipe_file(self._p(key), bytes(data))


class _MemoryWriter(AbortOnError, io.RawIOBase):
    def __init__(self, fs: Any, path: str):
        super().__init__()
        self._fs = fs
        self._path = path
        self._buf = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.closed:
            raise ValueError("write to a closed file")
        return self._buf.write(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._fs.pipe_file(self._path, self._buf.getvalue())
            finally:
                self._buf = io.BytesIO()
                super().close()

    def abort(self) -> None:
        self._buf = io.BytesIO()
        super().close()

    def __del__(self):  # an abandoned writer publishes nothing (IOBase.__del__ would close())
        if not self.closed:
            self.abort()
