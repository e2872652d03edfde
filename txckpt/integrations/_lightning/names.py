"""The names Lightning gives checkpoints, resolved to txckpt's committed checkpoints.

Lightning hands a ``CheckpointIO`` a file path (``dirpath/epoch=0-step=10.ckpt``) and later
passes the same path to load and remove, and users ``torch.load`` it. A txckpt checkpoint is a
committed directory holding that one file (under the name of its first save) and its manifest.
The user-facing name is derived state, like txckpt's own ``checkpoint-N`` publication:

* on a local root, ``dirpath/<name>.ckpt`` is a hard link to the committed file (same inode, the
  same committed bytes: never a second write), replaced atomically (a link under a temp name
  renamed over it), so stock ``torch.load`` reads it;
* on an object store there is no link: the name is resolved through the log (the committed
  checkpoint whose manifest lists that file name; ``last*.ckpt``: the current lineage's newest).

This module owns that mapping (docs/lightning.md, "Layout"); the plugin
(:mod:`txckpt.integrations.lightning`) owns when it changes.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ...errors import CheckpointNotFoundError
from ..._base.fileio import fsync_dir, rename_exchange
from ..._base.layout import MANIFEST_NAME, is_url, temp_name, temp_target
from ..._log.lineage import Checkpoint, History
from ..._manifest.manifest import Manifest
from ..._read.reader import parse
from ..._root.root import CheckpointRoot, open_root
from .._dcp.compat import DEFAULT_SUFFIX
from .sharded import META_NAME, METADATA_NAME, is_sharded_files

log = logging.getLogger("txckpt")

#: ModelCheckpoint's ``CHECKPOINT_NAME_LAST``: ``last.ckpt`` and its versions ``last-v1.ckpt``.
_LAST = "last"
#: ``step=N`` in a name (ModelCheckpoint's default ``{epoch}-{step}``): which checkpoint to try first.
_STEP_KEY = "step="


@dataclass(frozen=True)
class Resolved:
    """Where a Lightning path's bytes are committed: the root, the checkpoint (its full path,
    which :func:`txckpt.load_checkpoint` verifies), the file in it, and its log record."""

    root: str
    checkpoint: str
    file: str
    record: Checkpoint


def split(path: str | os.PathLike, root: str | None) -> tuple[str, str]:
    """(root, name) of a path Lightning gives: the plugin's root if it was given, else the
    path's directory (the ModelCheckpoint's ``dirpath``); the name is the path's last part."""
    p = os.fspath(path)
    head, _, name = p.rstrip("/").rpartition("/")
    if not is_url(p):
        head, name = os.path.split(os.path.abspath(os.path.expanduser(p)))
    return (root if root is not None else head), name


def is_last(name: str) -> bool:
    """Whether ``name`` is a ``last`` name: the current lineage's newest, whatever it links to.
    (Lightning's names, not txckpt's checkpoint names: string tests, as ModelCheckpoint's own.)"""
    stem = name.rsplit(".", 1)[0] if "." in name else name
    version = stem[len(_LAST) + 2 :]
    return stem == _LAST or (stem.startswith(_LAST + "-v") and version.isdigit())


def _step_hint(name: str) -> int | None:
    at = name.find(_STEP_KEY)
    if at < 0 or (at > 0 and (name[at - 1].isalnum() or name[at - 1] == "_")):
        return None
    digits = ""
    for ch in name[at + len(_STEP_KEY) :]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def is_local(r: CheckpointRoot) -> bool:
    return r.storage.local_path("") is not None


def committed_file(manifest: Manifest) -> str:
    """The one Lightning file a checkpoint this plugin committed holds; ``""`` for a sharded
    strategy's checkpoint (sharded.py), which is the whole directory (DCP's shards, ``.metadata``
    and ``meta.pt``), as stock Lightning's checkpoint path is a directory."""
    names = sorted(manifest.files)
    if is_sharded_files(names):
        return ""
    if len(names) != 1:
        raise CheckpointNotFoundError(
            f"checkpoint {manifest.txid} holds {len(names)} files ({', '.join(names[:4])}), not the one "
            "Lightning file a TransactionalCheckpointIO save commits; load it with txckpt.load_checkpoint"
        )
    return names[0]


def read_manifest_of(r: CheckpointRoot, c: Checkpoint) -> tuple[str, Manifest] | None:
    where = r.locate(c.ref)
    if where is None:
        return None
    key = r.storage.key_of(where)
    try:
        return where, Manifest.decode(r.storage.read_bytes(f"{key}/{MANIFEST_NAME}"), f"{where}/{MANIFEST_NAME}")
    except FileNotFoundError:  # moved or retired under us: not this one
        return None


