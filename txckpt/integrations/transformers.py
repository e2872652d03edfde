"""Transactional checkpoints and lineage-aware resume for transformers' ``Trainer``.

::

    from transformers import Trainer
    from txckpt.integrations.transformers import TransactionalCheckpointMixin

    class MyTrainer(TransactionalCheckpointMixin, Trainer):   # the mixin goes leftmost
        pass

or use :class:`TransactionalTrainer`. Supported: transformers 4.57.x and 5.x (tested on 5.24).

How it hooks in (docs/dev/trainer-internals.md has the Trainer call sequences this relies on):

* ``_save_checkpoint`` opens a txckpt transaction on every rank; while upstream's
  ``_save_checkpoint`` runs, ``_get_output_dir`` returns the transaction's staging root, so every
  writer (model, optimizer, scheduler, scaler, every ``rng_state_{rank}.pth``,
  ``trainer_state.json``, anything a subclass writes there) lands in staging. The transaction
  commits on a clean exit and aborts on every rank if one rank raises; ``on_save`` runs after it.
* ``best_model_checkpoint`` is rewritten to the published path before the commit; the Hub push
  is deferred until after it; upstream rotation is disabled and replaced by lineage-aware
  retention (``save_total_limit`` counts the current lineage only).
* ``train(resume_from_checkpoint=...)`` is resolved on rank 0 through txckpt and broadcast:
  ``True`` -> newest checkpoint of the current lineage; a path inside output_dir ->
  ``txckpt.resume(path=...)`` (an older one forks a lineage and warns); a path outside ->
  ``txckpt.new_lineage(external_parent=path)``; ``None`` on a root with checkpoints -> a new
  root lineage, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import warnings
from typing import Any

import transformers
from transformers import Trainer

import txckpt
from txckpt.coordination import current_coordinator
from txckpt import errors as _errors

log = logging.getLogger("txckpt.transformers")

PREFIX_CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")
_LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


class TransactionalCheckpointMixin:
    """Make a ``transformers.Trainer`` save every checkpoint as one txckpt transaction and resume
    along lineages. Place it **leftmost**: ``class MyTrainer(TransactionalCheckpointMixin, Trainer)``.

    Class attributes a subclass may set:

    * ``txckpt_storage_options``: passed to every txckpt call (``None`` for a local output_dir).
    * ``txckpt_timeout``: seconds a rank waits for the others inside a transaction (``None``:
      txckpt's default, ``TXCKPT_COORDINATION_TIMEOUT`` or 600 s).
    """

    txckpt_storage_options: dict[str, Any] | None = None
    txckpt_timeout: float | None = None

    def __init_subclass__(cls, **kwargs: Any):
        # Runs at class definition, even when Trainer comes first (whose __init__ would then
        # never reach ours).
        super().__init_subclass__(**kwargs)
        _check_mro(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        _check_mro(type(self))
        # Set before Trainer.__init__: it may call overridden methods (e.g. _get_output_dir).
        self._txckpt_tx = None
        self._txckpt_pending_push: tuple[tuple, dict] | None = None
        #: The newest step this process knows to be committed in its lineage (resumed or saved).
        self._txckpt_last_step: int | None = None
        super().__init__(*args, **kwargs)
        self._txckpt_install_jit()

    # ----- where things go ---------------------------------------------------------------------
    def _txckpt_root(self, trial: Any = None) -> str:
        """The txckpt root: the run directory upstream would use (output_dir, or the trial's run
        directory during a hyperparameter search)."""
        root = super()._get_output_dir(trial)  # type: ignore[misc]
        return root if "://" in root else os.path.abspath(root)

    def _get_output_dir(self, trial: Any = None) -> str:
        tx = getattr(self, "_txckpt_tx", None)
        if tx is not None:
            # Only while our _save_checkpoint runs: upstream joins f"checkpoint-{global_step}"
            # to this, which is exactly tx.directory.
            return tx.output_root
        return super()._get_output_dir(trial)  # type: ignore[misc]

    # ----- saving ------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        if self._txckpt_tx is not None:
            # Called again from inside a save (a subclass's override): join the open transaction.
            return super()._save_checkpoint(model, trial, *args, **kwargs)  # type: ignore[misc]
        _check_save_on_each_node(self.args)
        step = int(self.state.global_step)
        if self._txckpt_last_step is not None and step == self._txckpt_last_step:
            # E.g. a JIT checkpoint requested right after a regular save or a resume: the committed
            # checkpoint-N already holds this step; saving it again would be a StepConflictError.
            log.info("txckpt: checkpoint-%d is already committed in this lineage; not saving it again", step)
            return
        root = self._txckpt_root(trial)
        expected = os.path.join(root, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._txckpt_pending_push = None
        with txckpt.transaction(
            root, step, storage_options=self.txckpt_storage_options,
            metadata=self._txckpt_metadata(trial), timeout=self.txckpt_timeout,
        ) as tx:
            self._txckpt_tx = tx
            try:
                super()._save_checkpoint(model, trial, *args, **kwargs)  # type: ignore[misc]
                self._txckpt_publish_best(tx, expected)
            finally:
                self._txckpt_tx = None
        committed = tx.path
        assert committed is not None
        self._txckpt_last_step = step
        if committed != expected:
            if self.state.best_model_checkpoint == expected:
                self.state.best_model_checkpoint = committed
            log.warning(
                "txckpt: checkpoint-%d was committed at %s, not at %s; trainer_state.json inside it "
                "names %s as best_model_checkpoint", step, committed, expected, expected,
            )
        # The Hub push that upstream asked for during the save, now from the committed directory.
        pending, self._txckpt_pending_push = self._txckpt_pending_push, None
        if pending is not None:
            self._push_from_checkpoint(committed, *pending[0], **pending[1])
        if self.is_world_process_zero():  # type: ignore[attr-defined]
            self._txckpt_retention(root)

    def _txckpt_metadata(self, trial: Any) -> dict[str, Any]:
        return {
            "producer": "txckpt.integrations.transformers",
            "transformers_version": transformers.__version__,
            "trainer_class": type(self).__name__,
            "global_step": int(self.state.global_step),
            "epoch": None if self.state.epoch is None else float(self.state.epoch),
            "trial": None if trial is None else str(getattr(trial, "number", trial)),
        }

    def _txckpt_publish_best(self, tx: Any, expected: str) -> None:
        """Upstream derives best_model_checkpoint from _get_output_dir, i.e. from staging, when the
        best step is the one being saved. Point it at the published path, in memory and in this
        checkpoint's trainer_state.json, before the commit."""
        best = self.state.best_model_checkpoint
        if best is None or not _is_within(best, tx.output_root):
            return
        self.state.best_model_checkpoint = expected
        state_file = os.path.join(tx.directory, TRAINER_STATE_NAME)
        if self.args.should_save and os.path.isfile(state_file):
            self.state.save_to_json(state_file)

    def _push_from_checkpoint(self, checkpoint_folder: str, *args: Any, **kwargs: Any) -> None:
        if self._txckpt_tx is not None:
            # Never upload (asynchronously!) from staging: push after the commit.
            self._txckpt_pending_push = (args, kwargs)
            return
        with _hub_uploads_skip_txckpt():
            return super()._push_from_checkpoint(checkpoint_folder, *args, **kwargs)  # type: ignore[misc]

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        with _hub_uploads_skip_txckpt():
            return super().push_to_hub(*args, **kwargs)  # type: ignore[misc]

    # ----- retention (upstream rotation is disabled) -------------------------------------------
    def _rotate_checkpoints(self, use_mtime: bool = False, output_dir: str | None = None) -> None:
        """transformers 4.x rotation: disabled (it is mtime-ordered and lineage-blind). txckpt's
        retention runs after each commit instead. (5.x calls a module function that only sees
        the transaction's staging root, which holds just the checkpoint being saved.)"""
        return None

    def _sorted_checkpoints(self, output_dir: str | None = None, checkpoint_prefix: str = PREFIX_CHECKPOINT_DIR,
                            use_mtime: bool = False) -> list[str]:
        """transformers 4.x: feeds rotation and the end-of-training ``save_total_limit == 1``
        cleanup, which would delete every other lineage's checkpoint-N. Nothing for them."""
        return []

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers 5.x: the end-of-training cleanup deletes every ``checkpoint-*`` of the run
        directory but the best when ``save_total_limit == 1``, through the module function
        ``sort_checkpoints``, which a subclass cannot redirect. Hide the limit for the duration;
        txckpt's retention (newest and best kept) already ran after the last commit."""
        limit = self.args.save_total_limit
        hide = limit == 1 and self.state.best_model_checkpoint is not None
        if hide:
            self.args.save_total_limit = None
        try:
            return super()._finalize_training(trial, *args, **kwargs)  # type: ignore[misc]
        finally:
            if hide:
                self.args.save_total_limit = limit

    def _txckpt_retention(self, root: str) -> None:
        """Apply ``save_total_limit`` to the current lineage's committed checkpoints, keeping the
        newest and the best. Other lineages are left to the root's retention policy. Runs on
        rank 0 after a commit; a failure is logged, never fatal (the checkpoint is committed)."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        try:
            _apply_retention(root, self.txckpt_storage_options, limit, self.state.best_model_checkpoint)
        except Exception as e:  # noqa: BLE001 - retention must not kill a training run
            log.warning("txckpt: retention after the commit failed (%s: %s); nothing was deleted "
                        "that must be kept; `txckpt gc` retries", type(e).__name__, e)

    # ----- JIT checkpointing (transformers 5.x) ------------------------------------------------
    def _txckpt_install_jit(self) -> None:
        """Route 5.x's JIT checkpoint through the transaction. Upstream's
        ``execute_jit_checkpoint`` pre-creates ``<output_dir>/checkpoint-N`` and a sentinel file
        outside any transaction (possibly inside a committed checkpoint); ours doesn't."""
        for cb in getattr(self.callback_handler, "callbacks", []):  # type: ignore[attr-defined]
            manager = getattr(cb, "jit_manager", None)
            if manager is not None and hasattr(manager, "execute_jit_checkpoint"):
                manager.execute_jit_checkpoint = functools.partial(self._txckpt_execute_jit, manager)

    def _txckpt_execute_jit(self, manager: Any) -> None:
        manager.is_checkpoint_requested = False
        log.info("txckpt: JIT checkpoint at step %d", self.state.global_step)
        self._save_checkpoint(self.model, trial=None)  # type: ignore[attr-defined]

    # ----- resume ------------------------------------------------------------------------------
    def _load_optimizer_and_scheduler(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        """transformers 4.x loads the optimizer with ``map_location=args.device`` in a multi-process
        run; on CPU that is an indexed device ("cpu:0"), which torch >= 2.x refuses to restore, so
        a CPU DDP run cannot resume at all (stock Trainer included). 5.x maps to plain "cpu"; do
        the same here. Nothing changes unless the device is an indexed CPU device."""
        device = getattr(self.args, "device", None)
        if checkpoint is None or getattr(device, "type", None) != "cpu" or getattr(device, "index", None) is None:
            return super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)  # type: ignore[misc]
        with _plain_cpu_map_location():
            return super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        if "model_path" in kwargs:  # transformers 4.x's deprecated alias
            warnings.warn("`model_path` is deprecated; use `resume_from_checkpoint`", FutureWarning)
            resume_from_checkpoint = kwargs.pop("model_path")
        _check_save_on_each_node(self.args)
        resolved = self._txckpt_resolve_resume(resume_from_checkpoint, trial)
        return super().train(  # type: ignore[misc]
            resume_from_checkpoint=resolved, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
        )

    def _txckpt_resolve_resume(self, resume: str | bool | None, trial: Any) -> str | None:
        """Rank 0 decides (and records any lineage change); every rank gets its answer."""
        root = self._txckpt_root(trial)
        coord = current_coordinator(self.txckpt_timeout)
        own_error: BaseException | None = None
        answer: dict[str, Any] | None = None
        if coord.rank == 0:
            try:
                answer = {"path": self._txckpt_resolve_on_rank0(resume, root)}
            except BaseException as e:  # noqa: BLE001 - every rank must learn it
                own_error = e
                answer = {"error": {"type": type(e).__name__, "message": str(e)}}
        answer = coord.broadcast(answer)
        if own_error is not None:
            raise own_error
        if "error" in answer:
            raise _rebuild_error(answer["error"])
        path = answer["path"]
        self._txckpt_last_step = _step_of(path) if path is not None and _is_within(path, root) else None
        return path

    def _txckpt_resolve_on_rank0(self, resume: str | bool | None, root: str) -> str | None:
        so = self.txckpt_storage_options
        if resume is True:
            path = txckpt.resume(root, storage_options=so) if _exists(root, so) else None
            if path is None:
                path = _external_parent_of_empty_head(root, so)
                if path is not None:
                    log.warning("txckpt: the current lineage of %s has no checkpoint yet; it started from "
                                "the external checkpoint %s, resuming from there", root, path)
            if path is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            return path
        if resume is None or resume is False:
            if _exists(root, so) and _has_history(root, so):
                newest = txckpt.get_last_checkpoint(root, storage_options=so)
                if newest is not None:
                    log.warning(
                        "txckpt: train(resume_from_checkpoint=None) on %s, which has committed checkpoints "
                        "(newest: %s). Starting from scratch on a new lineage; the existing checkpoints are "
                        "kept but no longer resumed by resume_from_checkpoint=True. To continue them, pass "
                        "resume_from_checkpoint=True.", root, os.path.basename(newest),
                    )
                txckpt.new_lineage(root, storage_options=so)
            return None
        path = os.fspath(resume)
        if "://" not in path:
            path = os.path.abspath(path)
        if _is_within(path, root):
            return txckpt.resume(root, path=path, storage_options=so)
        txckpt.new_lineage(root, external_parent=path, storage_options=so)
        return os.fspath(resume)


# ----- helpers ----------------------------------------------------------------------------------
def _check_mro(cls: type) -> None:
    mro = cls.__mro__
    if Trainer in mro and mro.index(TransactionalCheckpointMixin) > mro.index(Trainer):
        raise TypeError(
            f"{cls.__name__}: put TransactionalCheckpointMixin before Trainer in the bases, e.g. "
            f"`class {cls.__name__}(TransactionalCheckpointMixin, Trainer)`; after Trainer its "
            "overrides never run and checkpoints would be written in place"
        )


def _check_save_on_each_node(args: Any) -> None:
    """save_on_each_node=True on several nodes makes each node's local rank 0 write its own copy
    of the staging directory on node-local storage, while only global rank 0 commits: refuse."""
    if not getattr(args, "save_on_each_node", False) or args.world_size <= 1:
        return
    local = next((os.environ[v] for v in _LOCAL_WORLD_SIZE_VARS if os.environ.get(v)), None)
    if local is not None and int(local) == args.world_size:
        return  # one node: save_on_each_node changes nothing
    raise ValueError(
        "TransactionalCheckpointMixin does not support save_on_each_node=True across several nodes "
        f"(world size {args.world_size}, local world size {local or 'unknown'}): a txckpt checkpoint "
        "is committed once, by global rank 0, from one staging directory that every rank writes. Put "
        "output_dir on storage all nodes share (or an fsspec URL) and set save_on_each_node=False."
    )


def _is_within(path: str, root: str) -> bool:
    if "://" in path or "://" in root:
        return path.rstrip("/").startswith(root.rstrip("/") + "/")
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def _exists(root: str, storage_options: dict | None) -> bool:
    return "://" in root or storage_options is not None or os.path.isdir(root)


def _has_history(root: str, storage_options: dict | None) -> bool:
    r = txckpt.open_root(root, storage_options)
    state = r.state()
    return state.seq >= 0 or bool(r.legacy_checkpoints())


def _external_parent_of_empty_head(root: str, storage_options: dict | None) -> str | None:
    if not _exists(root, storage_options):
        return None
    state = txckpt.open_root(root, storage_options).state()
    info = state.head_info
    if info is None or info.tip is not None or not info.parent or "external" not in info.parent:
        return None
    return str(info.parent["external"])


def _step_of(path: str) -> int | None:
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None


#: Upstream uploads the whole output_dir to the Hub, ignoring only "_*" and "checkpoint-*":
#: without these, txckpt's log and the abandoned lineages' checkpoints under .txckpt/ would go too.
HUB_IGNORE_PATTERNS = [".txckpt", ".txckpt/*", "*/.txckpt/*"]


@contextlib.contextmanager
def _hub_uploads_skip_txckpt():
    """Add HUB_IGNORE_PATTERNS to every ``upload_folder`` the Trainer makes in the block: 5.x calls
    ``hf_api().upload_folder`` (an HfApi instance), 4.x the module-level ``upload_folder`` that
    ``transformers.trainer`` imported (a bound method of huggingface_hub's default HfApi)."""
    import huggingface_hub
    import transformers.trainer as hf_trainer

    def with_ignores(kwargs: dict[str, Any]) -> dict[str, Any]:
        patterns = kwargs.get("ignore_patterns") or []
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        kwargs["ignore_patterns"] = patterns + [p for p in HUB_IGNORE_PATTERNS if p not in patterns]
        return kwargs

    real_method = huggingface_hub.HfApi.upload_folder
    real_module_fn = getattr(hf_trainer, "upload_folder", None)

    @functools.wraps(real_method)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return real_method(self, *args, **with_ignores(kwargs))

    huggingface_hub.HfApi.upload_folder = method
    if real_module_fn is not None:
        hf_trainer.upload_folder = lambda *args, **kwargs: real_module_fn(*args, **with_ignores(kwargs))
    try:
        yield
    finally:
        huggingface_hub.HfApi.upload_folder = real_method
        if real_module_fn is not None:
            hf_trainer.upload_folder = real_module_fn


@contextlib.contextmanager
def _plain_cpu_map_location():
    import torch

    real = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        loc = kwargs.get("map_location")
        if isinstance(loc, (str, torch.device)) and torch.device(loc).type == "cpu":
            kwargs["map_location"] = "cpu"
        return real(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def _rebuild_error(err: dict[str, str]) -> BaseException:
    msg = f"rank 0: {err.get('message', '')}"
    cls = getattr(_errors, err.get("type", ""), None)
    if isinstance(cls, type) and issubclass(cls, _errors.TxckptError):
        return cls(msg)
    builtin = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError}
    return builtin.get(err.get("type", ""), RuntimeError)(msg)


def _apply_retention(root: str, storage_options: dict | None, keep_last: int, best: str | None) -> None:
    """The one place that talks to txckpt's retention API: ``save_total_limit`` newest of the
    current lineage plus the best; fork points, the newest and other lineages' checkpoints are
    kept by the policy itself; deletion is two-phase (retire entry, then data)."""
    from txckpt.retention import RetentionPolicy, apply_retention

    policy = RetentionPolicy.from_save_total_limit(keep_last, best)
    gone = apply_retention(txckpt.open_root(root, storage_options), policy)
    for c in gone:
        log.info("txckpt: retention (save_total_limit=%d) deleted checkpoint-%d (txid %s)", keep_last, c.step, c.txid)


class TransactionalTrainer(TransactionalCheckpointMixin, Trainer):
    """``transformers.Trainer`` with :class:`TransactionalCheckpointMixin`."""


__all__ = ["TransactionalCheckpointMixin", "TransactionalTrainer"]
