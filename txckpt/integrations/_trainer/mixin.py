"""The Trainer mixin: transactional checkpoints and lineage-aware resume for transformers' ``Trainer``.

Users import it from txckpt.integrations.transformers (the public module)::

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
* ``txckpt_root`` (constructor keyword or class attribute) puts the txckpt root elsewhere, e.g.
  ``"s3://bucket/run"``, while ``args.output_dir`` stays local. The Trainer's writers then write
  into a local scratch directory that txckpt uploads at commit, and a checkpoint to resume from
  (or the best model to load at the end, or a checkpoint to push to the Hub) is first fetched,
  verified, into a local cache (``txckpt_cache_dir``, default ``<output_dir>/.txckpt-cache``).

The mixin's helpers are modules of their own: ``resume`` (what a resume resolves to, on
rank 0), ``remote_cache`` (a remote root's local cache), ``patches`` (the global
patches, each held for one upstream call) and ``paths`` (names and path tests).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from typing import Any

import transformers
import transformers.trainer as hf_trainer
from transformers import Trainer

import txckpt
from txckpt import errors as _errors
from txckpt._base.coordination import current_coordinator, decide_on_rank0
from txckpt._root.fallback import check_on_damaged
from txckpt.integrations._trainer.verbosity import follow_transformers_verbosity, log_resume
from txckpt._maintenance.retention import RetentionPolicy, apply_retention, rewind

from .async_saves import AsyncSaves, check_mode
from .exactness import warn_inexact_resume_once
from .patches import (
    HUB_IGNORE_PATTERNS,
    grouped_weights_through,
    hub_uploads_skip_txckpt,
    plain_cpu_map_location,
    remote_best_checkpoints_kept,
    torch_save_through,
)
from .preempt import PreemptionSave, note_committed
from .paths import (
    PREFIX_CHECKPOINT_DIR,
    check_save_on_each_node,
    TRAINER_STATE_NAME,
    checkpoint_name_step,
    public_name,
    is_remote,
    is_within,
    same_dir,
    step_of,
)
from ..._base.layout import is_url
from .rank_files import claim_rank_files
from .remote_cache import RemoteCache
from .resume import committed_step_path, resolve_on_rank0, tiered_for, tiered_settings

log = logging.getLogger("txckpt.transformers")


class TransactionalCheckpointMixin:
    """Make a ``transformers.Trainer`` save every checkpoint as one txckpt transaction and resume
    along lineages. Place it **leftmost**: ``class MyTrainer(TransactionalCheckpointMixin, Trainer)``.

    Settings, as constructor keywords (``MyTrainer(..., txckpt_root="s3://bucket/run")``) or as
    class attributes of a subclass (the keyword wins):

    * ``txckpt_root``: the txckpt root, any local path or fsspec URL (``s3://``, ``gs://``,
      ``az://``, ...). ``None`` (default): ``args.output_dir`` is the root.
    * ``txckpt_storage_options``: fsspec options for the root (credentials, ``endpoint_url``...),
      passed to every txckpt call; also used to read a remote checkpoint given as
      ``resume_from_checkpoint``.
    * ``txckpt_cache_dir``: the local directory for a remote root's local copies (checkpoints
      fetched to resume, load the best model or push to the Hub) and upload staging. Default
      ``<output_dir>/.txckpt-cache``. It belongs to the run: do not share it between jobs.
    * ``txckpt_timeout``: seconds a rank waits for the others inside a transaction (``None``:
      txckpt's default, ``TXCKPT_COORDINATION_TIMEOUT`` or 600 s).
    * ``txckpt_on_damaged``: what ``resume_from_checkpoint=True`` does when the newest checkpoint
      fails verification (it is verified before upstream loads it; a remote one while it is
      fetched into the cache): ``"raise"`` (default) IntegrityError naming the file;
      ``"fallback"`` forks from the newest checkpoint that verifies (``txckpt.resume``).

    * ``txckpt_async_save``: ``True`` saves in the background, from a lazy snapshot (the
      parameters and optimizer state copied by the background while the next forward and
      backward run; the next optimizer step waits for that copy) unless the optimizer changes
      parameters outside its step (layer-wise and LOMO optimizers), then from a copy made before
      ``_save_checkpoint`` returns (copy-first). ``"lazy"`` or ``"copy"`` chooses one
      (docs/async.md, "Trainer": ordering, errors).
    * ``txckpt_save_on_preemption``: ``True`` (or a grace in seconds): SIGTERM / SIGUSR1 make the
      Trainer save at the next step boundary, stop, and the process exit with 128 + the signal
      (``txckpt.preemption``, installed by ``train()`` unless the script did; docs/preemption.md).
    * ``txckpt_incremental``: ``True`` shares every file a committed checkpoint already holds
      byte for byte (frozen shards, tokenizer, config) instead of keeping it twice: a hard link on
      a local root, a server-side copy (no upload) on an object store (docs/incremental.md).

    Class attribute only: ``txckpt_stream_optimizer`` (default True): the ``torch.save`` calls of
    upstream's ``_save_optimizer_and_scheduler`` (``optimizer.pt``, ``scheduler.pt``) write
    through the transaction, hashed while written, instead of being read back and hashed at
    commit. Set it to False in a subclass whose own code rewrites those files afterwards (the
    save is refused otherwise: the commit would record the first version's checksum).
    """

    # Set by Trainer.__init__ (declared for the type checker; the mixin goes before Trainer).
    args: Any
    state: Any
    model: Any

    txckpt_root: str | None = None
    txckpt_storage_options: dict[str, Any] | None = None
    txckpt_cache_dir: str | None = None
    txckpt_timeout: float | None = None
    txckpt_on_damaged: str = "raise"
    txckpt_stream_optimizer: bool = True
    txckpt_async_save: bool | str = False
    txckpt_save_on_preemption: bool | float = False
    txckpt_incremental: bool = False

    def __init_subclass__(cls, **kwargs: Any):
        # Runs at class definition, even when Trainer comes first (whose __init__ would then
        # never reach ours).
        super().__init_subclass__(**kwargs)
        _check_mro(cls)

    def __init__(
        self,
        *args: Any,
        txckpt_root: str | os.PathLike | txckpt.TieredRoot | None = None,
        txckpt_storage_options: dict[str, Any] | None = None,
        txckpt_cache_dir: str | os.PathLike | None = None,
        txckpt_timeout: float | None = None,
        txckpt_on_damaged: str | None = None,
        txckpt_async_save: bool | str | None = None,
        txckpt_save_on_preemption: bool | float | None = None,
        txckpt_incremental: bool | None = None,
        **kwargs: Any,
    ):
        _check_mro(type(self))
        txckpt_root, txckpt_storage_options, self._txckpt_tiered = tiered_settings(txckpt_root, txckpt_storage_options)
        if txckpt_on_damaged is not None:
            check_on_damaged(txckpt_on_damaged)
        given = {
            "txckpt_on_damaged": txckpt_on_damaged,
            "txckpt_timeout": txckpt_timeout,
            "txckpt_root": None if txckpt_root is None else os.fspath(txckpt_root),
            "txckpt_storage_options": None if txckpt_storage_options is None else dict(txckpt_storage_options),
            "txckpt_cache_dir": None if txckpt_cache_dir is None else os.fspath(txckpt_cache_dir),
            "txckpt_async_save": None if txckpt_async_save is None else check_mode(txckpt_async_save),
            "txckpt_save_on_preemption": txckpt_save_on_preemption,
            "txckpt_incremental": txckpt_incremental,
        }
        for name, value in given.items():
            if value is not None:
                setattr(self, name, value)
        # Set before Trainer.__init__: it may call overridden methods (e.g. _get_output_dir).
        self._txckpt_tx: Any = None
        #: Files of the open transaction written through it by _save_optimizer_and_scheduler.
        self._txckpt_streamed: set[str] = set()
        self._txckpt_pending_push: tuple[tuple, dict] | None = None
        #: The newest step this process knows to be committed in its lineage (resumed or saved).
        self._txckpt_last_step: int | None = None
        #: Remote root: the cache's checkpoint copies are dropped after train()'s first commit.
        self._txckpt_prune_after_commit = False
        #: Remote root: the local cache (checkpoint copies, Hub push sources, upload staging).
        self._txckpt_remote = RemoteCache(self)
        #: txckpt_async_save: the save in flight and what follows its commit (async_saves).
        self._txckpt_async = AsyncSaves(self)
        super().__init__(*args, **kwargs)
        self._txckpt_install_jit()
        self._txckpt_async.install()
        preempt = self.txckpt_save_on_preemption
        self._txckpt_preempt = (
            None if preempt is False else PreemptionSave(self, None if preempt is True else float(preempt))
        )

    # ----- where things go ---------------------------------------------------------------------
    def _txckpt_already_committed(self, trial: Any) -> bool:
        """Whether this step is the lineage's newest committed checkpoint already (logged if so).
        E.g. a JIT checkpoint requested right after a regular save or a resume: checkpoint-N
        holds this step; saving it again would be a StepConflictError."""
        step = int(self.state.global_step)
        if self._txckpt_last_step is None or step != self._txckpt_last_step:
            return False
        log.info(
            "%s is already committed in this lineage; not saving it again",
            public_name(self._txckpt_root(trial), self.txckpt_storage_options, step),
        )
        return True

    def _txckpt_root(self, trial: Any = None) -> str:
        """The txckpt root: ``txckpt_root`` if set, else the run directory upstream would use
        (output_dir, or the trial's run directory during a hyperparameter search; with
        ``txckpt_root`` a trial gets the same sub-path under it)."""
        run_dir = super()._get_output_dir(trial)  # type: ignore[misc]
        if self.txckpt_root is None:
            return run_dir if is_url(run_dir) else os.path.abspath(run_dir)
        root = os.fspath(self.txckpt_root)
        rel = os.path.relpath(run_dir, self.args.output_dir) if not is_url(run_dir) else "."
        if rel != ".":
            root = root.rstrip("/") + "/" + rel.replace(os.sep, "/") if is_url(root) else os.path.join(root, rel)
            tiered_for(self, root)  # a trial under a TieredRoot: replicated as the run is
        return root if is_url(root) else os.path.abspath(root)

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
        check_save_on_each_node(self.args)
        follow_transformers_verbosity(self.args)  # the save's records show at transformers' verbosity
        warn_inexact_resume_once(self)
        if self.txckpt_async_save:
            return self._txckpt_async.save(super()._save_checkpoint, model, trial, *args, **kwargs)  # type: ignore[misc]
        if self._txckpt_already_committed(trial):
            return
        step = int(self.state.global_step)
        root = self._txckpt_root(trial)
        self._txckpt_pending_push = None
        with txckpt.transaction(
            root,
            step,
            storage_options=self.txckpt_storage_options,
            metadata=self._txckpt_metadata(trial),
            timeout=self.txckpt_timeout,
            incremental=self.txckpt_incremental,
        ) as tx:
            self._txckpt_tx = tx
            try:
                claim_rank_files(self, tx)  # each rank hashes its own rng_state_r / ZeRO / .distcp files
                if is_remote(root):
                    self._txckpt_remote.make_scratch(tx)
                # <root>/checkpoint-N on a local disk; the transaction's own key on object stores.
                expected = tx.final_path
                self._txckpt_streamed = set()
                self._txckpt_resolve_best(root, step)
                # Incremental: the model's one model.safetensors is saved grouped, its frozen
                # tensors in a stock shard of their own that later saves share (issue 47).
                grouped = grouped_weights_through(tx, self.model) if self.txckpt_incremental else None
                with grouped if grouped is not None else contextlib.nullcontext():
                    super()._save_checkpoint(model, trial, *args, **kwargs)  # type: ignore[misc]
                self._txckpt_check_streamed(tx)
                self._txckpt_publish_best(tx, expected)
            finally:
                self._txckpt_tx = None
        committed = tx.path
        assert committed is not None
        self._txckpt_last_step = step
        note_committed(self, step, committed)  # a preemption's save: its exit says what committed
        if committed != expected:
            if self.state.best_model_checkpoint == expected:
                self.state.best_model_checkpoint = committed
            log.warning(
                "%s was committed at %s, not at %s; trainer_state.json inside it names %s as best_model_checkpoint",
                public_name(root, self.txckpt_storage_options, step),
                committed,
                expected,
                expected,
            )
        if self._txckpt_prune_after_commit:
            self._txckpt_prune_after_commit = False
            self._txckpt_remote.drop_cached_copies()
        # The Hub push that upstream asked for during the save, now from the committed directory
        # (on a remote root, from a verified local copy of it: see _push_from_checkpoint).
        pending, self._txckpt_pending_push = self._txckpt_pending_push, None
        if pending is not None:
            self._push_from_checkpoint(committed, *pending[0], **pending[1])
        if self.is_world_process_zero():  # type: ignore[attr-defined]
            self._txckpt_retention(root)

    def _save_optimizer_and_scheduler(self, output_dir: str, *args: Any, **kwargs: Any) -> None:
        """Upstream's, with every ``torch.save(obj, <checkpoint dir>/<name>)`` it makes (the
        optimizer and scheduler; the scaler and RNG files are written elsewhere) sent through the
        transaction: the file lands at the same path with the same content as far as
        ``torch.load`` is concerned, but is hashed while streamed (the commit does not read the
        optimizer's hundreds of MB back), without torch's zip CRC32 pass (txckpt's xxh3-128
        covers every byte; ``TXCKPT_TORCH_ZIP_CRC=1`` keeps it) and with write-back started
        while it is written. Only in upstream's plain case: DeepSpeed, FSDP, XLA and SageMaker
        MP save as upstream does, and their files are hashed at commit."""
        tx = self._txckpt_tx
        if (
            tx is None
            or not self.txckpt_stream_optimizer
            or not self._txckpt_plain_optimizer_save()
            or not same_dir(output_dir, tx.directory)
        ):
            return super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)  # type: ignore[misc]
        with torch_save_through(tx, self._txckpt_streamed):
            return super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)  # type: ignore[misc]

    def _txckpt_plain_optimizer_save(self) -> bool:
        """Whether upstream's _save_optimizer_and_scheduler takes its plain branch (the same
        conditions in 4.57 and 5.x): ``torch.save`` of the optimizer and of the scheduler on the
        saving process, nothing else. DeepSpeed, FSDP, XLA and SageMaker MP are left alone."""
        for probe in ("is_torch_xla_available", "is_sagemaker_mp_enabled"):
            fn = getattr(hf_trainer, probe, None)
            if fn is None or fn():
                return False
        return not (
            getattr(self, "is_deepspeed_enabled", False)
            or getattr(self, "is_fsdp_enabled", False)
            or getattr(self, "is_fsdp_xla_enabled", False)
        )

    def _txckpt_check_streamed(self, tx: Any) -> None:
        """A file written through the transaction and then rewritten in staging by other code
        would be committed with the first version's checksum: refuse (nothing is committed),
        with the transaction's own check, and say how a Trainer avoids it."""
        try:
            tx.check_not_rewritten()
        except _errors.InvalidArgumentError as e:
            raise _errors.InvalidArgumentError(
                f"{e} (by a subclass?): set txckpt_stream_optimizer = False on the Trainer class so that "
                "txckpt hashes the optimizer's and scheduler's files at commit instead"
            ) from e

    def _txckpt_metadata(self, trial: Any) -> dict[str, Any]:
        return {
            "producer": "txckpt.integrations.transformers",
            "transformers_version": transformers.__version__,
            "trainer_class": type(self).__name__,
            "global_step": int(self.state.global_step),
            "epoch": None if self.state.epoch is None else float(self.state.epoch),
            "trial": None if trial is None else str(getattr(trial, "number", trial)),
        }

    def _txckpt_resolve_best(self, root: str, step: int) -> None:
        """Upstream's save sets best_model_checkpoint to ``<run_dir>/checkpoint-<best_global_step>``
        if that directory exists; here run_dir is the staging root, where an older step never is
        (a best found by an evaluation after its commit, eval per epoch and save per step, would be
        lost, and retention would delete it). Resolve the step against the current lineage's
        committed checkpoints, before upstream writes trainer_state.json; none: keep the value."""
        best_step = getattr(self.state, "best_global_step", None)
        strategy = getattr(self.args.save_strategy, "value", self.args.save_strategy)
        if not best_step or int(best_step) == step or strategy not in ("steps", "epoch", "best"):
            return  # the step being saved: upstream names staging, _txckpt_publish_best fixes it
        current = self.state.best_model_checkpoint
        if current is not None and checkpoint_name_step(current) == int(best_step):
            return  # resolved at an earlier save
        path = committed_step_path(root, self.txckpt_storage_options, int(best_step))
        if path is not None:
            self.state.best_model_checkpoint = path

    def _txckpt_publish_best(self, tx: Any, expected: str) -> None:
        """Upstream derives best_model_checkpoint from _get_output_dir, i.e. from staging, when the
        best step is the one being saved. Point it at the published path, in memory and in this
        checkpoint's trainer_state.json, before the commit."""
        best = self.state.best_model_checkpoint
        if best is None or not is_within(best, tx.output_root):
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
        copy = None
        if is_remote(os.fspath(checkpoint_folder)) and self._txckpt_would_push():
            # Upstream copies files out of the folder and uploads it with local paths: push
            # from a verified local copy of the committed checkpoint.
            try:
                copy = self._txckpt_remote.push_copy(os.fspath(checkpoint_folder))
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; a push is optional
                log.warning(
                    "not pushing %s to the Hub: fetching a local copy failed (%s: %s)",
                    checkpoint_folder,
                    type(e).__name__,
                    e,
                )
                return
            checkpoint_folder = copy
        with hub_uploads_skip_txckpt(self._txckpt_hub_ignores()):
            result = super()._push_from_checkpoint(checkpoint_folder, *args, **kwargs)  # type: ignore[misc]
        if copy is not None:
            self._txckpt_remote.push_copies.append((copy, getattr(self, "push_in_progress", None)))
        return result

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        with hub_uploads_skip_txckpt(self._txckpt_hub_ignores()):
            return super().push_to_hub(*args, **kwargs)  # type: ignore[misc]

    def _txckpt_hub_ignores(self) -> list[str]:
        """HUB_IGNORE_PATTERNS, plus the cache directory if it is inside output_dir under another name."""
        extra = []
        out = os.path.abspath(self.args.output_dir)
        cache = self._txckpt_remote.directory
        if is_within(cache, out) and os.path.realpath(cache) != os.path.realpath(out):
            rel = os.path.relpath(cache, out).replace(os.sep, "/")
            extra = [rel, rel + "/*"]
        return HUB_IGNORE_PATTERNS + [p for p in extra if p not in HUB_IGNORE_PATTERNS]

    def _txckpt_would_push(self) -> bool:
        """Whether upstream's _push_from_checkpoint will read the folder (its early returns,
        identical in 4.57 and 5.x): only then is a remote checkpoint worth fetching."""
        strategy = getattr(self.args, "hub_strategy", None)
        if not self.is_world_process_zero() or getattr(strategy, "value", strategy) == "end":  # type: ignore[attr-defined]
            return False
        job = getattr(self, "push_in_progress", None)
        return bool(self.args.hub_always_push) or job is None or job.is_done()

    def _load_best_model(self, *args: Any, **kwargs: Any) -> Any:
        """Remote root: ``best_model_checkpoint`` names the committed remote checkpoint. Upstream
        loads it from local paths: load it from a verified local copy in the cache (every rank
        calls this, after upstream's barrier). The state keeps naming the remote checkpoint."""
        best = self.state.best_model_checkpoint
        if best is None or not is_remote(best):
            return super()._load_best_model(*args, **kwargs)  # type: ignore[misc]
        try:
            local = self._txckpt_remote.fetch_committed(best)
        except (_errors.CheckpointNotFoundError, _errors.ManifestError) as e:
            log.warning("could not load the best model from %s (%s); keeping the last weights", best, e)
            return None
        self.state.best_model_checkpoint = local
        try:
            return super()._load_best_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.state.best_model_checkpoint = best

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        """transformers 5.x drops a resumed ``best_model_checkpoint`` that is not a local
        directory (with a warning that it "does not exist anymore"). On a remote root it is the
        remote checkpoint: keep it while it is still committed. (4.57 keeps it unchecked.)"""
        with remote_best_checkpoints_kept() as remote:
            result = super()._init_training_state(*args, **kwargs)  # type: ignore[misc]
        if remote and self.state.best_model_checkpoint is None:
            try:
                txckpt.read_manifest(remote[-1], storage_options=self.txckpt_storage_options)
                self.state.best_model_checkpoint = remote[-1]
            except (_errors.CheckpointNotFoundError, _errors.ManifestError):
                log.warning(
                    "the best checkpoint %s recorded in the resumed state is gone; ignoring it for this run", remote[-1]
                )
        return result

    def _rotate_checkpoints(self, use_mtime: bool = False, output_dir: str | None = None) -> None:
        """transformers 4.x rotation: disabled (it is mtime-ordered and lineage-blind). txckpt's
        retention runs after each commit instead. (5.x calls a module function that only sees
        the transaction's staging root, which holds just the checkpoint being saved.)"""
        return None

    def _sorted_checkpoints(
        self, output_dir: str | None = None, checkpoint_prefix: str = PREFIX_CHECKPOINT_DIR, use_mtime: bool = False
    ) -> list[str]:
        """transformers 4.x: feeds rotation and the end-of-training ``save_total_limit == 1``
        cleanup, which would delete every other lineage's checkpoint-N. Nothing for them."""
        return []

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers 5.x: the end-of-training cleanup deletes every ``checkpoint-*`` of the run
        directory but the best when ``save_total_limit == 1``, through the module function
        ``sort_checkpoints``, which a subclass cannot redirect, with ``rmtree`` (other lineages'
        checkpoints and internal names included). Do the same through txckpt first
        (:meth:`_txckpt_keep_only_best`), then hide the limit from upstream's cleanup."""
        self._txckpt_async.finish()  # the best model loaded below and the cleanup need the last commit
        limit = self.args.save_total_limit
        hide = limit == 1 and self.state.best_model_checkpoint is not None
        if hide:
            self._txckpt_keep_only_best(trial)
            self.args.save_total_limit = None
        try:
            return super()._finalize_training(trial, *args, **kwargs)  # type: ignore[misc]
        finally:
            if hide:
                self.args.save_total_limit = limit

    def _txckpt_keep_only_best(self, trial: Any) -> None:
        """End of training with ``save_total_limit == 1`` and a best checkpoint: upstream keeps
        only the best (it deletes the newest too, so a restart resumes the best). Here the current
        lineage is rolled back to the best and the newer checkpoints it leaves are retired
        (``txckpt._maintenance.retention.rewind``: a fork entry, a retire entry, then the data); other lineages
        are not touched. Rank 0, like upstream's ``should_save`` cleanup; a failure is logged,
        never fatal (the newest then stays, as after a crash in between)."""
        best = self.state.best_model_checkpoint
        if best is None or not self.args.should_save or not self.is_world_process_zero():  # type: ignore[attr-defined]
            return
        root = self._txckpt_root(trial)
        try:
            gone = rewind(txckpt.open_root(root, self.txckpt_storage_options), best)
        except Exception as e:  # noqa: BLE001 - the checkpoints are committed; this only frees space
            log.warning(
                "save_total_limit=1: keeping only the best checkpoint %s at the end of "
                "training failed (%s: %s); the newest is kept too",
                best,
                type(e).__name__,
                e,
            )
            return
        if gone:  # (rewind logs what it retired) the lineage's newest is the best now
            self._txckpt_last_step = checkpoint_name_step(best)

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
            log.warning(
                "retention after the commit failed (%s: %s); nothing was deleted "
                "that must be kept; `txckpt gc` retries",
                type(e).__name__,
                e,
            )

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
        log.info("JIT checkpoint at step %d", self.state.global_step)
        self._save_checkpoint(self.model, trial=None)
        self._txckpt_async.settle()  # async: a JIT checkpoint precedes a preemption; commit it now

    # ----- resume ------------------------------------------------------------------------------
    def _load_optimizer_and_scheduler(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        """transformers 4.x loads the optimizer with ``map_location=args.device`` in a multi-process
        run; on CPU that is an indexed device ("cpu:0"), which torch >= 2.x refuses to restore, so
        a CPU DDP run cannot resume at all (stock Trainer included). 5.x maps to plain "cpu"; do
        the same here. Nothing changes unless the device is an indexed CPU device."""
        device = getattr(self.args, "device", None)
        if checkpoint is None or getattr(device, "type", None) != "cpu" or getattr(device, "index", None) is None:
            return super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)  # type: ignore[misc]
        with plain_cpu_map_location():
            return super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)  # type: ignore[misc]

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        if "model_path" in kwargs:  # transformers 4.x's deprecated alias
            warnings.warn("`model_path` is deprecated; use `resume_from_checkpoint`", FutureWarning, stacklevel=2)
            resume_from_checkpoint = kwargs.pop("model_path")
        check_save_on_each_node(self.args)
        resolved = self._txckpt_resolve_resume(resume_from_checkpoint, trial)
        if self._txckpt_preempt is not None:
            self._txckpt_preempt.begin()
        completed = False
        try:
            result = super().train(  # type: ignore[misc]
                resume_from_checkpoint=resolved, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
            self._txckpt_async.finish()  # transformers 4.x (no _finalize_training): the last commit
            if (
                not hasattr(Trainer, "_finalize_training")
                and self.args.save_total_limit == 1
                and self.state.best_model_checkpoint is not None
            ):
                # transformers 4.x: its inline end-of-training cleanup got no checkpoints from
                # _sorted_checkpoints; keep only the best here, as 5.x's _finalize_training does.
                self._txckpt_keep_only_best(trial)
            completed = True
            return result
        finally:
            self._txckpt_async.finish(raise_error=False)  # train() raised: its error, not a save's
            self._txckpt_remote.drop_push_copies()  # upstream waited for the last push at the end
            if self._txckpt_preempt is not None:  # preempted: exit with 128 + signum
                self._txckpt_preempt.end(completed=completed)

    def _txckpt_resolve_resume(self, resume: str | bool | None, trial: Any) -> str | None:
        """Rank 0 decides (and records any lineage change); every rank gets its answer. A remote
        answer is fetched into the local cache on every rank, and the local copy returned."""
        root = self._txckpt_root(trial)
        follow_transformers_verbosity(self.args)  # a rollback's warning, the resume's line: labelled
        coord = current_coordinator(self.txckpt_timeout, "resume")
        if is_remote(root) and int(getattr(self.args, "local_process_index", 0)) == 0:
            # Before the broadcast: no rank can be saving (into staging) until every rank is past it.
            self._txckpt_remote.clean_staging()
        path = decide_on_rank0(lambda: resolve_on_rank0(self, resume, root), phase="resume", coordinator=coord)
        local = path
        # Remote root: after this run's first commit, the cache's checkpoint copies (this resume's,
        # an earlier run's best) are no longer read by anyone.
        self._txckpt_prune_after_commit = is_remote(root)
        if path is not None and is_remote(path):
            local = self._txckpt_remote.fetch_committed(path)
        log_resume(self, path, local)
        self._txckpt_last_step = (
            step_of(local) if path is not None and local is not None and is_within(path, root) else None
        )
        return local


# ----- helpers ----------------------------------------------------------------------------------
def _check_mro(cls: type) -> None:
    mro = cls.__mro__
    if Trainer in mro and mro.index(TransactionalCheckpointMixin) > mro.index(Trainer):
        raise TypeError(
            f"{cls.__name__}: put TransactionalCheckpointMixin before Trainer in the bases, e.g. "
            f"`class {cls.__name__}(TransactionalCheckpointMixin, Trainer)`; after Trainer its "
            "overrides never run and checkpoints would be written in place"
        )


def _apply_retention(root: str, storage_options: dict | None, keep_last: int, best: str | None) -> None:
    """The one place that talks to txckpt's retention API: ``save_total_limit`` newest of the
    current lineage plus the best; fork points, the newest and other lineages' checkpoints are
    kept by the policy itself; deletion is two-phase (retire entry, then data)."""
    policy = RetentionPolicy.from_save_total_limit(keep_last, best)
    r = txckpt.open_root(root, storage_options)
    gone = apply_retention(r, policy)
    for c in gone:
        log.info(
            "retention (save_total_limit=%d) deleted %s (txid %s)",
            keep_last,
            r.publication.naming.name_of(c.step, c.key),
            c.txid,
        )


class TransactionalTrainer(TransactionalCheckpointMixin, Trainer):
    """``transformers.Trainer`` with :class:`TransactionalCheckpointMixin`."""


__all__ = ["TransactionalCheckpointMixin", "TransactionalTrainer"]