def _candidates(history: History, name: str) -> Iterator[Checkpoint]:
    """Every live committed checkpoint, the current lineage's first, newest first; those whose
    step the name spells (``step=N``) before all others, so the usual lookup reads one manifest."""
    current = list(history.in_view(None))
    seen = {c.txid for c in current}
    rest = [c for c in history.checkpoints.values() if c.txid not in seen and c.txid not in history.retired]
    ordered = sorted(current, key=lambda c: -c.step) + sorted(rest, key=lambda c: -c.step)
    step = _step_hint(name)
    if step is not None:
        ordered = [c for c in ordered if c.step == step] + [c for c in ordered if c.step != step]
    return iter(ordered)


def newest(r: CheckpointRoot) -> Resolved | None:
    """The current lineage's newest committed checkpoint: what ``last`` means (protocol §6)."""
    key = r.last_checkpoint_key()
    if key is None:
        return None
    state = r.state()
    tip = state.head_tip
    history = r.history()
    record = history.checkpoints.get(tip.txid) if tip is not None and tip.txid else None
    if record is None:  # an adopted or legacy tip: not a Lightning checkpoint of this plugin
        return None
    where = r.storage.full_path(key)
    manifest = Manifest.decode(r.storage.read_bytes(f"{key}/{MANIFEST_NAME}"), f"{where}/{MANIFEST_NAME}")
    return Resolved(r.url, where, committed_file(manifest), record)


def resolve(path: str | os.PathLike, root: str | None, storage_options: Mapping[str, Any] | None) -> Resolved | None:
    """The committed checkpoint a Lightning path names, or None if no committed checkpoint of
    its root does (a root without a log, a file txckpt did not write)."""
    p = os.fspath(path)
    inside = _inside_checkpoint(p, storage_options)
    if inside is not None:
        return inside
    root_path, name = split(p, root)
    r = open_root(root_path, storage_options)
    try:
        if r.state().seq < 0:
            return None
    except FileNotFoundError:
        return None
    if is_last(name):
        return newest(r)
    # A local published name: a hard link to the committed file, or (a sharded checkpoint) a
    # directory of hard links, known by its .metadata's inode.
    link = (_inode(os.path.join(p, METADATA_NAME)) if os.path.isdir(p) else _inode(p)) if is_local(r) else None
    for c in _candidates(r.history(), name):
        found = read_manifest_of(r, c)
        if found is None:
            continue
        where, manifest = found
        if name in manifest.files:
            return Resolved(r.url, where, name, c)
        if link is not None:
            try:
                file = committed_file(manifest)
            except CheckpointNotFoundError:
                continue
            if _inode(os.path.join(where, file or METADATA_NAME)) == link:
                return Resolved(r.url, where, file, c)
    return None


def _inside_checkpoint(p: str, storage_options: Mapping[str, Any] | None) -> Resolved | None:
    """A path to the file inside a committed checkpoint (what ``ckpt_path="last"`` resolves to),
    or to a committed sharded checkpoint itself (its ``"last"``)."""
    found = _the_checkpoint(p, "", storage_options)
    if found is not None:
        return found
    head, _, name = p.rstrip("/").rpartition("/")
    if not is_url(p):
        head, name = os.path.split(os.path.abspath(os.path.expanduser(p)))
    return _the_checkpoint(head, name, storage_options)


