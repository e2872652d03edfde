"""Where a committed checkpoint lives, and how it gets its public name.

Two strategies, chosen by the storage's ``atomic_dir_rename``:

* :class:`RenamePublication` (local disks): a committed checkpoint of the current lineage is
  renamed from its home ``.txckpt/tx/<txid>/checkpoint-N`` to its public name, ``checkpoint-N``
  or the root's naming (``txckpt/_base/naming.py``: ``checkpoint_N`` for accelerate), so plain tools
  (``from_pretrained``, a stock Trainer) read it. A checkpoint that loses the name (another
  lineage's, after a rollback) is renamed back to its own home: never overwritten, never deleted.
* :class:`InPlacePublication` (object stores): a checkpoint stays where it was written, since a
  "rename" there is a copy. Its path is its home.

This module is the only one that knows where a checkpoint lives: its final key
(:meth:`~InPlacePublication.final_key`), publishing and unpublishing it, and removing a retired
one (:meth:`~InPlacePublication.remove`); nothing above ``storage/`` but :func:`publication_for`
reads ``atomic_dir_rename``.

Publication is derived state: the log alone says what is committed, and where a checkpoint is
can always be found from its txid, so a crash between two renames loses nothing; the next
publication (or ``txckpt gc``) completes it.
"""

from __future__ import annotations

import json
import logging
import posixpath
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from ..errors import SpecialFileError

# TX_DIR, ORPHANS_DIR and home_key are layout's; importable from here as before.
from .._base.layout import MANIFEST_NAME, entry_key, home_key, orphan_key, retiring_key, tx_key
from .._base.naming import DEFAULT, Naming, read_naming
from .._base.refs import Ref
from .._storage.base import Storage

if TYPE_CHECKING:  # pragma: no cover
    from .lineage import Checkpoint, History, State

log = logging.getLogger("txckpt")

#: How many times a lookup follows a tip that was retired and deleted under it (protocol §6 step 4).
LOOKUP_ATTEMPTS = 16


class Session(Protocol):
    """What this process remembers about one root, shared by every spelling of it
    (:class:`txckpt._log.identity.SessionState`): the writer session and the states it has read."""

    writer_lineage: str | None
    session: str
    folded_history: "History | None"
    base_states: "dict[str, State]"
    known_state: "State | None"
    staging_reclaimed: bool
    part_structures: bytes | None
    on_commit: "dict[str, Callable[[], None]]"
    retention_guards: "dict[str, Callable[[], set[str]]]"


class Root(Protocol):
    """What the modules below the root facade (the commit room, the transaction, adoption,
    fallback, intents, retention, gc) use of a :class:`txckpt._root.root.CheckpointRoot`: they take
    this instead of importing root.py, so imports run downward only. Lineage changes are
    :mod:`txckpt._log.commit`'s functions of a ``Root``, not methods of it."""

    storage: Storage
    storage_options: dict[str, Any]
    durable: bool
    session: str
    staging_reclaimed: bool

    @property
    def shared(self) -> Session: ...

    @property
    def publication(self) -> "InPlacePublication": ...

    @property
    def url(self) -> str: ...

    def state(self) -> "State": ...

    def history(self, *, snapshot: bool = False) -> "History": ...

    def append_entry(
        self,
        build: Callable[..., dict[str, Any]],
        *,
        start: "State | None" = None,
        update_hint: bool = True,
        on_full: Any = None,
    ) -> dict[str, Any]: ...

    def describe(
        self, chosen: "Iterable[Checkpoint]", *, with_paths: bool = True, history: "History | None" = None
    ) -> list[Any]: ...

    def legacy_checkpoints(self) -> list[int]: ...

    def adopt(self) -> str | None: ...


def public_key(step: int, naming: Naming = DEFAULT) -> str:
    return naming.public(step)


