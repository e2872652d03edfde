"""What ``Trainer.train(resume_from_checkpoint=...)`` resumes from, decided on rank 0 through
txckpt (the mixin in txckpt.integrations.transformers broadcasts the answer with
``coordination.decide_on_rank0``):

* ``True``: the newest checkpoint of the current lineage (verified first; ``txckpt_on_damaged``);
* a path inside the root: ``txckpt.resume(path=...)`` (an older one forks a lineage and warns);
* a path outside: ``txckpt.new_lineage(external_parent=path)``;
* ``None`` on a root with checkpoints: a new root lineage, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable

import txckpt
from txckpt import errors as _errors
from txckpt._base.refs import ExternalParent
from txckpt._tiered.tiered import TieredRoot

from .paths import is_remote, is_within, named_step
from ..._base.layout import is_url

log = logging.getLogger("txckpt.transformers")


def resume_check(trainer: Any, root: str) -> Callable[[str], str] | None:
    """How a restart verifies the checkpoint it continues from (upstream loads files without
    checking them): on a local root, txckpt's verification (one read); on a remote one the
    fetch into the cache, which verifies, is the check, so the copy checked is the copy
    loaded. With "raise" a remote root needs no check here: the fetch after it raises."""
    so = trainer.txckpt_storage_options
    if not is_remote(root):
        return lambda path: (txckpt.verify_checkpoint(path, storage_options=so), path)[1]
    if trainer.txckpt_on_damaged == "raise":
        return None
    return trainer._txckpt_remote.fetch_for_resume


def resolve_on_rank0(trainer: Any, resume: str | bool | None, root: str) -> str | None:
    """The checkpoint ``trainer`` resumes from (None: from scratch), recording any lineage change.
    Runs on rank 0 alone, which broadcasts the answer: lineage changes here are not collectives
    (collective=False), or the other ranks would be waited for twice."""
    so = trainer.txckpt_storage_options
    tiered = tiered_for(trainer, root)
    if resume and tiered is not None:
        resume = _onto_fast_tier(tiered, resume)
    if resume is True:
        path = (
            txckpt.open_root(root, so).resume(
                on_damaged=trainer.txckpt_on_damaged,
                verify=resume_check(trainer, root),
            )
            if _exists(root, so)
            else None
        )
        if path is None:
            path = _external_parent_of_empty_head(root, so)
            if path is not None:
                log.warning(
                    "the current lineage of %s has no checkpoint yet; it started from "
                    "the external checkpoint %s, resuming from there",
                    root,
                    path,
                )
        if path is None:
            where = trainer.args.output_dir if trainer.txckpt_root is None else root
            raise ValueError(f"No valid checkpoint found in output directory ({where})")
        return path
    if resume is None or resume is False:
        if _exists(root, so) and _has_history(root, so):
            newest = txckpt.get_last_checkpoint(root, storage_options=so)
            if newest is not None:
                log.warning(
                    "train(resume_from_checkpoint=None) on %s, which has committed checkpoints "
                    "(newest: %s). Starting from scratch on a new lineage; the existing checkpoints are "
                    "kept but no longer resumed by resume_from_checkpoint=True. To continue them, pass "
                    "resume_from_checkpoint=True.",
                    root,
                    os.path.basename(newest),
                )
            txckpt.new_lineage(root, storage_options=so, collective=False)
        return None
    path = os.fspath(resume)
    if not is_url(path):
        path = os.path.abspath(path)
    named = named_step(path, root)
    if is_within(path, root):
        if named is not None and is_remote(root):
            # Object stores have no checkpoint-N names (a checkpoint stays at its own key):
            # <root>/checkpoint-K means step K of the current lineage, as on a local disk.
            try:
                return txckpt.resume(root, path=path, storage_options=so, collective=False)
            except _errors.CheckpointNotFoundError:
                return txckpt.resume(root, named, storage_options=so, collective=False)
        return txckpt.resume(root, path=path, storage_options=so, collective=False)
    out = os.path.abspath(trainer.args.output_dir)
    local_step = named_step(path, out)
    if trainer.txckpt_root is not None and local_step is not None and not os.path.exists(path):
        # The stock spelling "<output_dir>/checkpoint-K", with the checkpoints elsewhere.
        log.info("%s does not exist; the root is %s, resuming its step %d", path, root, local_step)
        return txckpt.resume(root, local_step, storage_options=so, collective=False)
    txckpt.new_lineage(root, external_parent=path, storage_options=so, collective=False)
    return path if is_url(path) else os.fspath(resume)


def _onto_fast_tier(tiered: TieredRoot, resume: str | bool) -> str | bool:
    """A TieredRoot's fast tier brought up to date before the Trainer reads it as a plain root:
    one that is behind the durable tier (a new node, a stale requeue) holds the durable tip
    (``restore``). A path of the durable tier (what ``txckpt.get_last_checkpoint(root)``
    answers there) becomes the fast path of the same checkpoint, so that the documented restart
    line resumes the lineage instead of forking from it as from an external checkpoint; an older
    durable checkpoint is a rollback forked on the durable tier first (``TieredRoot.resume``).
    The fast checkpoint resumed is repaired from the durable tier first (``TieredRoot.repair``)."""
    tiered.restore()
    if isinstance(resume, bool) or tiered.durable_root.storage.key_of(os.fspath(resume)) is None:
        where = tiered.get_last_checkpoint() if resume is True else resume
    else:
        where = tiered.local_path(resume)
        if where is None:
            tiered.resume(path=resume)
            tiered.restore()
            where = tiered.local_path(resume)
        resume = where or resume
    if where and tiered.fast_root.storage.key_of(os.fspath(where)) is not None:
        # Upstream reads the fast files itself: one missing or damaged there comes back from the
        # durable copy first, as load_checkpoint(root) does (a checkpoint not durable yet is left
        # to the restart's own check, which says what to do).
        with contextlib.suppress(_errors.IntegrityError, _errors.CheckpointNotFoundError):
            tiered.repair(where)
    return resume


def tiered_settings(
    root: str | os.PathLike | TieredRoot | None, storage_options: dict | None
) -> tuple[str | os.PathLike | None, dict | None, TieredRoot | None]:
    """``txckpt_root=TieredRoot(...)``: the Trainer saves to, and resumes from, its fast tier
    as a plain root (its commits are replicated, its retention guarded: txckpt._tiered.tiered); a
    restart on an empty fast tier first restores the durable tip there (``restore``)."""
    if not isinstance(root, TieredRoot):
        return root, storage_options, None
    if storage_options is not None:
        raise _errors.InvalidArgumentError(
            "txckpt_storage_options with txckpt_root=TieredRoot(...): give the storage options to the "
            "TieredRoot (storage_options= for its durable tier, fast_storage_options= for its fast one)"
        )
    return root.fast, root.fast_storage_options or None, root


def tiered_for(trainer: Any, root: str) -> TieredRoot | None:
    """The TieredRoot whose fast tier is ``root`` (None without ``txckpt_root=TieredRoot``).
    A hyperparameter-search trial saves into its run directory's sub-path of the fast tier
    (``<fast>/run-<id>``), a root of its own: it gets a TieredRoot of its own too, over the
    same sub-path of the durable tier, made once, so that its commits are replicated and its
    retention guarded as the run's are (a plain sub-root would never leave the node)."""
    tiered: TieredRoot | None = getattr(trainer, "_txckpt_tiered", None)
    root = os.path.abspath(root)  # the fast tier is a local directory
    if tiered is None or root == os.path.abspath(tiered.fast):
        return tiered
    trials = trainer.__dict__.setdefault("_txckpt_tiered_trials", {})
    if root not in trials:
        rel = os.path.relpath(root, os.path.abspath(tiered.fast))
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):  # not under the fast tier
            return None
        durable = (
            tiered.durable.rstrip("/") + "/" + rel.replace(os.sep, "/")
            if is_url(tiered.durable)
            else os.path.join(tiered.durable, rel)
        )
        trials[root] = TieredRoot(
            root, durable, tiered.storage_options, fast_storage_options=tiered.fast_storage_options
        )
    return trials[root]


def committed_step_path(root: str, storage_options: dict | None, step: int) -> str | None:
    """Where the current lineage's committed checkpoint of ``step`` is; None if it has none
    (never saved, or retired)."""
    r = txckpt.open_root(root, storage_options)
    try:
        c = r.history().find(step=step)
    except _errors.CheckpointNotFoundError:
        return None
    return r.locate(c.ref)


def _exists(root: str, storage_options: dict | None) -> bool:
    return is_url(root) or storage_options is not None or os.path.isdir(root)


def _has_history(root: str, storage_options: dict | None) -> bool:
    r = txckpt.open_root(root, storage_options)
    state = r.state()
    return state.seq >= 0 or bool(r.legacy_checkpoints())


def _external_parent_of_empty_head(root: str, storage_options: dict | None) -> str | None:
    if not _exists(root, storage_options):
        return None
    state = txckpt.open_root(root, storage_options).state()
    info = state.head_info
    if info is None or info.tip is not None or not isinstance(info.parent, ExternalParent):
        return None
    return info.parent.path
