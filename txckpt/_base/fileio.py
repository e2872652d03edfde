"""Reading and hashing local files without extra copies.

* :func:`read_into_buffer` reads a whole file into one preallocated, uninitialised buffer (a
  ``torch.uint8`` tensor, so that decoded tensors can be views of it) with ``readinto``; with
  ``hash=True`` a second thread hashes each chunk behind the reader (xxhash releases the GIL), so
  a verified read costs the same reads plus a hash that runs on another core when one is free.
  :func:`start_read_into_buffer` returns as soon as the last byte is in the buffer, with the
  hash of the last chunks possibly still running, so that a safe decoder can start meanwhile
  (txckpt._manifest.verify checks the digest before anything decoded is returned).
* :func:`hash_file` hashes a file through one small reused buffer (the chunk is still in the CPU
  cache when it is hashed) and, optionally, fsyncs it: a commit's pass over the files that other
  code wrote into a staging directory. It starts the file's write-back first, so the disk
  writes while the file is hashed and the final fsync waits for less.

Only regular files (:func:`open_regular`, the opener every local read shares): a FIFO, socket or
device raises :class:`~txckpt.errors.SpecialFileError` without blocking; a directory or a missing
file raises the usual OSError subclasses.

It also holds the low-level local file operations that :mod:`txckpt._storage.local.store` (and the
local-only code paths above it) build on: :func:`makedirs_durable`, :func:`fsync_dir`,
:func:`rename_noreplace` (renameat2), :data:`sync_file_range`, :func:`lies_within`. They sit here,
below storage/, so that storage.local imports this module and never the reverse.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import mmap
import os
import queue
import stat
import threading
from typing import Any, Callable, Iterator

from . import deps
from .checksum import new_hasher, usable_cores
from ..errors import SpecialFileError

#: readinto chunk of :func:`read_into_buffer` when the reader does not hash, or hands the hash
#: to another thread: large enough that the per-chunk cost (one syscall, one hand-over) is
#: nothing; small enough that the hash trails the read closely and the last chunk's hash (the
#: only part that cannot overlap) is short.
READ_CHUNK = 8 << 20
#: readinto chunk when the reader hashes each chunk itself: the chunk is still in the core's
#: cache when it is hashed, which halves the hash's cost against hashing from memory.
HOT_CHUNK = 512 << 10
#: :func:`hash_file`'s reused buffer: fits in a core's L2 cache, so the hash reads what the
#: kernel just copied from the cache rather than from DRAM.
HASH_CHUNK = 1 << 20
#: Below this, a verified read hashes in the reading thread (a thread hand-over costs more).
_PIPELINE_MIN = 2 * READ_CHUNK

#: ``SYNC_FILE_RANGE_WRITE``: start write-back of the range's dirty pages, do not wait for it.
SYNC_FILE_RANGE_WRITE = 2
#: With huge pages on (:func:`new_buffer`), buffers from this size up are anonymous mappings
#: advised to use transparent huge pages.
_HUGE_MIN = 4 << 20


class SizeMismatch(Exception):
    """The file does not have the expected size (``actual``: what it has, as far as known)."""

    def __init__(self, actual: int):
        super().__init__(actual)
        self.actual = actual


_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _SPECIAL_KINDS if test(mode)), "special file")


def _check_mode(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "Is a directory", path)
    raise SpecialFileError(path=path, kind=_kind(mode))


def open_regular(path: str) -> int:
    """The one opener of every local read of a file txckpt did or will name (load, verify,
    export, fetch, commit-time hashing, log and manifest reads): an fd of a regular file.

    Opened with O_NONBLOCK (a FIFO opens at once instead of waiting for a writer, a device gets
    no blocking open) and O_NOCTTY, then checked with fstat on that fd (no stat-then-open race):
    a FIFO, socket or device raises :class:`~txckpt.errors.SpecialFileError`, a directory
    IsADirectoryError. The returned fd is blocking again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a device without a driver) cannot be opened
            try:
                mode = os.stat(path).st_mode
            except OSError:
                raise e from None
            _check_mode(path, mode)
        raise
    try:
        _check_mode(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_file(path: str, buffering: int = -1):
    """:func:`open_regular` as a binary file object."""
    return os.fdopen(open_regular(path), "rb", buffering=buffering)


def regular_size(path: str) -> int:
    """The size of the regular file at ``path`` (stat only: nothing is opened); a FIFO, socket
    or device raises SpecialFileError, a directory IsADirectoryError."""
    st = os.stat(path)
    _check_mode(path, st.st_mode)
    return st.st_size


def _advise_sequential(fd: int) -> None:
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        try:
            fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger read-ahead when the file is cold
        except OSError:
            pass


def _readinto(fd: int, view: memoryview) -> int:
    """One readinto of ``view`` from ``fd``'s current offset, retrying EINTR (Python does)."""
    return os.readv(fd, [view])


def read_into_buffer(path: str, size: int, *, hash: bool, pipeline: bool = True) -> tuple[Any, str | None]:
    """Read the file at ``path``, which must hold exactly ``size`` bytes, into a new uint8
    tensor; returns ``(buffer, xxh3-128 hex digest or None)``: :func:`start_read_into_buffer`,
    then waiting for its hash."""
    pending = start_read_into_buffer(path, size, hash=hash, pipeline=pipeline)
    return pending.buffer, pending.digest()


class BufferRead:
    """A file read whole into ``buffer`` whose hash may still be running behind the reader.

    ``digest()`` waits for the hash (the tail still being hashed when the read ended) and
    returns it (None when the read did not hash). Until it has returned a matching digest, the
    buffer holds bytes nobody checked: a caller may decode them only with a decoder that is safe
    on any input (safetensors, torch's ``weights_only`` unpickler), and must not hand out what it
    decoded before the check (txckpt._manifest.verify)."""

    def __init__(self, buffer: Any, hasher: Any, worker: "HashWorker | None"):
        self.buffer = buffer
        self._hasher = hasher
        self._worker = worker
        self._digest: str | None = None

    def digest(self) -> str | None:
        if self._hasher is None:
            return None
        if self._digest is None:
            if self._worker is not None:
                self._worker.finish()
                self._worker = None
            self._digest = self._hasher.hexdigest()
        return self._digest


class HashWorker:
    """One thread that hashes, in order, the chunks the reader hands it as each one lands
    (xxhash releases the GIL while it hashes, so it runs beside the reader on another core).
    A daemon thread: a load abandoned half-way (an exception in the reader, a
    KeyboardInterrupt) leaves nothing for interpreter exit to wait for."""

    def __init__(self, hasher: Any):
        self._hasher = hasher
        self._chunks: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="txckpt-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            chunk = self._chunks.get()
            if chunk is None:
                return
            if self._error is None:
                try:
                    self._hasher.update(chunk)
                except BaseException as e:  # handed to the reader at finish()
                    self._error = e

    def put(self, chunk: memoryview) -> None:
        self._chunks.put(chunk)

    def finish(self, *, check: bool = True) -> None:
        """Wait until every chunk handed over is hashed (the reader has stopped handing);
        ``check``: raise what the hash raised (off when the reader is already raising)."""
        self._chunks.put(None)
        self._thread.join()
        if check and self._error is not None:
            raise self._error


def _open_sized(path: str, size: int) -> int:
    """:func:`open_regular` for a sequential read of a file that must hold ``size`` bytes:
    :class:`SizeMismatch` (the descriptor closed) when it does not."""
    fd = open_regular(path)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise SizeMismatch(actual)
        _advise_sequential(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def start_read_into_buffer(path: str, size: int, *, hash: bool, pipeline: bool = True) -> BufferRead:
    """Read the file at ``path``, which must hold exactly ``size`` bytes, into a new uint8
    tensor; returns when the last byte is in the buffer, possibly before its hash is done
    (:class:`BufferRead`).

    With ``pipeline`` (and a file of at least two chunks) the hash runs in a thread of its own,
    each chunk handed to it as it lands: free when a core is idle, but about twice the CPU of
    hashing in the reading thread (the hashing core fetches every line from memory or another
    core's cache). Without it the reader hashes each (smaller) chunk right after reading it,
    from its cache, and the digest is ready when this returns.

    Raises :class:`SizeMismatch` if the file is shorter or longer than ``size`` (checked before
    and after reading), FileNotFoundError / IsADirectoryError / NotADirectoryError as open does.
    """
    fd = _open_sized(path, size)
    try:
        hasher = new_hasher() if hash else None
        pipelined = hasher is not None and pipeline and size >= _PIPELINE_MIN
        buf = new_buffer(size)
        view = memoryview(buf.numpy()) if size else memoryview(b"")
        worker = HashWorker(hasher) if pipelined else None
        step = HOT_CHUNK if hasher is not None and worker is None else READ_CHUNK
        try:
            off = 0
            while off < size:
                n = _readinto(fd, view[off : min(size, off + step)])
                if n <= 0:
                    raise SizeMismatch(off)  # truncated while being read
                if hasher is not None:
                    chunk = view[off : off + n]
                    if worker is None:
                        hasher.update(chunk)
                    else:
                        worker.put(chunk)  # the reader goes on with the next chunk meanwhile
                off += n
            if os.read(fd, 1):
                raise SizeMismatch(max(os.fstat(fd).st_size, size + 1))  # grew while being read
        except BaseException:
            if worker is not None:
                worker.finish(check=False)  # stop the thread before the buffer it reads goes away
            raise
        return BufferRead(buf, hasher, worker)
    finally:
        os.close(fd)


def start_map_file(path: str, size: int, *, hash: bool, pipeline: bool = True) -> BufferRead:
    """Map the file at ``path``, which must hold exactly ``size`` bytes, copy-on-write into a
    ``torch.uint8`` tensor, and start hashing its pages; returns at once (:class:`BufferRead`).

    Nothing is copied: the tensor's bytes are the page cache's pages of the file (a write to a
    tensor decoded from it copies that page into the process, never into the file), read from
    the disk when first touched, by the hash here. What this trades against
    :func:`start_read_into_buffer`, and why it is not the default (docs/troubleshooting.md,
    "Loading with `mmap=True`"): the kernel may drop a clean page that was hashed and read it from the
    disk again later, and a file shortened under the mapping (never by txckpt: committed files are
    only ever unlinked) makes the process fail with SIGBUS when the missing page is touched.

    With ``pipeline`` (and a file of at least two chunks) the hash runs in a thread of its own and
    this returns before it ends; without, the digest is ready when this returns. Raises
    :class:`SizeMismatch` if the file does not hold ``size`` bytes when opened. Where the file
    cannot be mapped (the filesystem refuses), it is read: :func:`start_read_into_buffer`."""
    torch = deps.torch
    fd = _open_sized(path, size)
    unmappable = False
    m: mmap.mmap | None = None
    try:
        if size:
            m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        # A filesystem that cannot map files (some FUSE and network mounts: ENODEV, EINVAL):
        # read it as mmap=False would, rather than fail a load that can be done.
        unmappable = True
    finally:
        os.close(fd)  # the mapping holds the file
    if unmappable:
        return start_read_into_buffer(path, size, hash=hash, pipeline=pipeline)
    hasher = new_hasher() if hash else None
    if m is None:
        return BufferRead(torch.empty(0, dtype=torch.uint8), hasher, None)
    advise = getattr(mmap, "MADV_SEQUENTIAL", None)
    if advise is not None:
        try:
            m.madvise(advise)  # read-ahead as the hash walks it; pages behind it may go first
        except OSError:
            pass
    buf = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    worker = None
    if hasher is not None:
        if pipeline and size >= _PIPELINE_MIN:
            worker = HashWorker(hasher)  # the caller decodes while it hashes
        feed = hasher.update if worker is None else worker.put
        view = memoryview(m)
        for off in range(0, size, READ_CHUNK):
            feed(view[off : off + READ_CHUNK])
    return BufferRead(buf, hasher, worker)


def new_buffer(size: int, *, huge: bool | None = None) -> Any:
    """An uninitialised ``torch.uint8`` tensor of ``size`` bytes, on small pages unless ``huge``
    (default: ``TXCKPT_LOAD_HUGE_PAGES=1``): then large ones are private anonymous mappings
    advised to use transparent huge pages, released when the last tensor viewing them is freed.

    Huge pages are off by default: on a KVM guest (virtio-balloon free page reporting) faulting
    in a fresh huge-page buffer took 3-20 s for 2.5 GiB against 2.4-3.7 s on small pages, with
    seconds of host (steal) time, and direct compaction stalls by the hundred per load; read
    with a hash thread right behind the reader, 2-3x the CPU of the whole load. Those were the
    multi-second outliers of loads, verified or not (docs/benchmarks.md, "Load with
    verification"). Where huge pages are reliable, one 2 MiB fault instead of 512 small ones
    cuts a read's fault cost: opt in."""
    torch = deps.torch
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if huge is None:
        huge = os.environ.get("TXCKPT_LOAD_HUGE_PAGES", "0") == "1"
    if huge and size >= _HUGE_MIN and advise is not None and flags:
        try:
            m = mmap.mmap(-1, size, flags=flags)
            try:
                m.madvise(advise)
            except OSError:
                pass  # no THP here: plain pages, as torch.empty would give
            return torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
        except (OSError, ValueError):
            pass
    return torch.empty(size, dtype=torch.uint8)


def hash_file(path: str, *, fsync: bool = False, tap: Callable[[memoryview], Any] | None = None) -> tuple[int, str]:
    """``(size, xxh3-128 hex digest)`` of the file at ``path``; with ``fsync`` the file is
    durable when this returns (its write-back is started before hashing, so the two overlap).
    ``tap`` is called with each block right after it is hashed, in order (a tensor index's
    indexer: the same single read). A file of :data:`TAP_THREAD_FROM` bytes or more, on a
    process with two cores or more, has its ``tap`` run on a second thread, one block behind
    the file's own digest (:func:`_hash_file_tapped`)."""
    fd = open_regular(path)
    try:
        if fsync:
            _start_writeback(fd)
        _advise_sequential(fd)
        if tap is not None and usable_cores() >= 2 and os.fstat(fd).st_size >= TAP_THREAD_FROM:
            size, digest = _hash_file_tapped(fd, tap)
            if fsync:
                os.fsync(fd)
            return size, digest
        hasher = new_hasher()
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        size = 0
        while True:
            n = _readinto(fd, view)
            if not n:
                break
            hasher.update(view[:n])
            if tap is not None:
                tap(view[:n])
            size += n
        if fsync:
            os.fsync(fd)
        return size, hasher.hexdigest()
    finally:
        os.close(fd)


#: The file size from which :func:`hash_file` runs its ``tap`` on a second thread: the tap (a
#: tensor index's chunk and tensor digests) hashes each byte once or twice more, so on its own
#: core it overlaps the file's digest; below this a thread's start and hand-overs cost more.
TAP_THREAD_FROM = 64 << 20
#: The block :func:`_hash_file_tapped` reads and hands over: a hand-over per block costs tens of
#: microseconds, a few percent of hashing 4 MiB.
TAP_THREAD_BLOCK = 4 << 20


def _hash_file_tapped(fd: int, tap: Callable[[memoryview], Any]) -> tuple[int, str]:
    """:func:`hash_file`'s loop with ``tap`` on a thread of its own: two buffers, the file's
    digest of block k in this thread while the tap takes block k-1 there (xxh3 releases the GIL).
    The tap sees the same blocks in the same order, so what it computes is unchanged; a block's
    buffer is read into again only once the tap has returned from it."""
    views = [memoryview(bytearray(TAP_THREAD_BLOCK)) for _ in range(2)]
    hasher = new_hasher()
    size, k = 0, 0
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="txckpt-tap") as pool:
        pending: concurrent.futures.Future[Any] | None = None
        try:
            while True:
                view = views[k & 1]  # its last tap (block k-2) was waited for before block k-1's
                n = _readinto(fd, view)
                if not n:
                    break
                hasher.update(view[:n])
                if pending is not None:
                    pending.result()  # raises the tap's error here
                pending = pool.submit(tap, view[:n])
                size += n
                k += 1
            if pending is not None:
                pending.result()
        finally:
            if pending is not None:
                pending.cancel()
                concurrent.futures.wait([pending])  # never leave the tap reading a freed buffer
    return size, hasher.hexdigest()


def fsync_file(path: str) -> None:
    """Make the data of the regular file at ``path`` durable (its name is its directory's)."""
    fd = open_regular(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_and_fsync(path: str) -> tuple[int, str]:
    """:func:`hash_file` with ``fsync=True``: what a commit does to a file other code wrote."""
    return hash_file(path, fsync=True)


def _start_writeback(fd: int) -> None:
    if sync_file_range is not None:
        # Asynchronous: queue write-back of the whole file's dirty pages; the fsync below waits.
        sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


# ----- low-level local file operations (what storage.local builds on) ------------------------------
def walk_relative(base: str) -> Iterator[tuple[str, int]]:
    """Every file under local directory ``base``: (its '/'-separated path relative to ``base``, its size)."""
    for dirpath, _dirnames, filenames in os.walk(base):
        for n in sorted(filenames):
            full = os.path.join(dirpath, n)
            yield os.path.relpath(full, base).replace(os.sep, "/"), os.path.getsize(full)


def makedirs_durable(path: str, durable: bool) -> None:
    """os.makedirs, and with ``durable`` fsync the parent of every directory it created, so the
    new entries survive a power cut (POSIX makes an entry durable when its directory is fsynced)."""
    missing = []
    cur = path
    while cur and not os.path.isdir(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    if not missing:
        return
    os.makedirs(path, exist_ok=True)
    if durable:
        for d in reversed(missing):
            fsync_dir(os.path.dirname(d))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(top: str) -> None:
    """fsync every file under ``top`` and every directory, ``top`` included (a tree written
    without fsync, made durable at once: a fetched copy before it is renamed into place)."""
    for dirpath, _dirs, files in os.walk(top):
        for n in files:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def _libc() -> ctypes.CDLL:
    """The C library already linked into this process (dlopen(NULL)). Not
    ``ctypes.util.find_library("c")``: that runs ``ldconfig -p`` in a child process, at import."""
    return ctypes.CDLL(None, use_errno=True)


def _load_sync_file_range():
    try:
        libc = _libc()
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


#: libc's ``sync_file_range(fd, offset, nbytes, flags)``, or None where there is none.
sync_file_range = _load_sync_file_range()

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _load_renameat2():
    try:
        libc = _libc()
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def rename_noreplace(src: str, dst: str) -> None:
    """rename(2) that fails with FileExistsError instead of replacing ``dst`` (even an empty dir)."""
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), src)
    # Fallback for filesystems without RENAME_NOREPLACE. A rename onto an empty directory would
    # succeed silently, so refuse any existing target first; the window is documented.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "target exists", dst)
    os.rename(src, dst)


_RENAME_EXCHANGE = 2


def rename_exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (renameat2 ``RENAME_EXCHANGE``; directories may
    be non-empty). False, with nothing changed, where the kernel or filesystem has no exchange
    (NFS, older kernels): the caller falls back to two renames."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def lies_within(path: str, root: str) -> bool:
    """Whether ``path`` (which need not exist yet) is ``root`` or below it, comparing real
    paths: symlinks on the way of either are resolved."""
    real, root_real = os.path.realpath(path), os.path.realpath(root)
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


#: ioctl(2) FICLONE: make the open destination a copy-on-write clone of the open source (XFS,
#: btrfs, bcachefs, OpenZFS block cloning). Not copy_file_range(2), which may copy the bytes.
FICLONE = 0x40049409

# Devices whose file system refused a clone: one refused ioctl per device and process, not one
# per shared file.
_CANNOT_CLONE: set[int] = set()


def clone_file(source: str, target: str) -> bool:
    """Make the new file ``target`` a clone of ``source`` (a file of its own, sharing the
    source's blocks until either is written), durable when this returns; False, ``target``
    not made, where the file system cannot clone."""
    device = os.stat(source).st_dev
    if device in _CANNOT_CLONE:
        return False
    src_fd = open_regular(source)
    try:
        dst_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.ioctl(dst_fd, FICLONE, src_fd)
            os.fsync(dst_fd)  # the clone's extent map: its bytes are the source's, durable already
        except OSError as e:
            os.close(dst_fd)
            dst_fd = -1
            os.unlink(target)
            if e.errno == errno.EXDEV:  # two file systems: no clone for this pair only
                return False
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTTY, errno.EINVAL, errno.EPERM, errno.ENOSYS):
                _CANNOT_CLONE.add(device)
                return False
            raise
        finally:
            if dst_fd >= 0:
                os.close(dst_fd)
    finally:
        os.close(src_fd)
    return True


def make_read_only(path: str) -> None:
    """Drop the write bits of a hard-linked shared file's inode, so that an ordinary tool that
    opens one checkpoint's name for writing fails instead of changing every checkpoint holding
    it (root ignores the mode: docs/incremental.md)."""
    try:
        mode = os.lstat(path).st_mode
        if mode & 0o222:
            os.chmod(path, stat.S_IMODE(mode) & ~0o222)  # a link this process just made: a regular file
    except PermissionError:  # another user's file: it stays as it was
        pass


def share_inode(source: str, target: str) -> bool:
    """Make the new file ``target`` hold ``source``'s bytes without copying them: a clone where
    the file system can (a file of its own: a later in-place write into either name changes that
    file only), else a hard link made read-only (one inode, which an ordinary tool can no longer
    open for writing through either name). False, ``target`` not made, where neither works (a
    file system without hard links, some network and FUSE mounts, or the source's link count
    at its limit): the caller writes the bytes instead."""
    if clone_file(source, target):
        return True
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    make_read_only(target)
    return True
