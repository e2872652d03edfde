"""Reader leases: "retention and gc, leave checkpoint <txid> alone for a while" (protocol §11).

A reader that will read a committed checkpoint's files, and an incremental save that will share
them (docs/incremental.md), takes a lease first and gives it back when done. Deleters read the
leases after the retired set (``txckpt._maintenance.retention.read_leases``), which is what makes a granted
lease safe: see :func:`acquire_reader_lease`.
"""

from __future__ import annotations

import json
import logging
import os
import time

from ..errors import CheckpointNotFoundError, InvalidArgumentError
from .._base.layout import lease_key
from .._log.publication import Root

log = logging.getLogger("txckpt")


def acquire_reader_lease(root: Root, txid: str, seconds: float = 3600.0) -> str:
    """Ask retention and gc to leave checkpoint ``txid`` alone for ``seconds``. Returns the lease
    key, for :func:`release_reader_lease`. Expired leases are ignored (and removed by gc).

    Take the lease *before* reading the checkpoint. The lease is written first, then the log is
    read: if ``txid`` is retired (its deletion may have begun) or not committed, the lease is
    deleted again and :class:`~txckpt.errors.CheckpointNotFoundError` is raised. A lease that
    passes this check is seen by every deleter, because deleters read the retired set first and
    the leases after it (``txckpt._maintenance.retention.finish_retired``, ``collect_garbage``): a retire entry the check
    did not see was appended after the lease existed, so a deleter that acts on it reads the
    leases later still.
    """
    if not isinstance(txid, str) or not txid or "/" in txid:
        raise InvalidArgumentError(f"txid must be a plain txid string, not {txid!r}")
    key = lease_key(txid)
    record = {"txid": txid, "expires": time.time() + float(seconds), "pid": os.getpid()}
    root.storage.replace(key, json.dumps(record).encode())
    try:
        # A fresh read of the log, after the lease exists: the History object is extended with
        # every entry appended since it was last read (entries are immutable, each read is a
        # direct read that bypasses listing caches), so this sees every entry created before now.
        history = root.history()
    except BaseException:
        _drop_lease(root, key)
        raise
    why = None
    if txid not in history.checkpoints:
        why = "is not a committed checkpoint of this root"
    elif txid in history.retired:
        why = "is retired: retention let it go and its data is being (or was) deleted"
    if why is not None:
        _drop_lease(root, key)
        raise CheckpointNotFoundError(
            f"no reader lease on {txid}: it {why}. Look the checkpoint up again "
            "(txckpt.get_last_checkpoint, or `txckpt ls`) and lease one that is still kept"
        )
    return key


def _drop_lease(root: Root, key: str) -> None:
    try:
        root.storage.delete_file(key)
    except FileNotFoundError:
        pass
    except OSError:  # left behind: it names a retired txid, gc removes it once it expires
        log.warning("could not remove the refused reader lease %s", key, exc_info=True)


def release_reader_lease(root: Root, key: str) -> None:
    """Give back the lease ``key`` that :func:`acquire_reader_lease` returned (deletes its file);
    retention and gc may then delete the checkpoint. Call it when the read is done."""
    root.storage.delete_file(key)


__all__ = ["acquire_reader_lease", "release_reader_lease"]
