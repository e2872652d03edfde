"""Local POSIX filesystems: fsync for durability, link() for create-if-absent, renameat2 for
publication. Never check-then-write."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import BinaryIO, Hashable, Iterator, Sequence

from ..._base.checksum import AbortOnError
from ...errors import TempFileRemovedError

# The low-level file operations live in fileio (below storage/). They are called through this
# module's names, so a test that patches ``txckpt._storage.local.store.rename_noreplace`` (the crash and
# power-loss tracers do) sees every rename LocalStorage makes.
from ..._base.fileio import (
    SYNC_FILE_RANGE_WRITE,
    fsync_dir,
    share_inode,
    makedirs_durable,
    open_regular,
    open_regular_file,
    rename_noreplace,
    sync_file_range,
)
from ..._base.layout import temp_name
from ..base import Storage, WriteBatch

__all__ = ["LocalStorage"]

#: Buffer of a data file. It only gathers small writes (pickle opcodes, zip and safetensors
#: headers, small tensors); larger writes bypass it. 1 MiB, not more: the
#: buffer is memory a streaming save holds on top of the state.
_WRITE_BUFFER = 1 << 20
#: Writes of at least this many bytes skip the buffer (after it is written out, for order).
_DIRECT_WRITE = 64 << 10


#: Start write-back every this many bytes. Small enough that a file of a few tens of MiB is
#: mostly on its way to the disk when close() fsyncs it (64 MiB saves, fsync on, 25 rounds:
#: ÷ raw write + fsync 1.53 with 32 MiB, 1.37 with 4 MiB); each call is one cheap syscall.
_WRITE_BEHIND = 4 << 20
#: Bytes one save (a :class:`_LocalWriteBatch`, or a file outside one) may leave in the page cache.
#: Past it, a durable file waits for the write-back of what lies ``_DROP_LAG`` behind its writer
#: and drops those pages (``POSIX_FADV_DONTNEED``), so the save's page-cache footprint stops
#: growing and the kernel recycles the same pages instead of finding new ones.
#:
#: Why so low: a page the cache has never held is the dear part of a buffered write wherever
#: memory is lent (a KVM guest whose balloon reports free pages to the host: each new page is
#: a fault the host serves). Measured here (2-core guest, durable saves of safetensors +
#: torch.save state, 1.2 GiB, five saves kept in a row): 7.2 / 8.3 / 7.0 / 2.4 / 2.4 s (6-7 s
#: of CPU, mostly page faults) without dropping, 1.0-1.4 s with this budget and lag (0.8-0.9 s
#: dropping from the first byte), O_DIRECT 0.7-0.8 s; 4 GiB 6.9 s vs 2.6 s. Where new pages are
#: cheap (memory just freed) dropping costs nothing measurable: 64 MiB 0.047 vs 0.048 s,
#: 256 MiB 0.166 vs 0.157 s, 1 GiB 0.77 vs 0.72 s (A/B, interleaved). An earlier 2 GiB budget
#: was tuned on rounds that each deleted the previous save, the cheap case only. So all but
#: ``_CACHE_BUDGET`` bytes of a large checkpoint leave the cache once durable: a load right
#: after a save reads most of it from the disk.
_CACHE_BUDGET = 128 << 20
#: How far behind the writer the pages it drops lie: the disk always has this much queued
#: (1 GiB A/B: 64 MiB 0.75 s, 128 MiB 0.75 s, 32 MiB 0.80 s).
_DROP_LAG = 128 << 20
#: sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER): the range is on the disk when it returns.
_SFR_WAIT_WRITE_WAIT = 1 | 2 | 4
_fadvise = getattr(os, "posix_fadvise", None)
#: Closed files of one :class:`_LocalWriteBatch` whose fsync is still to come: beyond this many,
#: a close() fsyncs the oldest (long written back by then), so open descriptors stay bounded.
_PENDING_FSYNCS = 16


class _DurableFile(AbortOnError):
    """A file whose close() fsyncs (when durable) before returning, or, for a file of a
    :class:`_LocalWriteBatch`, whose fsync the batch's wait() makes (:meth:`finish`).

    Writes smaller than ``_DIRECT_WRITE`` are gathered in a buffer of up to ``_WRITE_BUFFER``
    bytes; larger ones (tensor data) go to the file as they are, without a copy into a buffer
    first. With durability on it also starts write-back every 4 MiB (sync_file_range,
    asynchronous), so the disk writes while the serialiser runs and the final fsync waits only
    for the tail; and once its save has put ``_CACHE_BUDGET`` bytes into the page cache, it drops
    what is on the disk already (:meth:`_drop_behind`)."""

    def __init__(self, path: str, durable: bool, batch: "_LocalWriteBatch | None" = None):
        self._path = path
        self._durable = durable
        self._batch = batch
        self._f = open(path, "wb", buffering=0)
        self._buf = bytearray()
        self.closed = False
        self._written = 0
        self._flushed_to = 0
        self._dropped_to = 0
        self.cached = 0  # bytes of this file's own save in the page cache, when not in a batch

    def write(self, data) -> int:
        view = data if isinstance(data, (bytes, bytearray)) else memoryview(data).cast("B")
        n = len(view)
        self._save().cached += n
        if n < _DIRECT_WRITE:
            self._buf += view
            if len(self._buf) >= _WRITE_BUFFER:
                self._drain()
        else:
            self._drain()
            self._write_all(view)
        self._written += n
        if self._durable and sync_file_range is not None and self._written - self._flushed_to >= _WRITE_BEHIND:
            self._drain()
            # Queue write-back of what is written so far; never waits for the disk.
            sync_file_range(self._f.fileno(), self._flushed_to, self._written - self._flushed_to, SYNC_FILE_RANGE_WRITE)
            self._flushed_to = self._written
            self._drop_behind()
        return n

    def _save(self) -> "_DurableFile | _LocalWriteBatch":
        """What counts this save's bytes in the page cache: its batch, or the file itself."""
        return self._batch if self._batch is not None else self

    def _drop_behind(self) -> None:
        """Past the save's page-cache budget: wait until the range more than ``_DROP_LAG``
        behind the writer is on the disk, and drop it from the cache (its bytes were hashed
        as they were written; nothing reads them back)."""
        save = self._save()
        end = self._flushed_to - _DROP_LAG
        if save.cached <= _CACHE_BUDGET or end - self._dropped_to < _DROP_LAG or _fadvise is None:
            return
        fd = self._f.fileno()
        sync_file_range(fd, self._dropped_to, end - self._dropped_to, _SFR_WAIT_WRITE_WAIT)
        _fadvise(fd, self._dropped_to, end - self._dropped_to, os.POSIX_FADV_DONTNEED)
        save.cached -= end - self._dropped_to
        self._dropped_to = end

    def _drop_durable(self) -> None:
        """After the fsync: over the budget, the rest of the file leaves the cache too."""
        save = self._save()
        if save.cached > _CACHE_BUDGET and _fadvise is not None:
            try:
                _fadvise(self._f.fileno(), self._dropped_to, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                return  # only ever a hint
            save.cached -= self._written - self._dropped_to
            self._dropped_to = self._written

    def drop_written(self) -> None:
        """A closed file of a batch, ``_DROP_LAG`` behind the batch's writer: wait until what it
        wrote is on the disk and drop it from the cache. Its fsync still comes at the batch's
        wait(); a write-back error is raised here, naming the file (the wait consumes it, so
        the fsync would not see it again)."""
        start, end = self._dropped_to, self._written
        if end <= start or _fadvise is None or sync_file_range is None:
            return
        fd = self._f.fileno()
        try:
            sync_file_range(fd, start, end - start, _SFR_WAIT_WRITE_WAIT)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self._path) from e
        _fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        self._save().cached -= end - start
        self._dropped_to = end

    def _drain(self) -> None:
        if self._buf:
            self._write_all(self._buf)
            del self._buf[:]

    def _write_all(self, data) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += self._f.write(view[done:])

    def flush(self) -> None:
        self._drain()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if self.closed:
            return
        if self._durable and self._batch is not None:
            # In a batch the fsync waits for the batch's wait(): the disk writes this file's
            # tail while the caller serialises the next file, instead of the caller blocking
            # here (at 256 MiB the first of two files' fsync blocked 17 ms of a 145 ms save).
            try:
                self._drain()
                if sync_file_range is not None:
                    sync_file_range(self._f.fileno(), self._flushed_to, 0, SYNC_FILE_RANGE_WRITE)
            except BaseException:
                self._f.close()
                self.closed = True
                raise
            self.closed = True
            self._batch.defer(self)
            return
        try:
            self._drain()
            if self._durable:
                os.fsync(self._f.fileno())
                self._drop_durable()
        finally:
            self._f.close()
            self.closed = True

    def finish(self) -> None:
        """The deferred part of a batch file's close(): fsync, then close. An OSError names the
        file, whose partial content is removed (a failed file leaves nothing at its key)."""
        try:
            os.fsync(self._f.fileno())
        except OSError as e:
            self._f.close()
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            raise OSError(e.errno, e.strerror, self._path) from e
        self._drop_durable()
        self._f.close()

    def discard(self) -> None:
        """Close a deferred file without its fsync (the batch was cancelled)."""
        self._f.close()

    def abort(self) -> None:
        if not self.closed:
            self._f.close()
            self.closed = True
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


