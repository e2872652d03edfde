"""The commit room: every change a writer session makes to a root's log (plan, claim, fork, commit).

A save's committer (``txckpt._save.transactions``) runs protocol §8 in named phases and comes here for
the ones that read or change the log: :func:`plan_save` (step 1, claiming the head or forking a
first lineage if the session holds none), :func:`append_commit` (step 9, the commit point), :func:`finish_commit`
(steps 10-11, and 11a by :func:`snapshot_if_due`). A restart's :func:`claim` and a rollback's :func:`fork`
(§10; ``CheckpointRoot.resume``, ``txckpt._root.fallback``, ``retention.rewind``) are the same room's:
a lineage changes here and nowhere else.

The root comes in as :class:`txckpt._log.publication.Root`: its storage, its publication, its log's
state and history, and ``root.shared``, the session this process holds for it (which lineage it
writes, its token, the newest state it knows), read and written here directly.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any, Callable, Mapping

from . import log as commit_log
from ..errors import CheckpointNotFoundError, ConcurrentWriterError, LogCorruptError, StepConflictError
from .._base.layout import home_key, intent_key, new_txid
from .lineage import Checkpoint, History, State, describe_checkpoints, new_lineage_id, rollback_warning
from .._manifest.manifest import Manifest
from .._base.naming import DEFAULT as DEFAULT_NAMING, Naming
from .publication import Root
from .._base.refs import ExternalParent, Parent, Ref, parent_to_json
from .._base.reserve import ensure_reserve
from .._base.saveplan import SavePlan

log = logging.getLogger("txckpt")

Build = Callable[[State, int, float], dict[str, Any]]


# ----- appending ---------------------------------------------------------------------------------
def append(
    root: Root,
    build: Build,
    *,
    start: State | None = None,
    update_hint: bool = True,
    on_full: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Append one log entry (``txckpt._log.log.append``) and remember the state it made. The root's
    first entry also makes the space reserve retention uses on a full disk."""
    entry, state = commit_log.append(
        root.storage, build, durable=root.durable, start=start, update_hint=update_hint, on_full=on_full
    )
    note_state(root, state)
    if entry["seq"] == 0:
        ensure_reserve(root.storage, durable=root.durable)
    return entry


def note_state(root: Root, state: State) -> None:
    """Remember ``state`` as the newest this session knows, unless it knows a newer one."""
    session = root.shared
    if session.known_state is None or state.seq >= session.known_state.seq:
        session.known_state = state


def clear_intent(root: Root, txid: str) -> None:
    root.storage.delete_file(intent_key(txid))


# ----- lineage changes (§10) ---------------------------------------------------------------------
def claim(root: Root, state: State) -> None:
    """Take over the head lineage for this session (a restart): a job still writing it with an
    older session (a zombie) can no longer commit."""
    session = root.shared
    lineage = state.head
    if lineage is None:
        return
    if state.lineages[lineage].writer == session.session:
        session.writer_lineage = lineage
        return

    def build(fresh: State, seq: int, now: float) -> dict[str, Any]:
        if fresh.head != lineage:
            raise ConcurrentWriterError(
                f"the root's current lineage changed from {lineage} to {fresh.head} while this "
                "process was resuming it; check `txckpt log` and resume again"
            )
        new_state = fresh.after_claim(seq, lineage, session.session)
        return {"action": "claim", "lineage": lineage, "writer": session.session, "state": new_state.to_json()}

    append(root, build)
    session.writer_lineage = lineage


def new_lineage(root: Root, *, external_parent: str | os.PathLike | None = None, lineage_id: str | None = None) -> str:
    """Start a new root lineage (no parent, or an external checkpoint path as parent).
    ``lineage_id``: see ``fork``."""
    if root.state().seq < 0 and root.legacy_checkpoints():
        root.adopt()
    history = root.history()
    parent = None if external_parent is None else ExternalParent(os.fspath(external_parent))
    return fork(root, parent, history, reason="root" if parent is None else "external", lineage_id=lineage_id)


