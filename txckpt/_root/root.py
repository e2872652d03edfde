"""A txckpt root: lookup, resume/fork, adoption, and the commit of a transaction.

:class:`CheckpointRoot` is the object behind the functional API. It remembers which lineage
this process writes (set by ``resume``, ``new_lineage`` or the first save), so that a stale
writer (a zombie job beside its restart) is refused instead of writing into a lineage that an
operator has abandoned.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, ClassVar, Iterable, Mapping

from . import adoption
from .._log import log as commit_log
from .._maintenance import retention
from .._log.commit import append, claim, fork, new_lineage, note_state
from ..errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    LookupRaceError,
    RootNotFoundError,
)

# root_key: identity.py's (which spellings name one root); importable from here, as asyncsave does.
from .._log.identity import SessionState, Shared, root_names
from .fallback import check_on_damaged, present_fallback, resume_intact
from .._base.layout import TX_DIR, parse_checkpoint_name
from .._log.lineage import (  # CheckpointInfo: importable from here, as txckpt/__init__ does
    Checkpoint,
    CheckpointInfo,
    History,
    State,
)
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import Manifest, check_step, read_manifest_at

# LOOKUP_ATTEMPTS lives below the root (fallback follows retired tips too); importable from here.
from .._log.publication import LOOKUP_ATTEMPTS, publication_for
from .._base.refs import Ref, same_ref
from .._storage.base import Storage
from .._storage import open_storage
from .._storage.errors import missing_bucket_error
from .._save.transactions import Transaction, save_files

log = logging.getLogger("txckpt")


def durable_default() -> bool:
    """fsync is on unless TXCKPT_DURABLE=0 (documented: tests and throwaway runs only)."""
    return os.environ.get("TXCKPT_DURABLE", "1").strip().lower() not in ("0", "false", "no", "off")


class CheckpointRoot:
    """One root (an output_dir or an fsspec URL) and this process's place in it."""

    #: ``root -> (path -> path)``: how ``resume(on_damaged="fallback")`` checks a checkpoint when
    #: the caller gives no ``verify``: the check a load makes (txckpt._api sets it to
    #: ``verify_checkpoint``; the verify engine is above this module, so it is handed down).
    default_verify: ClassVar[Callable[["CheckpointRoot"], Callable[[str], str]] | None] = None

    def __init__(
        self,
        root: str | os.PathLike,
        storage_options: Mapping[str, Any] | None = None,
        *,
        durable: bool | None = None,
        storage: Storage | None = None,
        shared: SessionState | None = None,
        incremental: bool = False,
    ):
        self.storage = storage if storage is not None else open_storage(root, storage_options)
        self.storage_options = dict(storage_options or {})
        self.durable = durable_default() if durable is None else bool(durable)
        self.publication = publication_for(self.storage, self.durable)
        #: The session and states this process holds for the root, shared by its spellings'
        #: objects (open_root; identity.py documents the fields below).
        self.shared = shared if shared is not None else SessionState()
        #: What this object's saves do unless told (``transaction``/``save(incremental=...)``):
        #: share the files a committed checkpoint already holds (docs/incremental.md).
        self.incremental = bool(incremental)

    writer_lineage = Shared[str | None]()
    session = Shared[str]()
    folded_history = Shared[History | None]()
    base_states = Shared[dict[str, State]]()
    known_state = Shared[State | None]()
    staging_reclaimed = Shared[bool]()

    @property
    def url(self) -> str:
        return self.storage.full_path("")

    # ----- reading the log ---------------------------------------------------------------------
    def state(self) -> State:
        state = commit_log.read_state(self.storage)
        self._note_state(state)
        return state

    def _note_state(self, state: State) -> None:
        note_state(self, state)

    def append_entry(
        self, build: Any, *, start: State | None = None, update_hint: bool = True, on_full: Any = None
    ) -> dict[str, Any]:
        """Append one log entry and remember the state it made (:func:`txckpt._log.commit.append`)."""
        return append(self, build, start=start, update_hint=update_hint, on_full=on_full)

    def history(self, *, snapshot: bool = False) -> History:
        """Every entry folded; cached and extended incrementally on each call. A fresh fold
        starts from the newest history snapshot (protocol §4a).

        ``snapshot``: leave a new snapshot if this fold read many entries past the last one.
        Operations that already write to the root pass it (retention, gc, forks); plain readers
        do not, so reading never needs write access."""
        session = self.shared  # the fold is the session's, shared by every spelling of the root
        with session.fold_lock:  # threads (an async save's commit, a lookup beside it) fold one at a time
            history = commit_log.read_history(self.storage, session.folded_history)
            session.folded_history = history
        self._note_state(history.state)
        if snapshot and commit_log.write_snapshot_if_due(self.storage, history, durable=self.durable):
            history.snapshot_seq = history.state.seq
        return history

    def legacy_checkpoints(self) -> list[int]:
        """Steps of plain checkpoint-N directories (a root written without txckpt)."""
        step_of = self.publication.naming.step_of
        return sorted({n for n in map(step_of, self.storage.list_subdirs("")) if n is not None})

    def legacy_dirs(self) -> list[tuple[int, str]]:
        """(step, name) of the checkpoint-N directories as they are named (``checkpoint-00500``);
        two names for one step raise AmbiguousCheckpointNameError."""
        return adoption.legacy_dirs(self)

    def path_of(self, key: str) -> str:
        return self.storage.full_path(key)

    def locate(self, r: Ref) -> str | None:
        key = self.publication.locate(r)
        return None if key is None else self.storage.full_path(key)

    # ----- lookup ------------------------------------------------------------------------------
    def get_last_checkpoint(self) -> str | None:
        """The newest committed checkpoint of the current lineage (its full path), or None.

        A root without a log (written by a stock Trainer) is read the way transformers reads it,
        with a warning: the highest checkpoint-N.
        """
        key = self.last_checkpoint_key()
        return None if key is None else self.storage.full_path(key)

    def last_checkpoint_key(self) -> str | None:
        """:meth:`get_last_checkpoint` as a key inside the root (protocol §6)."""
        state = self.state()
        if state.seq < 0:
            self.require_exists()
            dirs = self.legacy_dirs()
            if not dirs:
                self._warn_if_checkpoint_dir()
                return None
            log.warning(
                "%s has no txckpt log; using the highest checkpoint-N (%s) the way "
                "transformers does, without lineage or integrity checks. The first txckpt save "
                "adopts these checkpoints (or run `txckpt adopt`).",
                self.url,
                dirs[-1][1],
            )
            return dirs[-1][1]
        missed: set[str] = set()
        for _ in range(LOOKUP_ATTEMPTS):
            tip = state.head_tip
            if tip is None:
                return None
            key = self.publication.locate(tip)
            if key is not None:
                return key
            # The tip is not where its ref says. Either the log moved on since this process read
            # it (newer saves made the tip retirable and retention deleted it, or a publication
            # renamed it between two of locate's reads): read the log again and follow the new
            # tip; or, with the log unchanged on a second miss, its data was deleted by hand.
            fresh = self.state()
            if same_ref(fresh.head_tip, tip):
                if tip.txid in missed:
                    return present_fallback(self, tip)
                missed.add(tip.txid)
            state = fresh
        raise LookupRaceError(
            f"the newest checkpoint of {self.url} was retired and deleted under this lookup "
            f"{LOOKUP_ATTEMPTS} times in a row (a writer rotating with a small keep_last faster than "
            "this reader reads); retry, keep more checkpoints, or take a reader lease "
            "(txckpt._maintenance.retention, docs/retention.md)",
            root=self.url,
            attempts=LOOKUP_ATTEMPTS,
        )

    def require_exists(self) -> None:
        """Raise :class:`RootNotFoundError` if the root itself is missing: its local directory, or
        the bucket of an object-store URL (protocol §6 step 5). Answering "no checkpoint" there
        would make ``if last: resume(last)`` silently train from scratch on a typo."""
        missing = self.storage.missing_root()
        if missing is None:
            return
        if missing == self.url:
            raise RootNotFoundError(
                f"{self.url} does not exist: there is no such directory, so there is no checkpoint "
                "to look up. Check the path (a typo in output_dir?); for a new run, create it or skip "
                "the lookup (a save creates the root)",
                root=self.url,
            )
        raise missing_bucket_error(self.storage, missing)

    def _warn_if_checkpoint_dir(self) -> None:
        name = self.url.rstrip("/").rsplit("/", 1)[-1]
        if parse_checkpoint_name(name) is not None:  # both of a checkpoint's places are named so (§2)
            parent = self.url.rstrip("/")[: -len(name) - 1] or "/"
            log.warning(
                "%s is a checkpoint directory, not a root (an output_dir): "
                "get_last_checkpoint looks for checkpoints inside the directory it is given, and "
                "finds none in a checkpoint. Pass its parent, %s, to find the newest checkpoint; "
                "pass this path to load_checkpoint to read this one.",
                self.url,
                parent,
            )

    def checkpoints(self, lineage: str = "current", *, with_paths: bool = True) -> list[CheckpointInfo]:
        """Committed checkpoints: of the current lineage ("current"), of every lineage ("all"),
        or of one lineage id's view. Retired ones are included only with "all"."""
        history = self.history()
        if lineage == "all":
            chosen = sorted(history.checkpoints.values(), key=lambda c: (c.step, c.seq))
        else:
            chosen = history.in_view(None if lineage == "current" else lineage)
        return self.describe(chosen, with_paths=with_paths, history=history)

    def describe(
        self, chosen: Iterable[Checkpoint], *, with_paths: bool = True, history: History | None = None
    ) -> list[CheckpointInfo]:
        """:class:`CheckpointInfo` of log checkpoints ``chosen``, in that order; with
        ``with_paths``, each is located on storage (a few reads per checkpoint, so callers that
        need a few describe only those, not every checkpoint ever committed). ``history``: the
        one ``chosen`` came from, if the caller holds it (saves re-reading the log's tail)."""
        history = history or self.history()
        # In the head's view or not, by the view's limits: not a pass over the whole view.
        head = history.state.head
        limits = dict(history.state.view(head)) if head is not None else {}
        out = []
        for c in chosen:
            key = self.publication.locate(c.ref) if with_paths else None
            current = c.step <= limits.get(c.lineage, -1)
            state = "retired" if c.txid in history.retired else ("current" if current else "abandoned")
            out.append(
                CheckpointInfo(
                    c.step,
                    c.lineage,
                    c.txid,
                    None if key is None else self.storage.full_path(key),
                    state,
                    c.time,
                    c.bytes,
                    c.files,
                    c.adopted,
                    # (a home is never a public name: no need to read the root's naming for it)
                    key is not None and not key.startswith(TX_DIR + "/") and key == self.publication.public_key(c.step),
                )
            )
        return out

    # ----- lineage changes ---------------------------------------------------------------------
    def resume(
        self,
        step: int | None = None,
        *,
        path: str | os.PathLike | None = None,
        on_damaged: str = "raise",
        verify: Any = None,
    ) -> str | None:
        """Declare where this process continues from; see :func:`txckpt.resume`. ``verify``
        (``path -> path`` to use, IntegrityError on damage): how a restart checks the checkpoint
        it continues from (txckpt/_root/fallback.py); with ``on_damaged="raise"`` only if given."""
        check_on_damaged(on_damaged)
        if step is not None and path is not None:
            raise InvalidArgumentError("give step or path, not both")
        if on_damaged == "fallback" and (step is not None or path is not None):
            raise InvalidArgumentError(
                'on_damaged="fallback" applies to a restart (no step, no path): a checkpoint named '
                "explicitly is the one to load; check it with txckpt.verify_checkpoint"
            )
        if step is not None:
            check_step(step)
        state = self.state()
        if state.seq < 0 and self.legacy_checkpoints():
            if step is None and path is None:
                # Warns; the first save adopts. Without manifests there is nothing to verify.
                return self.get_last_checkpoint()
            self.adopt()
            state = self.state()
        if state.seq < 0:
            if step is not None or path is not None:
                raise CheckpointNotFoundError(
                    f"{self.url} has no committed checkpoints, so there is nothing to resume at "
                    f"{step if step is not None else path}; start without resuming"
                )
            return None
        if path is None and step is None:
            # Continuing the current lineage needs only the state, not the folded history: a
            # restart of a long run must not read every log entry (lookup is O(1), so is this).
            if on_damaged == "fallback":
                return resume_intact(self, state, verify or self._default_verify())
            found = self.get_last_checkpoint()
            if found is not None and verify is not None:
                found = verify(found)  # before the claim: a damaged tip changes nothing
            claim(self, state)
            return found
        history = self.history(snapshot=True)
        if path is not None:
            target = self._checkpoint_at_path(path, history)
        else:
            target = history.find(step=step)
        if same_ref(target.ref, state.head_tip):
            claim(self, state)
            return self.locate(target.ref)
        fork(self, target.ref, history, reason="fork")
        where = self.locate(target.ref)
        if where is None:
            raise CheckpointNotFoundError(
                f"checkpoint step {target.step} (txid {target.txid}) is committed but its files are "
                "missing from storage; choose another step (`txckpt ls`)"
            )
        return where

    def _default_verify(self) -> Callable[[str], str]:
        make = type(self).default_verify
        if make is None:  # pragma: no cover - txckpt/__init__ imports txckpt._api, which sets it
            raise InvalidArgumentError('on_damaged="fallback" needs a verify function (import txckpt)')
        return make(self)

    def new_lineage(self, *, external_parent: str | os.PathLike | None = None) -> str:
        """Start a new root lineage (no parent, or an external checkpoint path as parent)."""
        return new_lineage(self, external_parent=external_parent)

    def _checkpoint_at_path(self, path: str | os.PathLike, history: History) -> Checkpoint:
        key = self.storage.key_of(os.fspath(path))
        if key is None:
            raise InvalidArgumentError(
                f"{os.fspath(path)} is not inside {self.url}; to continue from a checkpoint of "
                "another root, call txckpt.new_lineage(root, external_parent=path)"
            )
        try:
            manifest = Manifest.decode(self.storage.read_bytes(f"{key}/{MANIFEST_NAME}"), f"{path}/{MANIFEST_NAME}")
            manifest = read_manifest_at(self.storage, key, manifest, os.fspath(path))
        except FileNotFoundError:  # never committed, or retired (retention words it)
            raise retention.missing_checkpoint_error(self, history, key, os.fspath(path)) from None
        # The same decision as a load's (reader.RootContext.check_committed): the digest the
        # log committed for this txid. Here the history is folded already, for the fork.
        if history.committed_digest(manifest.txid) != manifest.digest:
            raise CheckpointNotFoundError(
                f"{os.fspath(path)} is not a committed checkpoint of {self.url} (staging leftover, "
                "or copied from another root); choose one from `txckpt ls`"
            )
        if manifest.txid in history.retired:  # its data not deleted yet
            raise retention.retired_error(self, history, history.checkpoints[manifest.txid], os.fspath(path))
        return history.checkpoints[manifest.txid]

    # ----- adoption of a legacy root -----------------------------------------------------------
    def adopt(self) -> str | None:
        """Record plain checkpoint-N directories as a root lineage (checksums computed now); None
        if there is nothing to adopt or another process adopted the root first (txckpt/_root/adoption.py)."""
        return adoption.adopt(self)

    # ----- saving ------------------------------------------------------------------------------
    def transaction(self, step: int, **kwargs: Any):
        kwargs.setdefault("incremental", self.incremental)
        return Transaction(self, step, **kwargs)

    def save(
        self, step: int, files: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> str:
        if not isinstance(files, Mapping) or not files:
            raise InvalidArgumentError("files must be a non-empty dict of file name -> object")
        kwargs.setdefault("incremental", self.incremental)
        return save_files(self, step, files, metadata=metadata, **kwargs)


# ----- the per-process root cache ------------------------------------------------------------------
#: root_key -> spelling -> its CheckpointRoot (identity.py: every spelling of a root, one session).
_roots: dict[tuple[Any, ...], dict[str, CheckpointRoot]] = {}
_lock = threading.Lock()


def open_root(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> CheckpointRoot:
    """The process's CheckpointRoot for ``root`` (created on first use). Every spelling of one
    root (:func:`root_key`) shares one SessionState; each has its own object, its paths in it."""
    key, spelled = root_names(root, storage_options)
    with _lock:
        peers = _roots.setdefault(key, {})
        r = peers.get(spelled)
        if r is None:
            first = next(iter(peers.values()), None)
            r = peers[spelled] = CheckpointRoot(root, storage_options, shared=None if first is None else first.shared)
        return r


def forget_roots() -> None:
    """Drop what this process remembers about every root (as a fresh process would start)."""
    with _lock:
        _roots.clear()


__all__ = ["CheckpointRoot", "durable_default", "open_root", "forget_roots"]
