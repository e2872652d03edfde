"""The names of one transaction's files: a name is written once and one way only.

A transaction refuses, with :class:`~txckpt.errors.InvalidArgumentError`:

* a name written twice through ``tx.open``/``tx.save``;
* ``a`` beside ``a/b`` (one would have to be a file and a directory);
* a name other code already wrote into ``tx.directory`` (``save_pretrained`` then
  ``tx.save("config.json")``: the second write would replace the first unnoticed);
* at commit, a ``tx.open`` file of a local staging directory that other code wrote again
  through ``tx.directory`` (it would commit with the first write's checksum).

For the last one each such file is *marked* once ``tx.directory`` is out: its mtime is set 1 ns
back and ``(dev, ino, size, mtime)`` recorded. Any later write sets the clock's current (coarse)
time, which differs from the mark even within one clock tick, so an in-place rewrite of the
same size is seen too.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from ..errors import InvalidArgumentError
from .._manifest.manifest import name_conflict


def _prefixes(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _identity(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class TxNames:
    """The name bookkeeping of one rank's transaction that its sets of written and open names do
    not give at once: which names are directories, and the marks of files other code may rewrite."""

    def __init__(self) -> None:
        self._dirs: dict[str, str] = {}  # directory prefix -> a name below it
        self._marks: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, taken: Callable[[str], bool], local_dir: str | None) -> None:
        """Raise unless ``name`` (a valid file name, ``manifest.check_new_file_name``) may be
        opened now, else record it as opened (:meth:`rebuild` forgets it again). ``taken``:
        whether a name is written or open already; ``local_dir``: tx.directory, if it is out."""
        if name in self._dirs:
            raise name_conflict(name, self._dirs[name])
        prefixes = _prefixes(name)
        for prefix in prefixes:
            if taken(prefix):
                raise name_conflict(prefix, name)
        if local_dir is not None:
            for prefix in prefixes:
                p = os.path.join(local_dir, *prefix.split("/"))
                if os.path.lexists(p) and not os.path.isdir(p):
                    raise name_conflict(prefix, name)
            if os.path.lexists(os.path.join(local_dir, *name.split("/"))):
                raise InvalidArgumentError(
                    f"{name!r} is already in tx.directory (written there by other code, e.g. save_pretrained): "
                    "tx.save/tx.open would replace it. Write each file one way only, or under another name"
                )
        self._opened(name, prefixes)

    @staticmethod
    def raise_conflict_in_staging(name: str, staging_dir: str | None, error: OSError) -> None:
        """After creating ``name`` in the shared staging directory failed with ``error``: raise
        the name conflict that explains it, if another rank's file or directory is in the way
        (``a`` beside ``a/b``, which this rank's own bookkeeping cannot see); else return."""
        if staging_dir is None:
            return
        for prefix in _prefixes(name):
            p = os.path.join(staging_dir, *prefix.split("/"))
            if os.path.lexists(p) and not os.path.isdir(p):
                raise name_conflict(prefix, name, ranks=True) from error
        p = os.path.join(staging_dir, *name.split("/"))
        if os.path.isdir(p) and not os.path.islink(p):
            below = sorted(os.listdir(p))
            raise name_conflict(name, f"{name}/{below[0]}" if below else f"{name}/", ranks=True) from error

    def _opened(self, name: str, prefixes: list[str]) -> None:
        for prefix in prefixes:
            self._dirs.setdefault(prefix, name)

    def rebuild(self, names: Iterable[str]) -> None:
        """After a name was dropped (a writer aborted, a file not created): the directories of
        the names still written or open."""
        self._dirs = {}
        for n in names:
            self._opened(n, _prefixes(n))

    def mark(self, name: str, path: str | None) -> None:
        """Remember the file ``name`` at local ``path`` (see the module doc); None (no local
        path: an object store's staging) remembers nothing."""
        if path is None:
            return
        try:
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 1))
            self._marks[name] = _identity(path)
        except OSError:
            pass  # gone already: the commit's check of the staged files reports it

    def check_not_rewritten(self, path_of: Callable[[str], str | None]) -> None:
        """Raise if other code wrote a marked file again (``path_of``: name -> local path)."""
        for name, before in self._marks.items():
            path = path_of(name)
            if path is None:
                continue  # (only local files are marked)
            try:
                now = _identity(path)
            except OSError:
                continue  # missing: the commit's check of the staged files reports it
            if now != before:
                raise InvalidArgumentError(
                    f"{name!r} was written through tx.save/tx.open and then written again in tx.directory "
                    "(by code such as save_pretrained using the same name): write each file one way only, "
                    "or under another name. Nothing was committed"
                )