def fork(
    root: Root,
    parent: Parent,
    history: History,
    reason: str,
    *,
    announce: bool = True,
    damaged: list[dict[str, Any]] | None = None,
    lineage_id: str | None = None,
) -> str:
    """Append a fork entry (§10); returns the new lineage. ``announce=False``: the caller retires
    what the fork abandons (retention.rewind) and says so itself, instead of the "kept intact"
    warning. ``damaged``: the checkpoints a restart found damaged (txckpt/_root/fallback.py), recorded
    in the entry and named in the one warning. ``lineage_id``: the new lineage's id instead of a
    fresh one: a tiered root's replicator repeats the fast tier's fork on the durable tier under
    the same id (protocol §14), so one id names the lineage on both tiers."""
    session = root.shared
    expected_head = history.state.head
    if lineage_id is not None and lineage_id in history.state.lineages:
        raise ConcurrentWriterError(
            f"lineage {lineage_id} already exists in {root.url}; a replicated fork is appended "
            "once: check `txckpt log` on that root"
        )
    lid = lineage_id if lineage_id is not None else new_lineage_id(history.state.lineages)
    abandoned: list[Checkpoint] = []
    restored: list[Checkpoint] = []

    def build(state: State, seq: int, now: float) -> dict[str, Any]:
        nonlocal abandoned, restored
        if state.seq != history.state.seq:
            fresh = root.history()
            if fresh.state.head != expected_head:
                raise ConcurrentWriterError(
                    f"the root's current lineage changed from {expected_head} to "
                    f"{fresh.state.head} while this process was rolling back; check "
                    "`txckpt log` and retry"
                )
        new_state = state.after_new_lineage(seq, now, lid, parent, reason, writer=session.session)
        # The entry does not list what it abandons (the fold derives it, §4): the views are
        # the folded history's, whose lineages are complete (the newest entry's are not).
        fresh = session.folded_history or history
        after = fresh.state.after_new_lineage(seq, now, lid, parent, reason, writer=session.session)
        abandoned = fresh.abandoned_by(after, expected_head)
        restored = fresh.restored_by(after, expected_head)
        entry: dict[str, Any] = {
            "action": "fork",
            "lineage": lid,
            "parent": parent_to_json(parent),
            "reason": reason,
            "state": new_state,
        }
        if damaged:
            entry["damaged"] = damaged
        return entry

    append(root, build)
    session.writer_lineage = lid
    history = root.history()
    publication = root.publication
    if damaged:
        assert isinstance(parent, Ref)  # a fallback forks from the newest intact checkpoint
        log.warning(
            "the newest checkpoint(s) of %s failed verification: %s. Falling back to step "
            "%d of lineage %s: new lineage %s abandons %d checkpoint(s): %s. Nothing was deleted: "
            "the damaged ones stay on disk as they are (`txckpt verify` reports them); restore "
            "them from a backup if you need them.",
            root.url,
            describe_damaged(
                damaged,
                publication.naming,
                {d["txid"]: c.key for d in damaged if (c := history.checkpoints.get(d["txid"])) is not None},
            ),
            parent.step,
            parent.lineage,
            lid,
            len(abandoned),
            describe_checkpoints(abandoned, publication.naming),
        )
    elif abandoned and announce:
        log.warning(
            "%s",
            rollback_warning(
                root.url, parent, lid, abandoned, renames=publication.publishes, naming=publication.naming
            ),
        )
    try:
        # Only the names the fork changes move (§7), not every name in the root (a manifest
        # read each); `txckpt gc` reconciles them all (a crash before these renames).
        publication.unpublish_refs([c.ref for c in abandoned])
        publication.publish_missing([c.ref for c in restored if not c.adopted])
    except OSError as e:
        # The fork is committed; publication is derived state that `txckpt gc` completes
        # (a save publishes only its own checkpoint). Lookups follow the log, not the names.
        log.warning(
            "the rollback is recorded, but moving the checkpoint-N names to the "
            "new lineage's checkpoints failed (%s); `txckpt gc` completes it",
            e,
        )
    return lid


