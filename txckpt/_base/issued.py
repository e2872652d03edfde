"""Checkpoint paths that a lookup issued, with what reading them needs.

``get_last_checkpoint`` and ``resume`` return a path as a plain ``str`` (transformers' contract),
but a path on an object store is unreadable without the root's storage options, and a tiered
root's path is read best through its root (a fast copy repaired from the durable tier). So a
lookup returns a :class:`CheckpointPath`: a ``str`` to every caller and to stock code, that
also carries the storage options and the root object that answered. And because code on the
way may rebuild the string (``os.path.abspath``, an f-string, a broadcast that pickles it as a
plain ``str``), the process also remembers the newest paths it issued, keyed by their text: a
plain ``str`` equal to an issued path reads as that path did (:func:`issued`)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Mapping

#: How many issued paths the process remembers (a job looks up a handful).
_REMEMBERED = 256


class CheckpointPath(str):
    """A checkpoint path as a ``str``, with ``storage_options`` (a copy of the root's, None for a
    local path) and ``owner``: the root object that answered, whose ``load(path, **kwargs)``
    reads it (a :class:`txckpt.TieredRoot`), or None. Pickles as a plain ``str``: the owner
    holds threads and locks, and the receiving process has its own roots."""

    storage_options: dict[str, Any] | None
    owner: Any

    def __new__(
        cls, path: str, storage_options: Mapping[str, Any] | None = None, owner: Any = None
    ) -> "CheckpointPath":
        self = super().__new__(cls, path)
        self.storage_options = dict(storage_options) if storage_options else None
        self.owner = owner
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))


_lock = threading.Lock()
_issued: "OrderedDict[str, CheckpointPath]" = OrderedDict()


def issue(path: str | None, storage_options: Mapping[str, Any] | None = None, owner: Any = None) -> str | None:
    """``path`` as a :class:`CheckpointPath` carrying ``storage_options`` and ``owner``, and
    remembered by its text; None stays None, and a path with nothing to carry stays as it is."""
    if path is None or (not storage_options and owner is None):
        return path
    out = CheckpointPath(path, storage_options, owner)
    with _lock:
        _issued[str(out)] = out
        _issued.move_to_end(str(out))
        while len(_issued) > _REMEMBERED:
            _issued.popitem(last=False)
    return out


def issued(path: str | os.PathLike | None) -> CheckpointPath | None:
    """The issued path ``path`` is (itself, or a plain string equal to one), else None."""
    if isinstance(path, CheckpointPath):
        return path
    if path is None:
        return None
    try:
        text = os.fspath(path)
    except TypeError:
        return None
    if not isinstance(text, str):
        return None
    with _lock:
        return _issued.get(text)


def options_for(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The storage options to read ``path`` with: the caller's if given, else the ones its
    lookup carried."""
    if storage_options is not None:
        return storage_options
    known = issued(path)
    return None if known is None else known.storage_options


__all__ = ["CheckpointPath", "issue", "issued", "options_for"]