def _the_checkpoint(head: str, name: str, storage_options: Mapping[str, Any] | None) -> Resolved | None:
    """Committed checkpoint ``head`` if it holds Lightning file ``name`` (``""``: if it is a
    sharded strategy's checkpoint); None otherwise."""
    where = parse(head) if head else None  # checkpoint-N/ or a home: the shape alone, no I/O
    if where is None:
        return None
    r = open_root(where.root, storage_options)
    key = r.storage.key_of(head)
    if key is None:
        return None
    try:
        data = r.storage.read_bytes(f"{key}/{MANIFEST_NAME}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    manifest = Manifest.decode(data, f"{head}/{MANIFEST_NAME}")
    record = r.history().checkpoints.get(manifest.txid)
    if record is None or (name not in manifest.files if name else not is_sharded_files(manifest.files)):
        return None
    return Resolved(r.url, head, name, record)


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def set_aside_foreign(path: str, aside: str) -> bool:
    """Before a name is published at local ``path``: move whatever holds it to ``aside`` (the
    root's orphans, protocol §7's place for what txckpt must not overwrite) where it is more
    than names of committed bytes: a file that is the only link to its bytes, a directory
    holding one or a directory of its own (a stock checkpoint of an earlier run, say, where
    ``ModelCheckpoint(enable_version_counter=False)`` reuses its name). Names of committed
    bytes (this plugin's links, a link to a checkpoint that has since been retired aside) are
    left to be replaced: their bytes stay where they are committed. Returns whether it moved
    anything."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        with os.scandir(path) as it:
            foreign = any(
                e.is_dir(follow_symlinks=False)
                or (e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_nlink < 2)
                for e in it
            )
    else:
        foreign = stat.S_ISREG(st.st_mode) and st.st_nlink < 2
    if not foreign:
        return False
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.rename(path, aside)
    log.warning(
        "%s held a checkpoint txckpt did not commit (its bytes have no other name); moved it to %s "
        "instead of publishing over it. Inspect it, then delete it or keep it.",
        path,
        aside,
    )
    return True


def link_name(committed: str, path: str, *, durable: bool, aside: str) -> None:
    """Make local ``path`` a hard link to the committed file ``committed``: linked under a temp
    name in the same directory, then renamed over ``path``, so a reader sees the old bytes or
    the new ones, never a partial name. Whatever ``path`` named before keeps its bytes where they
    are committed (another lineage's checkpoint loses a name, never data), and a file whose bytes
    are committed nowhere goes to ``aside`` first (:func:`set_aside_foreign`)."""
    directory, name = os.path.split(path)
    _remove_leftover_links(directory, name)
    set_aside_foreign(path, aside)
    tmp = os.path.join(directory, temp_name(name, hidden=True))
    os.link(committed, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)


def publish_dir(committed: str, path: str, *, durable: bool, aside: str) -> None:
    """Make local ``path`` a directory of hard links to the committed checkpoint's DCP files and
    ``meta.pt`` (stock Lightning's layout of a sharded checkpoint: DCP's ``FileSystemReader`` and
    ``torch.load`` of ``meta.pt`` read it; never a second write; txckpt's own files stay out). Built under a temp name, then
    renamed into place; a directory of links already at ``path`` (the bytes stay committed) is
    swapped out in the same step where the kernel can, and removed after; anything else there
    goes to ``aside`` first (:func:`set_aside_foreign`: never deleted)."""
    parent, name = os.path.split(path)
    _remove_leftover_links(parent, name)
    set_aside_foreign(path, aside)
    tmp = os.path.join(parent, temp_name(name, hidden=True))
    os.mkdir(tmp)
    try:
        for n in sorted(os.listdir(committed)):
            if n in (METADATA_NAME, META_NAME) or n.endswith(DEFAULT_SUFFIX):
                os.link(os.path.join(committed, n), os.path.join(tmp, n))
        old = None
        if os.path.isdir(path) and not os.path.islink(path):
            if rename_exchange(tmp, path):  # one step: the name is never absent
                old = tmp
            else:  # no RENAME_EXCHANGE here: two renames, the name absent in between
                old = os.path.join(parent, temp_name(name, hidden=True))
                os.rename(path, old)
                os.rename(tmp, path)
        else:
            if os.path.lexists(path):
                os.unlink(path)
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old)


def unpublish_dir(path: str) -> None:
    """Remove a published directory (hard links: the committed bytes stay where they are)."""
    shutil.rmtree(path)


def _remove_leftover_links(directory: str, name: str) -> None:
    """A crash between the link and the rename leaves ``.<name>.<12 hex>.tmp``: one more link to
    committed bytes (never a partial file); a crash while :func:`publish_dir` builds or swaps a
    directory of links leaves a directory of that name, holding links to committed files only.
    Only this plugin makes such names of ``name`` (one writer per root), so the next publication
    of the same name removes them. A directory holding a directory is not one of ours: kept."""
    prefix = "." + name + "."
    with os.scandir(directory) as it:
        leftovers = [e for e in it if e.name.startswith(prefix) and temp_target(e.name) == name]
    for e in leftovers:
        try:
            if e.is_dir(follow_symlinks=False):
                with os.scandir(e.path) as inside:
                    if any(f.is_dir(follow_symlinks=False) for f in inside):
                        continue
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
        except FileNotFoundError:
            pass


def names_in(directory: str, committed: str, *, besides: str | None = None) -> list[str]:
    """The names in ``directory`` (a local root's top level) that are links to the committed
    file ``committed`` (a committed sharded checkpoint's directory: the directories of links to
    its files), ``besides`` aside. A scan, not the link count: an incremental save's
    shared files are links between checkpoints too (docs/incremental.md)."""
    # A sharded strategy's checkpoint (a directory): its names are directories of links, known
    # by their .metadata's inode.
    sharded = os.path.isdir(committed)
    own = _inode(os.path.join(committed, METADATA_NAME) if sharded else committed)
    itself = _inode(committed)  # the committed directory is in the root's top level too: not a name
    if own is None:
        return []
    found = []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name == besides or entry.name.startswith("."):
                continue
            if sharded:
                if (
                    entry.is_dir(follow_symlinks=False)
                    and _inode(entry.path) != itself
                    and _inode(os.path.join(entry.path, METADATA_NAME)) == own
                ):
                    found.append(entry.name)
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            if (st.st_dev, st.st_ino) == own:
                found.append(entry.name)
    return found


__all__ = [
    "Resolved",
    "split",
    "is_last",
    "is_local",
    "committed_file",
    "newest",
    "resolve",
    "link_name",
    "names_in",
    "set_aside_foreign",
    "publish_dir",
    "unpublish_dir",
]
