"""Resuming past damaged checkpoints (``resume(root, on_damaged="fallback")``, protocol §10a).

A partial checkpoint is never committed, but a committed one can be damaged afterwards (bit
rot, a truncated copy, a file deleted by hand). A restart that raises on it forever is useless
to an unattended, preemptible job, so on request a restart verifies the newest checkpoint of the
current lineage before it is used and, if it fails, forks from the newest checkpoint of the view
that verifies. The fork is an ordinary one (§10): the damaged checkpoints are in its abandoned
set, kept on disk untouched, and its entry records which ones failed and why.

Verification is the caller's ``verify(path) -> path``: by default (the root's, set by
``txckpt._api``) the same check a load makes (:func:`txckpt.verify_checkpoint`, one read of the
bytes); the Trainer mixin passes the download
of a remote checkpoint into its cache, which verifies on the way, so the copy it verified is the
one it loads and nothing is downloaded twice.

A plain lookup whose tip is committed but missing from storage falls back too, without
verifying: to the newest checkpoint of the view that is present (:func:`present_fallback`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from .._log.commit import claim, fork
from ..errors import IntegrityError, InvalidArgumentError, LookupRaceError, NoIntactCheckpointError
from .._save.incremental import distrust
from .._base.layout import home_key
from .._log.publication import LOOKUP_ATTEMPTS, Root
from .._base.refs import Ref, same_ref
from .._manifest.verify import FALLBACK_HINT

if TYPE_CHECKING:
    from .._log.lineage import State

log = logging.getLogger("txckpt")

ON_DAMAGED = ("raise", "fallback")
#: The longest error message a fork entry records per damaged checkpoint.
_ERROR_CHARS = 400

Verify = Callable[[str], str]


def check_on_damaged(on_damaged: str) -> None:
    if on_damaged not in ON_DAMAGED:
        raise InvalidArgumentError(f"on_damaged must be one of {ON_DAMAGED}, not {on_damaged!r}")


def _check(root: Root, r: Ref, verify: Verify) -> str:
    """``verify`` applied to where committed checkpoint ``r`` is; IntegrityError if it is nowhere."""
    # A second pass sees a publication's rename that the first read straddled (§6 step 4).
    key = root.publication.locate(r) or root.publication.locate(r)
    if key is None:
        where = root.storage.full_path(home_key(r.txid, r.step))
        raise IntegrityError(
            f"checkpoint step {r.step} (txid {r.txid}) is committed but its manifest is missing "
            f"or unreadable at every place it may be ({where}, or {root.publication.naming.name_of(r.step, r.key)})",
            path=where,
        )
    return verify(root.storage.full_path(key))


def _record(step: int, txid: str, e: IntegrityError) -> dict[str, Any]:
    why = str(e).replace(f"; {FALLBACK_HINT}", "")  # advice for a human, not what happened
    return {"step": step, "txid": txid, "path": e.path, "error": f"{type(e).__name__}: {why}"[:_ERROR_CHARS]}


def resume_intact(root: Root, state: "State", verify: Verify) -> str | None:
    """Continue the current lineage from its newest checkpoint that verifies: claim the head if
    that is its tip, else fork from it. Returns what ``verify`` returned for it (None for a head
    without checkpoints). Raises NoIntactCheckpointError, changing nothing, if none verifies.
    ``verify``: the caller's (the root's default: txckpt._api's ``verify_checkpoint``)."""
    for _ in range(LOOKUP_ATTEMPTS):
        tip = state.head_tip
        if tip is None:
            claim(root, state)
            return None
        try:
            used = _check(root, tip, verify)
        except IntegrityError as e:
            fresh = root.state()
            if not same_ref(fresh.head_tip, tip):
                state = fresh  # the log moved on (a retention deleted the tip it read): follow it
                continue
            return _fall_back(root, tip, e, verify)
        claim(root, state)
        return used
    raise LookupRaceError(
        f"the newest checkpoint of {root.url} was retired and deleted under this resume "
        f"{LOOKUP_ATTEMPTS} times in a row; retry, or keep more checkpoints",
        root=root.url,
        attempts=LOOKUP_ATTEMPTS,
    )


def _fall_back(root: Root, tip: Ref, first: IntegrityError, verify: Verify) -> str:
    history = root.history(snapshot=True)
    damaged = [_record(tip.step, tip.txid, first)]
    for c in reversed(history.in_view(None)):
        if c.txid == tip.txid:
            continue
        try:
            used = _check(root, c.ref, verify)
        except IntegrityError as e:
            damaged.append(_record(c.step, c.txid, e))
            continue
        # An incremental save after this fork must not share their files: each new checkpoint
        # would be born damaged, and the next restart would fall back here again.
        distrust(root, [d["txid"] for d in damaged], [d["path"] for d in damaged])
        fork(root, c.ref, history, reason="fork", damaged=damaged)
        return used
    distrust(root, [d["txid"] for d in damaged], [d["path"] for d in damaged])
    listing = "; ".join(f"step {d['step']} (txid {d['txid']}): {d['path']}" for d in damaged)
    raise NoIntactCheckpointError(
        f"no checkpoint of the current lineage of {root.url} verifies, so there is nothing to fall "
        f"back to: {listing}. Nothing was changed. Restore the damaged files from a backup, or start "
        "a new lineage (txckpt.new_lineage, or train(resume_from_checkpoint=None)); `txckpt verify "
        f"{root.url}` reports every damaged file",
        path=damaged[0]["path"],
        root=root.url,
        damaged=damaged,
    )


def present_fallback(root: Root, missing: Ref) -> str | None:
    """The tip ``missing`` is committed, not retired, and absent from storage: the newest
    present checkpoint of the view (newer ones first, if the log moved on meanwhile)."""
    history = root.history()
    for c in reversed(history.in_view(None)):
        if c.txid == missing.txid:
            continue
        key = root.publication.locate(c.ref)
        if key is None:
            continue
        if c.step < missing.step:
            log.warning(
                "the newest checkpoint of the current lineage, step %d (txid %s), is "
                "missing from %s (deleted or renamed by hand?). Falling back to step %d. "
                "Run `txckpt verify` to see what else is missing.",
                missing.step,
                missing.txid,
                root.url,
                c.step,
            )
        return key
    log.warning(
        "no checkpoint of the current lineage of %s is present on storage "
        "(deleted by hand?); starting from scratch. Run `txckpt verify`.",
        root.url,
    )
    return None
