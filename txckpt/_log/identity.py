"""A root's identity: which spellings name one root in this process, and what the process
remembers about that root, whichever spelling it came through.

A local root is a directory, not a spelling of it: a symlink to it (or to one of its parents), a
path with ``..``, a trailing slash, a relative path, a ``file://`` URL and a second mount of the
same directory (a bind mount) all name one root. A remote root is what its storage addresses
(:meth:`Storage.identity`: ``s3://b/a/``, ``s3://b/a`` and ``s3://b//a`` are one S3 prefix).

:func:`root_key` is the one place that decides it; the root cache (``root.open_root``) and the
async savers (``asyncsave``: one save in flight per root) key by it, so a save through a link
waits for the pending async save of the real path, and every spelling of a root shares one
:class:`SessionState` (one writer session: no spelling shuts another out as a stale writer).
Each spelling keeps its own ``CheckpointRoot`` object, whose paths are in that spelling.

A directory that does not exist yet is named by its nearest existing parent's identity and the
rest of its path, so a root created by its first save keeps the key it had before (a dangling
symlink resolves to its target). Identity is resolved at each call: a symlink pointed elsewhere
names the directory it points to now.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, TypeVar

from .._base.layout import is_local_path
from .._storage import open_storage

if TYPE_CHECKING:  # pragma: no cover
    from .lineage import History, State

T = TypeVar("T")

_lock = threading.Lock()
#: (st_dev, st_ino) of a directory -> its canonical path (the first path it was met at).
_dirs: dict[tuple[int, int], str] = {}
#: A local spelling -> (the directory it reached, that directory's canonical path).
_spelled: dict[str, tuple[tuple[int, int], str]] = {}
#: (URL, options) -> (its local directory, or None; its storage's identity): a URL always names
#: the same objects, and opening its storage again on each call would cost a client.
_urls: dict[tuple[str, str], tuple[str | None, str]] = {}


def spelling(root: str | os.PathLike) -> str:
    """``root`` as its storage spells it: a local path absolute (``~`` expanded, ``..`` and
    trailing slashes gone, as ``LocalStorage`` takes it), a URL as given."""
    p = os.fspath(root)
    return _local_spelling(p) if is_local_path(p) else p


def _local_spelling(p: str) -> str:
    if p.startswith("file://"):
        p = p[len("file://") :]
    return os.path.abspath(os.path.expanduser(p))


def root_key(root: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """What names one root in this process: the pid (a forked child starts afresh), the root's
    identity (module docstring) and the storage options."""
    return root_names(root, storage_options)[0]


def root_names(root: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], str]:
    """``(root_key(root, storage_options), spelling(root))``: both names the root cache files a
    root under, from one look at what kind of path ``root`` is."""
    options = repr(sorted((storage_options or {}).items()))
    given = os.fspath(root)
    local = is_local_path(given)
    spelled = _local_spelling(given) if local else given
    directory: str | None = spelled
    url = given
    if not local:
        with _lock:
            known = _urls.get((given, options))
        if known is None:
            storage = open_storage(given, storage_options)
            # A URL read through local paths (``local://``) is the directory's; else the storage's.
            known = _urls[(given, options)] = (storage.local_path(""), storage.identity())
        directory, url = known
    if directory is None:
        return (os.getpid(), url, options), spelled
    return (os.getpid(), "dir:" + _directory(directory), options), spelled


def _directory(path: str) -> str:
    """The canonical path of the directory ``path`` names now. One stat when this spelling was
    met before and still reaches the same directory (a lookup calls this twice: resolving
    symlinks component by component each time cost more than the lookup's own two reads)."""
    try:
        st = os.stat(path)
    except OSError:
        return _canonical(os.path.realpath(path))
    ino = (st.st_dev, st.st_ino)
    with _lock:
        seen = _spelled.get(path)
    if seen is not None and seen[0] == ino:
        return seen[1]
    out = _canonical(os.path.realpath(path))
    with _lock:
        _spelled[path] = (ino, out)
    return out


def _canonical(real: str) -> str:
    """The canonical path of the directory at ``real`` (a path without symlinks): the path it
    was first met at in this process, so that a second mount of it names it too; for a path
    that does not exist, its existing parent's canonical path joined with the rest."""
    try:
        st = os.stat(real)
    except OSError:
        st = None
    if st is not None:
        ino = (st.st_dev, st.st_ino)
        with _lock:
            known = _dirs.get(ino)
        if known is not None and (known == real or _same_dir(known, ino)):
            return known
    parent, name = os.path.split(real)
    out = real if not name or parent == real else os.path.join(_canonical(parent), name)
    if st is not None:
        with _lock:
            _dirs[ino] = out  # (also replaces a number a removed directory had: inodes are reused)
    return out


def _same_dir(path: str, ino: tuple[int, int]) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == ino


class SessionState:
    """What this process remembers about one root, shared by every spelling's ``CheckpointRoot``
    (``root.open_root``): its writer session and the states it has read."""

    def __init__(self) -> None:
        #: The lineage this process writes; None until resume/new_lineage/first save.
        self.writer_lineage: str | None = None
        #: This writer session's token: it holds a lineage once it created, resumed or claimed it.
        self.session = uuid.uuid4().hex[:16]
        #: The log history this process folded last (read_history extends it, never starts over).
        self.folded_history: History | None = None
        #: Held while a fold extends ``folded_history`` (CheckpointRoot.history): one fold at a
        #: time, so the one remembered only moves forward, whichever thread folds.
        self.fold_lock = threading.Lock()
        #: The state each pending save of this process was planned against, by txid.
        self.base_states: dict[str, State] = {}
        #: The newest state this process has read or appended; a save of the lineage this
        #: session holds plans against it without reading the log (protocol §8 step 1).
        self.known_state: State | None = None
        #: Whether this session's first commit reclaimed dead writers' staging (gc.reclaim_after_save).
        self.staging_reclaimed = False
        #: The digest of every rank's file names and kinds at this session's last multi-rank
        #: commit (txckpt._manifest.rankparts): a save whose ranks report the same one commits without
        #: reading their parts (protocol §3a, the unchanged-structure fast path).
        self.part_structures: bytes | None = None
        #: Called (no arguments, never raising) after each commit this process makes on the
        #: root, by name: a tiered root's replicator is woken so (txckpt._tiered.tiered), whichever
        #: path made the commit (a save, an async save, the DCP writer, an integration).
        self.on_commit: dict[str, Callable[[], None]] = {}
        #: By name: txids that retention of the root in this process must keep whatever its
        #: policy says (a tiered root's fast tier: what is not durable yet), asked at each plan.
        self.retention_guards: dict[str, Callable[[], set[str]]] = {}


class Shared(Generic[T]):
    """An attribute of ``CheckpointRoot`` kept in its :class:`SessionState` (``.shared``): every
    spelling of the root reads and writes the same value."""

    def __set_name__(self, owner: Any, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]  # the descriptor itself, on the class
        return getattr(obj.shared, self.name)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj.shared, self.name, value)


__all__ = ["root_key", "root_names", "spelling", "SessionState", "Shared"]