class _LocalWriteBatch(WriteBatch):
    """A transaction's staging files whose fsyncs wait for :meth:`wait` (the WriteBatch contract
    allows a file to complete after its close()): each file's write-back is started when it is
    closed and the disk writes it while the next file is serialised; wait() then fsyncs them
    all, in order, before the caller checks the staging or writes the manifest."""

    def __init__(self, storage: "LocalStorage"):
        super().__init__(storage)
        self._local = storage
        self._pending: list[_DurableFile] = []
        self.cached = 0  # bytes its files put in the page cache and did not drop (_CACHE_BUDGET)
        self._closed_bytes = 0  # bytes of every file closed so far: where the writer stands
        self._closed_at: dict[int, int] = {}  # id(pending file) -> _closed_bytes at its close

    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        # Through the storage's own open_write (a subclass may override it); only txckpt's own
        # file type defers its fsync, anything else completes at its close().
        f = self._local.open_write(key, durable=durable)
        if isinstance(f, _DurableFile):
            f._batch = self
        return f

    def defer(self, f: _DurableFile) -> None:
        self._pending.append(f)
        self._closed_bytes += f._written
        self._closed_at[id(f)] = self._closed_bytes
        self._drop_behind_files()
        if len(self._pending) > _PENDING_FSYNCS:
            done = self._pending.pop(0)
            self._closed_at.pop(id(done), None)
            done.finish()

    def _drop_behind_files(self) -> None:
        """Past the budget, drop whole closed files that lie ``_DROP_LAG`` behind the writer.
        A file smaller than the lag never drops anything of itself while it is written, so a
        save of many such files (an incremental DCP save: one file per tensor) would otherwise
        keep every byte in the cache until the batch's fsyncs: 1 GiB in 64 MiB files saved 3x
        slower than in one file on this guest, where each new page is a fault the host serves."""
        for g in self._pending:  # oldest first: the later ones are nearer the writer
            if self.cached <= _CACHE_BUDGET or self._closed_bytes - self._closed_at[id(g)] < _DROP_LAG:
                return
            g.drop_written()

    def wait(self) -> None:
        first: OSError | None = None
        pending, self._pending = self._pending, []
        self._closed_at.clear()
        for f in pending:  # every file finishes (or fails) before the first failure is raised
            try:
                f.finish()
            except OSError as e:
                first = first or e
        if first is not None:
            raise first

    def cancel(self) -> None:
        pending, self._pending = self._pending, []
        self._closed_at.clear()
        for f in pending:
            f.discard()