def manifest_txid(storage: Storage, key: str) -> str | None:
    """The txid the manifest in directory ``key`` names; None if it has none ("" if unreadable)."""
    try:
        data = storage.read_bytes(f"{key}/{MANIFEST_NAME}")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except SpecialFileError:
        return ""  # a FIFO (socket, device) where the manifest was: unreadable, never waited on
    try:
        return str(json.loads(data).get("txid", ""))
    except (ValueError, AttributeError, UnicodeDecodeError):
        return ""


#: ``txid -> (ref of that committed checkpoint, whether it is current)``, or None if the log has not
#: committed it: what a deletion that caught another checkpoint needs to put it back.
Resolve = Callable[[str | None], "tuple[Ref, bool] | None"]


class InPlacePublication:
    """Object stores: a checkpoint stays where it was written (its home, or an adopted key)."""

    #: Whether committed checkpoints get public names (moved there from their homes).
    publishes = False

    def __init__(self, storage: Storage, durable: bool = True):
        self.storage = storage
        self.durable = durable
        self._naming: Naming | None = None

    @property
    def naming(self) -> Naming:
        """The root's naming (``.txckpt/naming``, else ``checkpoint-N``), read once it is fixed:
        the file is created before the root's first entry, so with entry 0 present and no
        file the default holds for good. Only public names need it (never an object store's
        lookup, which costs no extra request)."""
        if self._naming is None:
            found = read_naming(self.storage)
            if found is not None:
                self._naming = found
            elif self.storage.exists(entry_key(0)):
                self._naming = DEFAULT
            else:
                return DEFAULT  # not fixed yet: read again next time
        return self._naming

    @naming.setter
    def naming(self, value: Naming) -> None:
        self._naming = value

    def public_key(self, step: int) -> str:
        return self.naming.public(step)

    def _sync(self, key: str) -> None:
        if self.durable:
            self.storage.sync_dir(key)

    def candidates(self, ref: Ref) -> list[str]:
        keys = [home_key(ref.txid, ref.step)]
        if ref.key:
            keys.insert(0, ref.key)
        return keys

    def locate(self, ref: Ref) -> str | None:
        """The key where the committed checkpoint ``ref`` is now, or None if it is gone."""
        return self._holding(ref, self.candidates(ref))

    def _holding(self, ref: Ref, keys: list[str]) -> str | None:
        """The first of ``keys`` that holds the committed checkpoint ``ref``, or None."""
        for key in keys:
            if manifest_txid(self.storage, key) == ref.txid:
                return key
        return None

    def publish(self, ref: Ref, at: str | None = None) -> str | None:
        return at if at is not None else self.locate(ref)

    def unpublish(self, keep: set[str], known: set[str]) -> list[str]:
        return []

    def publish_missing(self, refs: list[Ref]) -> list[str]:
        return []

    def unpublish_refs(self, refs: list[Ref]) -> list[str]:
        """Move each of ``refs`` that holds its public name back to its home (after a fork:
        the checkpoints it abandoned). Returns the names moved."""
        return []

    def misplaced(self, keep: set[str], known: set[str]) -> list[tuple[str, str]]:
        """(public name, txid) of what :meth:`unpublish` would move back (a dry run)."""
        return []

    def unpublished(self, refs: list[Ref]) -> list[Ref]:
        """The refs of ``refs`` whose data is present but lacks its public name."""
        return []

    def final_key(self, step: int, staging_key: str) -> str:
        """Where a save of ``step`` staged at ``staging_key`` will be once committed."""
        return staging_key

    def _out_of_sight(self, ref: Ref, key: str, resolve: Resolve) -> str | None:
        """The key to delete committed checkpoint ``ref`` (found at ``key``) from; None: look again.
        Here: where it is (its manifest goes first, so a partly deleted one is never taken for
        committed)."""
        return key

    def remove(self, ref: Ref, resolve: Resolve) -> list[str]:
        """Delete the data of committed (retired) checkpoint ``ref``; returns the keys removed.
        Safe to repeat after a crash (protocol §11). ``resolve``: see :data:`Resolve`."""
        s = self.storage
        removed: list[str] = []
        txdir = tx_key(ref.txid)
        for _ in range(16):
            key = self.locate(ref)
            if key is None:
                break
            target = self._out_of_sight(ref, key, resolve)
            if target is None:
                continue
            if target != key:
                removed.append(key)
            s.delete_file(f"{target}/{MANIFEST_NAME}")
            s.delete_tree(target)
            if target not in removed:
                removed.append(target)
        if s.exists(txdir):
            s.delete_tree(txdir)
            if txdir not in removed:
                removed.append(txdir)
        return removed