def describe_damaged(
    damaged: list[dict[str, Any]], naming: Naming = DEFAULT_NAMING, keys: Mapping[str, str | None] | None = None
) -> str:
    """One clause per damaged checkpoint, named by the root's ``naming`` (``checkpoint_4`` on an
    Accelerate root; ``keys``, txid -> the key it was committed at: an adopted
    ``checkpoint-00500`` keeps its name)."""
    keys = keys or {}
    return "; ".join(
        f"{naming.name_of(d['step'], keys.get(d['txid']))} (txid {d['txid']}): {d['path'] or '?'} failed ({d['error']})"
        for d in damaged
    )


# ----- a save's phases that read or change the log (§8) ------------------------------------------
def plan_save(root: Root, step: int, *, txid: str | None = None) -> SavePlan:
    """Step 1: validate a save of ``step`` (checked by ``manifest.check_step`` already: the
    transaction's first act) against the newest state; the plan the ranks share. ``txid``: a
    tiered root's replica commits under the fast tier's txid (protocol §14), not a new one."""
    session = root.shared
    if session.writer_lineage is not None and session.known_state is not None:
        # This session holds a lineage: plan against the newest state it knows (its own last
        # commit, usually) instead of reading the log. If another process appended since,
        # the commit's create-if-absent of entry seq+1 loses, and the commit re-reads and
        # re-validates against the newest state (§8 steps 1 and 9): a stale plan can only
        # fail later, never commit wrongly.
        state = session.known_state
    else:
        state = root.state()
    if state.seq < 0 and root.legacy_checkpoints():
        root.adopt()
        state = root.state()
    if session.writer_lineage is None:
        if state.head is None:
            new_lineage(root)
        else:
            claim(root, state)
        state = root.state()
    lineage = session.writer_lineage
    assert lineage is not None  # set by new_lineage or claim just above
    info = state.lineages.get(lineage)
    if state.head != lineage or (info is not None and info.writer not in (None, session.session)):
        # Raises StaleLineageError with the full explanation.
        state.after_commit(state.seq + 1, lineage, step, "", None, session.session)
    info = state.lineages[lineage]
    tip = info.tip
    if tip is not None and step <= tip.step:
        raise StepConflictError(
            f"cannot save step {step}: step {tip.step} is already committed in the current "
            f"lineage {lineage} of {root.url}. To roll back, call txckpt.resume(root, step=K) "
            "with the step you restarted from; otherwise save a newer step."
        )
    parent = tip if tip is not None else info.parent
    txid = txid or new_txid(step, lineage)
    # The commit appends after this state without re-reading the log (§8); only the newest
    # plan is kept, so an aborted save leaves nothing behind.
    session.base_states = {txid: state}
    return SavePlan(txid, lineage, step, parent, home_key(txid, step), session.session)


def append_commit(root: Root, manifest: Manifest, writer: str | None = None) -> dict[str, Any]:
    """Step 9, the commit point: append the commit entry of a staged, durable manifest (after
    the state its plan was made against, re-validated against a newer one if it lost a race)."""
    session = root.shared
    total_bytes, file_count = manifest.totals
    record = {
        "lineage": manifest.lineage,
        "step": manifest.step,
        "txid": manifest.txid,
        "digest": manifest.digest,
        "bytes": total_bytes,
        "files": file_count,
        "parent": parent_to_json(manifest.parent),
    }

    def build(state: State, seq: int, now: float) -> dict[str, Any]:
        new_state = state.after_commit(
            seq,
            manifest.lineage,
            manifest.step,
            manifest.txid,
            manifest.parent,
            writer if writer is not None else session.session,
            manifest.digest,
        )
        return {"action": "commit", "checkpoint": record, "state": new_state}

    return append(root, build, start=session.base_states.pop(manifest.txid, None), update_hint=False)


