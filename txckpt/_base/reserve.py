"""Space held back on a local root so that retention can free space on a full disk.

Retention is two-phase (docs/protocol.md §11): a ``retire`` entry is appended first and the data
is deleted after. On a disk that is 100 % full even that small entry cannot be created (ext4 and
tmpfs refuse a single byte), so ``txckpt gc --keep-last N``, the remedy for a full disk, would
free nothing. A local root therefore keeps ``.txckpt/reserve``: a file of ``RESERVE_BYTES``
whose blocks are allocated (written as zeros, not sparse). When a retire append fails with ENOSPC or
EDQUOT, the reserve is deleted and the append tried again, in the space it released; once
retention has deleted data, the reserve is made again. Only retire appends may use it: a save's
commit on a full disk fails (``StorageError``) and leaves the reserve for the gc that frees space.

Object stores have no full disk: nothing is reserved there. The reserve is best effort: a root
whose disk filled up before it had one (created by an older txckpt, or with
``TXCKPT_RESERVE_BYTES=0``) gets it at the next retention or gc that has room for it.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Protocol

from ..errors import StorageError
from .layout import RESERVE_KEY, temp_name  # every name under a root is layout's

log = logging.getLogger("txckpt")


class ReserveStorage(Protocol):
    """What the reserve needs of a root's storage (``storage.base.Storage``, a floor above)."""

    def space_reserve_path(self, key: str) -> str | None: ...

    def full_path(self, key: str) -> str: ...


#: Bytes held back: a retire entry carries the compact state (a few hundred bytes per lineage),
#: its link may need a new block of ``log/``, and the deletion's renames a directory block or two.
RESERVE_BYTES = max(0, int(os.environ.get("TXCKPT_RESERVE_BYTES", "") or 256 << 10))

FULL = (errno.ENOSPC, errno.EDQUOT)


def _path(storage: ReserveStorage) -> str | None:
    # None on object stores (and memory): they never run out of space this way.
    return storage.space_reserve_path(RESERVE_KEY)


def ensure_reserve(storage: ReserveStorage, *, durable: bool) -> bool:
    """Make ``.txckpt/reserve`` if the root is local and lacks it; False if it could not be made
    (no room yet: retried by the next retention or gc). Never raises for lack of space."""
    path = _path(storage)
    if path is None or RESERVE_BYTES == 0 or os.path.lexists(path):
        return path is not None and RESERVE_BYTES > 0
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        return False  # not a txckpt root (yet)
    tmp = os.path.join(directory, temp_name(os.path.basename(path), hidden=True))
    try:
        # Written through plain file writes, not fallocate: writing zeros allocates real blocks
        # too (no sparse file), and it is the one way of writing files txckpt uses elsewhere (the
        # power-loss harness records exactly those).
        with open(tmp, "xb") as f:
            f.write(bytes(RESERVE_BYTES))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.rename(tmp, path)  # whole or absent: a concurrent maker's reserve is just replaced
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if e.errno not in FULL:
            log.debug("could not make %s: %s", path, e)
        return False
    return True


def release_reserve(storage: ReserveStorage) -> bool:
    """Delete the reserve (the disk is full and a retire entry needs the room); True if there
    was one to delete."""
    path = _path(storage)
    if path is None:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.warning(
        "the disk of %s is full; released the space txckpt reserves for retention (%s) to record what it deletes",
        storage.full_path(""),
        RESERVE_KEY,
    )
    return True


def full_disk_error(e: OSError, root_url: str) -> Exception:
    """The StorageError of a retire append that failed for lack of space, even after the
    reserve was released: what to do, in words."""
    return StorageError(
        e.errno,
        f"txckpt could not record which checkpoints retention deletes: the disk of {root_url} is full "
        f"({os.strerror(e.errno or errno.ENOSPC)}) and the space txckpt reserves for this ({RESERVE_KEY}) is used up or was "
        "never made (a root created by an older txckpt). `txckpt gc` already deleted what needs no record "
        "(uncommitted staging, retired data, temp files). Free a few MiB on this file system by hand (files "
        "outside the root, or a checkpoint-N directory you do not need: lookups skip a missing one with a "
        "warning), then run `txckpt gc ROOT --keep-last N` again. Nothing was retired or deleted",
    )
