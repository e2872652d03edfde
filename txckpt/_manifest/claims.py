"""Files a rank claims in its transaction's directory (``tx.claim_files``): files that other code
wrote there on this rank (DeepSpeed's ``zero_pp_rank_{r}_*`` shards, DCP's ``__{r}_*.distcp``,
the Trainer's ``rng_state_{r}.pth``). The claiming rank hashes them (and, with durability on,
fsyncs them) before its report leaves, and they are recorded with its rank: the committer never
reads another rank's bytes, which on several nodes would be a read of the whole checkpoint over
the network by one process (protocol §8, step 4).

A claim is a name or a glob (``*``, ``?``, ``[...]``, as :mod:`fnmatch`). A glob without ``/``
matches a file's base name in any sub-directory (``__1_*.distcp`` matches
``model/__1_0.distcp``); one with ``/`` matches the whole relative path. A glob may match
nothing (a rank that wrote no such file); a plain name must exist when the rank's report is made.
"""

from __future__ import annotations

import fnmatch
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterable, Set

from .._base.checksum import copy_hashing
from ..errors import InvalidArgumentError, UnsafePathError
from .._base.fileio import fsync_file, hash_file
from .tensor_index import Indexer
from .manifest import FileEntry, check_file_name, kind_for_name
from .._storage.base import Storage

_GLOB_CHARS = frozenset("*?[")


def is_glob(pattern: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(pattern)


def check_claims(names_or_globs: str | Iterable[str]) -> list[str]:
    """The claims as a list, each checked like a file name (relative, no '..', not the manifest)."""
    items = [names_or_globs] if isinstance(names_or_globs, str) else list(names_or_globs)
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidArgumentError(f"tx.claim_files takes file names or globs (str), not {item!r}")
        check_file_name(item)
    return items


def matches(name: str, pattern: str) -> bool:
    """Whether the relative file name ``name`` is claimed by ``pattern`` (rules: module docstring)."""
    if not is_glob(pattern):
        return name == pattern
    target = name if "/" in pattern else name.rsplit("/", 1)[-1]
    return fnmatch.fnmatchcase(target, pattern)


def claimed_names(present: Iterable[str], claims: list[str], skip: set[str]) -> list[str]:
    """The names of ``present`` that ``claims`` match, less ``skip`` (this rank's ``tx.open``
    files: already hashed). A plain name that is not present raises InvalidArgumentError."""
    present = list(present)
    have = set(present)
    missing = [c for c in claims if not is_glob(c) and c not in have]
    if missing:
        raise InvalidArgumentError(
            f"tx.claim_files named {missing[:5]}, which this rank's transaction directory does not "
            "hold at commit: claim only files this rank wrote there (a glob may match nothing)"
        )
    return [n for n in present if n not in skip and any(matches(n, c) for c in claims)]


def hash_claimed(
    storage: Storage,
    key: str,
    claims: list[str],
    skip: set[str],
    durable: bool,
    rank: int,
    relink: Relink | None = None,
) -> dict[str, FileEntry]:
    """Hash (and with ``durable`` fsync) the files of the staging directory ``key`` that
    ``claims`` match, less ``skip``: their manifest entries, recorded with ``rank``;
    ``relink`` as for :func:`hash_staged`."""
    base = storage.local_path(key)
    if base is None:  # no local staging (an object store, tx.directory never asked for): no files
        claimed_names([], claims, skip)
        return {}
    names = claimed_names((name for name, _ in storage.walk_files(key)), claims, skip)
    for name in names:
        if storage.is_symlink_escape(f"{key}/{name}"):
            raise UnsafePathError(f"{name!r} in the checkpoint is a symlink that leaves the root")

    return hash_staged(storage, key, names, durable, rank, relink)


#: An incremental save's ``Sharing.relink``: given the staging key and the files just hashed,
#: replaces those a committed checkpoint already holds by shares of them; returns their names.
Relink = Callable[[str, Dict[str, FileEntry]], Set[str]]


def hash_staged(
    storage: Storage, key: str, names: list[str], durable: bool, rank: int = 0, relink: Relink | None = None
) -> dict[str, FileEntry]:
    """Hash (and with ``durable`` fsync) files ``names`` of the staging directory ``key``, which
    other code wrote there: their manifest entries, recorded with ``rank``. The claiming rank's
    pass and the committer's pass over unclaimed files (transactions) are this one. With
    ``relink`` (an incremental save), the files whose bytes a committed checkpoint holds are
    then shared with it (the entries stay as hashed), and only the others are fsynced: a shared
    file's scratch copy is never written to the disk (its dirty pages go with its inode)."""
    fsync_now = durable and relink is None

    def one(name: str) -> FileEntry:
        local = storage.local_path(f"{key}/{name}")
        # The tensor index (protocol §3b) from the same read: the header as it goes by.
        indexer = Indexer(name)
        if local is not None:
            size, digest = hash_file(local, fsync=fsync_now, tap=indexer.update)  # a FIFO here raises, never blocks
        else:
            with storage.open_read(f"{key}/{name}") as f:
                size, digest = copy_hashing(f, tap=indexer.update)
        return FileEntry(size, digest, kind_for_name(name), rank, index=indexer.finish(size))

    # Reading one file while another one's fsync waits for the disk: both release the GIL.
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        entries = dict(zip(names, pool.map(one, names)))
    if relink is not None and entries:
        shared = relink(key, entries)
        unshared = [p for p in (storage.local_path(f"{key}/{n}") for n in names if n not in shared) if p]
        if durable and unshared:
            with ThreadPoolExecutor(max_workers=min(4, len(unshared))) as pool:
                list(pool.map(fsync_file, unshared))
    return entries