class RenamePublication(InPlacePublication):
    """Rename backends (local disks): committed checkpoints of the current lineage are renamed
    from their homes to their public names, and back when they lose them."""

    publishes = True

    def final_key(self, step: int, staging_key: str) -> str:
        return self.public_key(step)

    def misplaced(self, keep: set[str], known: set[str]) -> list[tuple[str, str]]:
        out = []
        naming = self.naming
        for name in self.storage.list_dir(""):
            if naming.step_of(name) is not None:
                occupant = manifest_txid(self.storage, name)
                if occupant and occupant in known and occupant not in keep:
                    out.append((name, occupant))
        return out

    def unpublished(self, refs: list[Ref]) -> list[Ref]:
        out = []
        for r in refs:
            key = self.locate(r)
            if key is not None and key != self.public_key(r.step):
                out.append(r)
        return out

    def _out_of_sight(self, ref: Ref, key: str, resolve: Resolve) -> str | None:
        """A published ``checkpoint-N`` (or an adopted checkpoint's own directory) is first
        renamed to ``.txckpt/tx/<txid>/retiring-<rnd>``, so no reader ever sees a half-deleted
        ``checkpoint-N``."""
        s = self.storage
        txdir = tx_key(ref.txid)
        if key.startswith(txdir + "/"):
            return key
        # A concurrent publication may put another checkpoint under this name between locate
        # and rename: the rename target is private, and whatever was moved is checked before
        # anything is deleted.
        aside = retiring_key(ref.txid)
        try:
            s.rename_noreplace(key, aside)
        except (FileNotFoundError, FileExistsError):
            return None
        moved = manifest_txid(s, aside)
        if moved != ref.txid:
            self._put_back(aside, key, moved, resolve)
            return None
        if self.durable:
            s.sync_dir(txdir)
            s.sync_dir(posixpath.dirname(key))
        return aside

    def _put_back(self, aside: str, key: str, txid: str | None, resolve: Resolve) -> None:
        """Undo a rename that caught a checkpoint other than the one being deleted (a race with a
        publication): back to its name, or to its own home, or (not committed) to the orphans."""
        s = self.storage
        other = resolve(txid)
        targets = [key]
        if other is not None:
            targets.append(home_key(other[0].txid, other[0].step))
        targets.append(orphan_key(posixpath.basename(key)))
        for dst in targets:
            try:
                s.rename_noreplace(aside, dst)
            except FileExistsError:
                continue
            log.warning("retention raced with a publication of %s; put it back at %s", key, dst)
            if other is not None and dst != key and other[1]:
                self.publish(other[0])
            return

    def candidates(self, ref: Ref) -> list[str]:
        keys = super().candidates(ref)
        pub = self.public_key(ref.step)
        return [pub] + [k for k in keys if k != pub]

    def publish(self, ref: Ref, at: str | None = None) -> str | None:
        """Give committed checkpoint ``ref`` its public name (``checkpoint-<step>``). Returns its key.
        ``at``: where the caller has just committed it (its home), so the first try renames
        from there without reading its manifest back; another process's publication that
        moved it meanwhile makes the rename miss, and the next try looks for it."""
        s = self.storage
        pub = self.public_key(ref.step)
        if at is not None and at != pub:
            # The committer's case: the name is almost always free, so rename first (NOREPLACE
            # keeps whatever does hold it) instead of reading and stat-ing the name beforehand.
            try:
                s.rename_noreplace(at, pub)
            except FileExistsError:
                pass  # the name is held: the loop looks at what holds it; ours is still at `at`
            except FileNotFoundError:
                at = None  # moved meanwhile (another publisher): the loop locates it
            else:
                self._sync("")
                return pub
        for _ in range(8):
            occupant = manifest_txid(s, pub)
            if occupant == ref.txid:
                return pub
            # locate(ref), pub first read just above: the other candidates, then pub again only
            # if the checkpoint is in none of them (it got there meanwhile).
            src = at if at is not None and at != pub else None
            if src is None:
                others = [k for k in super().candidates(ref) if k != pub]
                src = self._holding(ref, others) or self._holding(ref, [pub])
            at = None
            if src is None:
                return None
            if s.exists(pub):
                self._evict(pub, ref.step, occupant)
            try:
                s.rename_noreplace(src, pub)
            except (FileExistsError, FileNotFoundError):
                continue  # someone re-created the name, or moved the checkpoint, since we looked
            # One directory fsync makes the rename durable on journaling filesystems; and
            # publication is derived state: if it were lost, lookups find the home instead.
            self._sync("")
            return pub
        return self.locate(ref)

    def _evict(self, pub: str, step: int, occupant: str | None) -> None:
        """Move whatever holds ``pub`` to a name of its own, so nothing is overwritten."""
        s = self.storage
        if occupant:
            dst = home_key(occupant, step)
            if s.exists(dst):  # its home is taken (should not happen): keep both, aside
                dst = orphan_key(pub, occupant)
        else:
            dst = orphan_key(pub)
            log.warning(
                "%s has no committed txckpt manifest (written by another tool?); moved it "
                "to %s instead of overwriting it. Inspect it, then delete it or `txckpt adopt` it.",
                s.full_path(pub),
                s.full_path(dst),
            )
        try:
            s.rename_noreplace(pub, dst)
        except FileNotFoundError:
            return  # someone else moved it already
        self._sync(dst.rsplit("/", 1)[0])
        self._sync("")

    def unpublish(self, keep: set[str], known: set[str]) -> list[str]:
        """Move published checkpoints whose txid is committed (in ``known``) but not in ``keep``
        (the current lineage) back to their homes. Returns the names moved."""
        moved = []
        naming = self.naming
        for name in self.storage.list_dir(""):
            step = naming.step_of(name)
            if step is None:
                continue
            occupant = manifest_txid(self.storage, name)
            if occupant and occupant in known and occupant not in keep:
                self._evict(name, step, occupant)
                moved.append(name)
        return moved

    def unpublish_refs(self, refs: list[Ref]) -> list[str]:
        moved = []
        for r in refs:
            names = [self.public_key(r.step)]
            if r.key and r.key not in names and self.naming.step_of(r.key) == r.step:
                # An adopted checkpoint holds the name it was found at (zero-padded, say).
                names.append(r.key)
            for name in names:
                if manifest_txid(self.storage, name) == r.txid:
                    self._evict(name, r.step, r.txid)
                    moved.append(name)
        return moved

    def publish_missing(self, refs: list[Ref]) -> list[str]:
        """Publish every committed ref of ``refs`` (the head's view) that does not hold its
        ``checkpoint-N`` name: after a fork that restores checkpoints another fork abandoned.
        One listing of the root and one manifest read per name present; refs whose data is
        missing are skipped. Returns the names given."""
        if not refs:
            return []  # (a rollback restores nothing: no listing of a root of thousands of names)
        names = set(self.storage.list_dir(""))
        given = []
        for r in refs:
            pub = self.public_key(r.step)
            if pub in names and manifest_txid(self.storage, pub) == r.txid:
                continue
            if self.publish(r) == pub:
                given.append(pub)
        return given


def publication_for(storage: Storage, durable: bool = True) -> InPlacePublication:
    cls = RenamePublication if storage.atomic_dir_rename else InPlacePublication
    return cls(storage, durable)


# TX_DIR, ORPHANS_DIR, home_key: re-exported for callers that import them from here (layout owns them).
__all__ = [
    "Root",
    "Session",
    "LOOKUP_ATTEMPTS",
    "InPlacePublication",
    "RenamePublication",
    "publication_for",
    "public_key",
    "manifest_txid",
]