def finish_commit(root: Root, manifest: Manifest, entry: dict[str, Any], plan_key: str | None = None) -> str:
    """Steps 10-11a of a committed save: the ``latest`` hint, the publication and the intent's
    deletion, which depend on nothing but the commit entry, then the history snapshot when it
    is due (:func:`snapshot_if_due`); returns the checkpoint's path.
    ``plan_key``: the staging directory the save committed in (its home), where the
    publication takes it from."""
    storage = root.storage
    committed = Ref(manifest.lineage, manifest.step, manifest.txid)
    # Committed. What is left does not depend on each other (§8 steps 9-11), so on object
    # stores the three requests overlap instead of costing three round trips in a row.
    _, where, cleared = storage.run_concurrently(
        [
            partial(commit_log.write_hint, storage, entry["seq"]),
            partial(root.publication.publish, committed, plan_key),
            partial(clear_intent, root, manifest.txid),
        ]
    )
    if isinstance(cleared, Exception):
        log.warning(
            "checkpoint %s is committed, but its intent could not be deleted (%s); `txckpt gc` removes it",
            manifest.txid,
            cleared,
        )
    if isinstance(where, OSError):
        # Committed is committed: the checkpoint stays valid at its home, and the next
        # publication or `txckpt gc` gives it its name.
        log.warning(
            "checkpoint %s is committed but could not be published (%s); "
            "it stays at its home until the next save or `txckpt gc`",
            manifest.txid,
            where,
        )
        where = root.publication.locate(committed)
    elif isinstance(where, Exception):
        raise where
    if where is None:  # pragma: no cover - the data was just written
        raise CheckpointNotFoundError(f"committed checkpoint {manifest.txid} vanished during publication")
    for name, listener in list(root.shared.on_commit.items()):
        try:
            listener()
        except Exception:  # committed is committed: a listener's failure is its own
            log.warning("the %s listener of %s failed after commit %s", name, root.url, manifest.txid, exc_info=True)
    snapshot_if_due(root, entry)
    return storage.full_path(where)


def snapshot_if_due(root: Root, entry: dict[str, Any]) -> None:
    """Step 11a: every SNAPSHOT_EVERY-th entry the committer leaves a history snapshot (§4a): a
    run that only saves would leave none, and every fresh `txckpt ls` would fold its whole log."""
    if entry["seq"] % commit_log.SNAPSHOT_EVERY != 0:
        return
    try:  # best effort: the save is committed
        root.history(snapshot=True)
    except (OSError, LogCorruptError) as e:
        log.warning("checkpoint committed, but the history snapshot after it was not written (%s)", e)


def committed_path(root: Root, plan: SavePlan) -> str | None:
    """Where the checkpoint of ``plan`` is, if its commit entry exists; None if it does not (a
    failed save asks this before it deletes anything: past the commit point, never delete).

    Raises CheckpointNotFoundError if it is committed but its data is found nowhere (its
    staging was deleted after the commit's check of the staged files: by hand, or by a gc
    that took this writer for dead): a path that does not hold the checkpoint is never
    returned."""
    try:
        state = root.state()
    except Exception:
        return None
    info = state.lineages.get(plan.lineage)
    tip = info.tip if info is not None else None
    if tip is None or tip.txid != plan.txid:
        # The newest entry holds the head's record only: a later entry (a fork, a newer
        # commit) hides ours from it, and only the folded history tells.
        try:
            c = root.history().checkpoints.get(plan.txid)
        except Exception:
            return None
        if c is None:
            return None
        tip = c.ref
    key = root.publication.locate(tip)
    if key is None:
        raise CheckpointNotFoundError(
            f"checkpoint step {plan.step} (txid {plan.txid}) was committed, but its data is "
            f"neither at {root.storage.full_path(plan.key)} nor published: its staging was "
            "deleted after the commit checked it (by hand, or by a gc that took this writer for dead). "
            "Lookups skip it with a warning and return the previous checkpoint; save again"
        )
    return root.storage.full_path(key)


__all__ = [
    "append",
    "note_state",
    "clear_intent",
    "claim",
    "new_lineage",
    "fork",
    "describe_damaged",
    "plan_save",
    "append_commit",
    "finish_commit",
    "snapshot_if_due",
    "committed_path",
]
