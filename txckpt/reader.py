"""Reading a committed checkpoint by its path.

A path that get_last_checkpoint (or ``txckpt ls``) returned lies inside a root, at its public
name ``<root>/checkpoint-N`` or at its home ``<root>/.txckpt/tx/<txid>/checkpoint-N``. Knowing the
root lets a reader do two things the manifest alone cannot (docs/protocol.md §6a):

* **cross-check** the manifest with the log: the digest the commit entry recorded must equal the
  manifest's (a manifest edited and re-digested, copied from another root, or left by a save
  that never committed is refused);
* **follow** a checkpoint that moved between the lookup and the read: on rename backends a
  commit is published (home -> public name) and a fork unpublishes (public name -> home) while
  other processes read. The txid does not change, so the reader locates it again and re-reads.

A path outside any root (a fetched copy in a cache, a directory copied elsewhere) is checked
against its own manifest only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from . import log as commit_log
from .errors import IntegrityError, ManifestError
from .layout import TX_DIR, is_url, parse_checkpoint_name
from .lineage import State
from .manifest import MANIFEST_NAME, Manifest
from .naming import DEFAULT as DEFAULT_NAMING, read_naming, split_public
from .refs import Ref
from .root import CheckpointRoot, open_root
from .storage import open_storage
from .verify import FALLBACK_HINT

_HOME_RE = re.compile(r"^(?P<root>.*)/" + re.escape(TX_DIR) + r"/(?P<txid>[^/]+)/(?P<name>[^/]+)$")


@dataclass(frozen=True)
class RootPath:
    """Where a checkpoint path lies: its root, its key in the root, its step and (for a home
    path) the txid the path names."""

    root: str
    key: str
    step: int
    txid: str | None


def parse(path: str | os.PathLike) -> RootPath | None:
    """The root a checkpoint path lies in, judged by its shape alone (None: no root shape)."""
    p = os.fspath(path)
    if not is_url(p):
        p = os.path.abspath(os.path.expanduser(p))  # as LocalStorage reads it
    p = p.rstrip("/")
    m = _HOME_RE.match(p)
    step = parse_checkpoint_name(m.group("name")) if m else None
    if m and m.group("root") and step is not None:
        return RootPath(m.group("root"), f"{TX_DIR}/{m.group('txid')}/{m.group('name')}", step, m.group("txid"))
    # ``<root>/<prefix><step>``: checkpoint-N, or a root's own naming (txckpt/naming.py), checked
    # against the root's naming once the root is open. No prefix starts with '.' (check_prefix).
    head, _, name = p.rpartition("/")
    split = split_public(name) if not name.startswith(".") else None
    if head and split is not None:
        return RootPath(head, name, split[1], None)
    return None


def enclosing_root(path: str | os.PathLike) -> str | None:
    """The directory that would be the root of the checkpoint directory ``path``: the root its
    shape names (:func:`parse`), else its parent (a directory put into a root by hand, say a
    copy). The caller checks that it has a log."""
    where = parse(path)
    if where is not None:
        return where.root
    p = os.fspath(path)
    if not is_url(p):
        p = os.path.abspath(os.path.expanduser(p))
    parts = p.rstrip("/").rsplit("/", 1)
    return parts[0] if len(parts) == 2 and parts[0] else None


def names_a_checkpoint(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``path`` has the name of a checkpoint of the directory it lies in: a home
    (``.txckpt/tx/<txid>/checkpoint-N``), or ``<prefix>N`` in the naming its parent records
    (checkpoint-N where it records none)."""
    where = parse(path)
    if where is None:
        return False
    if where.txid is not None:
        return True
    try:
        naming = read_naming(open_storage(where.root, storage_options)) or DEFAULT_NAMING
    except Exception:  # an unreadable or damaged naming file: judge by the default
        naming = DEFAULT_NAMING
    return naming.step_of(where.key) == where.step


class RootContext:
    """A checkpoint path's root, opened, when that root has a log."""

    def __init__(self, where: RootPath, root: CheckpointRoot, state: State):
        self.where = where
        self.root = root
        self.state = state  # its newest State, read when the context was opened

    @classmethod
    def open(cls, path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> "RootContext | None":
        where = parse(path)
        if where is None:
            return None
        state = commit_log.read_state(open_storage(where.root, storage_options))
        if state.seq < 0:
            return None  # a directory of plain checkpoints, or a cache: no log to check against
        # Only real roots get a (per-process, cached) CheckpointRoot: its history is folded
        # incrementally across reads of older checkpoints.
        root = open_root(where.root, storage_options)
        if where.txid is None and root.publication.naming.step_of(where.key) != where.step:
            return None  # not a public name of this root (step_4 in a checkpoint-N root)
        return cls(where, root, state)

    def check_committed(self, manifest: Manifest, path: str) -> None:
        """Raise unless ``manifest`` is the one the log committed for its txid.

        The newest entry carries the head lineage's tip with its manifest digest, so
        checking the newest checkpoint (what a resume loads) costs the two reads of a lookup;
        an older one folds the log (cached and extended incrementally per process)."""
        digest = None
        for info in self.state.lineages.values():
            tip = info.tip
            if tip is not None and tip.txid == manifest.txid and tip.digest:
                digest = tip.digest
                break
        if digest is None:
            digest = self.root.history().committed_digest(manifest.txid)
        if digest is None:
            raise ManifestError(
                f"{path} holds the manifest of txid {manifest.txid}, which {self.root.url} never "
                "committed (a save that did not finish, or a checkpoint copied from another root): "
                "load a checkpoint listed by `txckpt ls`, or copy the directory out of the root "
                "to read it on its own manifest's word"
            )
        if digest != manifest.digest:
            raise IntegrityError(
                f"{path}/{MANIFEST_NAME} is not the manifest the log committed for txid "
                f"{manifest.txid} (digest {manifest.digest}, the commit entry recorded {digest}): "
                "it was edited or replaced after the commit; the checkpoint is damaged; "
                f"{FALLBACK_HINT} (`txckpt verify` lists what else is wrong)", path=f"{path}/{MANIFEST_NAME}",
            )

    def moved_to(self, txid: str | None) -> str | None:
        """Where the checkpoint of ``txid`` at this path's step is now, if not at this path."""
        txid = txid or self.where.txid
        if not txid:
            return None
        # The path does not say the lineage, and where a checkpoint lives does not depend on it
        # (the publication reads a ref's txid, step and key): the ref names it by txid and step.
        key = self.root.publication.locate(Ref("", self.where.step, txid))
        if key is None or key == self.where.key:
            return None
        return self.root.storage.full_path(key)