class LocalStorage(Storage):
    atomic_dir_rename = True
    maps_errors = False  # its errors are the file system's OSErrors: nothing to translate

    def __init__(self, root: str):
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root)
        self.root = root

    def _p(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def full_path(self, key: str) -> str:
        return self._p(key)

    def local_path(self, key: str) -> str:
        return self._p(key)

    def space_reserve_path(self, key: str) -> str:
        return self._p(key)  # a local disk fills up: the reserve holds real blocks on it

    def key_of(self, path: str) -> str | None:
        path = os.path.abspath(os.path.expanduser(path))
        if path == self.root:
            return ""
        if path.startswith(self.root + os.sep):
            return path[len(self.root) + 1 :].replace(os.sep, "/")
        return None

    # ----- writing -----------------------------------------------------------------------------
    def open_write(self, key: str, *, durable: bool) -> BinaryIO:
        path = self._p(key)
        _ensure_dir(os.path.dirname(path), durable)
        return _DurableFile(path, durable)  # type: ignore[return-value]

    def write_batch(self) -> WriteBatch:
        return _LocalWriteBatch(self)

    def share_file(self, src: str, dst: str, *, replace: bool = False) -> bool:
        source, path = self._p(src), self._p(dst)
        if not stat.S_ISREG(os.lstat(source).st_mode):
            return False  # only a regular file's inode is shared; the caller copies and checks the rest
        _ensure_dir(os.path.dirname(path), True)
        # replace: the share is made under a temp name and renamed over the written file, so
        # ``dst`` is never missing and a failed share leaves it as it was.
        target = (
            os.path.join(os.path.dirname(path), temp_name(os.path.basename(path), hidden=True)) if replace else path
        )
        # A clone first; a read-only hard link where the file system cannot clone.
        if not share_inode(source, target):
            return False
        if replace:
            try:
                os.replace(target, path)
            except BaseException:
                os.unlink(target)
                raise
        return True

    def file_identity(self, key: str) -> tuple[int, int, int, int, int]:
        st = os.lstat(self._p(key))
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def identity_after_share(self, key: str, before: Hashable) -> Hashable | None:
        # A hard link and the chmod to read-only move the inode's ctime, nothing else; a write
        # moves mtime as well (one that sets mtime back in the instant between the share and
        # this stat is the one change this cannot see).
        now = self.file_identity(key)
        return now if isinstance(before, tuple) and now[:4] == before[:4] else None

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None:
        path = self._p(key)
        directory = os.path.dirname(path)
        _ensure_dir(directory, durable)
        tmp = os.path.join(directory, temp_name(os.path.basename(path), hidden=True))
        # The content is complete and durable under a private name before it gets its public
        # name through link(2), which fails with EEXIST if the name is taken: no reader ever
        # sees a partial file, and of two racers exactly one links.
        _write_tmp(tmp, data, durable)
        try:
            try:
                os.link(tmp, path)
            except FileNotFoundError:
                _raise_if_tmp_removed(tmp, path)
                raise
            except OSError as e:
                if e.errno == errno.EEXIST:
                    raise FileExistsError(errno.EEXIST, "already exists", path) from None
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                rename_noreplace(tmp, path)  # filesystems without hard links
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if durable:
            fsync_dir(directory)

    def replace(self, key: str, data: bytes, *, durable: bool = False) -> None:
        path = self._p(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path), hidden=False))
        _write_tmp(tmp, data, durable)
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            _raise_if_tmp_removed(tmp, path)
            raise
        if durable:
            fsync_dir(os.path.dirname(path))

    def sync_dir(self, key: str) -> None:
        path = self._p(key)
        if os.path.isdir(path):
            fsync_dir(path)

    # ----- reading -----------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        with open_regular_file(self._p(key)) as f:
            return f.read()

    def open_read(self, key: str) -> BinaryIO:
        return open_regular_file(self._p(key), _WRITE_BUFFER)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        # pread: open_read's 1 MiB buffer would read that much per 16-byte proof node.
        fd = open_regular(self._p(key))
        try:
            return [os.pread(fd, length, offset) for offset, length in ranges]
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return os.path.lexists(self._p(key))

    def missing_root(self) -> str | None:
        return None if os.path.isdir(self.root) else self.root

    def list_dir(self, key: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(key)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_subdirs(self, key: str) -> list[str]:
        # is_dir() follows symlinks, as os.path.isdir in transformers' get_last_checkpoint does.
        try:
            with os.scandir(self._p(key)) as entries:
                return sorted(e.name for e in entries if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk_files(self, key: str) -> Iterator[tuple[str, int]]:
        # Listed whole, then returned: one call for the caller rather than one per file (the
        # listing is a few stats; nothing is gained by interleaving them with the caller's work).
        out = []
        base = self._p(key)
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            rel_dir = os.path.relpath(dirpath, base)
            names = list(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            for name in sorted(names):
                full = os.path.join(dirpath, name)
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                try:
                    size = os.stat(full).st_size
                except FileNotFoundError:
                    size = -1  # a dangling symlink: reported, and refused by the manifest check
                out.append((rel.replace(os.sep, "/"), size))
        return iter(out)

    def file_links(self, key: str) -> Iterator[tuple[Hashable, int, int]]:
        # (st_dev, st_ino) is the file: its hard links (an incremental save's shared files)
        # report one identity and st_nlink names. lstat: a symlink is a file of its own.
        base = self._p(key)
        for rel, _ in self.walk_files(key):
            try:
                st = os.lstat(os.path.join(base, *rel.split("/")))
            except FileNotFoundError:  # removed since the listing: nothing of it to free
                continue
            yield (st.st_dev, st.st_ino), st.st_size, st.st_nlink

    def is_symlink_escape(self, key: str) -> bool:
        return self._escapes(self._p(key))

    def _escapes(self, path: str) -> bool:
        real = os.path.realpath(path)
        root_real = os.path.realpath(self.root)
        # Any symlink on the way is refused when it leaves the root; inside is tolerated.
        return not (real == root_real or real.startswith(root_real + os.sep))

    def read_location(self, key: str) -> tuple[bool, str | None]:
        path = self._p(key)
        return self._escapes(path), path

    def modified_time(self, key: str) -> float | None:
        try:
            return os.lstat(self._p(key)).st_mtime
        except FileNotFoundError:
            return None

    # ----- removing ----------------------------------------------------------------------------
    def delete_file(self, key: str) -> None:
        try:
            os.unlink(self._p(key))
        except FileNotFoundError:
            pass

    def delete_tree(self, key: str) -> None:
        path = self._p(key)
        if os.path.islink(path) or os.path.isfile(path):
            self.delete_file(key)
            return
        shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)

    def rename_noreplace(self, src: str, dst: str) -> None:
        _ensure_dir(os.path.dirname(self._p(dst)), True)
        rename_noreplace(self._p(src), self._p(dst))


def _ensure_dir(path: str, durable: bool) -> None:
    """``fileio.makedirs_durable`` for a directory that is usually there already (the log, a
    staging directory): one stat, and no call further down when it exists."""
    if not os.path.isdir(path):
        makedirs_durable(path, durable)


def _write_tmp(tmp: str, data: bytes, durable: bool) -> None:
    """Write a create-if-absent's or replace's private temp file; on failure (a full disk) it is
    removed again, so a failed write leaves no empty temp file behind."""
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _raise_if_tmp_removed(tmp: str, path: str) -> None:
    """After a link/rename of ``tmp`` failed with ENOENT: a typed error if the temp file itself
    was deleted meanwhile (its directory is still there)."""
    if not os.path.lexists(tmp) and os.path.isdir(os.path.dirname(path)):
        raise TempFileRemovedError(path=tmp, target=path) from None


def _ignore_missing(func, path, exc_info):
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
