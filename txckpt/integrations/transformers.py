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
* ``txckpt_root`` (constructor keyword or class attribute) puts the txckpt root elsewhere, e.g.
  ``"s3://bucket/run"``, while ``args.output_dir`` stays local. The Trainer's writers then write
  into a local scratch directory that txckpt uploads at commit, and a checkpoint to resume from
  (or the best model to load at the end, or a checkpoint to push to the Hub) is first fetched,
  verified, into a local cache (``txckpt_cache_dir``, default ``<output_dir>/.txckpt-cache``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import warnings
from typing import Any

import transformers
from transformers import Trainer

import txckpt
from txckpt.coordination import coordination_timeout, current_coordinator
from txckpt import errors as _errors
from txckpt.fallback import check_on_damaged
from txckpt.progress import follow_transformers_verbosity

log = logging.getLogger("txckpt.transformers")

PREFIX_CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")
_LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


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

    Class attribute only: ``txckpt_stream_optimizer`` (default True): the ``torch.save`` calls of
    upstream's ``_save_optimizer_and_scheduler`` (``optimizer.pt``, ``scheduler.pt``) write
    through the transaction, hashed while written, instead of being read back and hashed at
    commit. Set it to False in a subclass whose own code rewrites those files afterwards (the
    save is refused otherwise: the commit would record the first version's checksum).
    """

    txckpt_root: str | None = None
    txckpt_storage_options: dict[str, Any] | None = None
    txckpt_cache_dir: str | None = None
    txckpt_timeout: float | None = None
    txckpt_on_damaged: str = "raise"
    txckpt_stream_optimizer: bool = True

    def __init_subclass__(cls, **kwargs: Any):
        # Runs at class definition, even when Trainer comes first (whose __init__ would then
        # never reach ours).
        super().__init_subclass__(**kwargs)
        _check_mro(cls)

    def __init__(self, *args: Any, txckpt_root: str | os.PathLike | None = None,
                 txckpt_storage_options: dict[str, Any] | None = None,
                 txckpt_cache_dir: str | os.PathLike | None = None,
                 txckpt_timeout: float | None = None, txckpt_on_damaged: str | None = None, **kwargs: Any):
        _check_mro(type(self))
        if txckpt_on_damaged is not None:
            check_on_damaged(txckpt_on_damaged)
            self.txckpt_on_damaged = txckpt_on_damaged
        if txckpt_root is not None:
            self.txckpt_root = os.fspath(txckpt_root)
        if txckpt_storage_options is not None:
            self.txckpt_storage_options = dict(txckpt_storage_options)
        if txckpt_cache_dir is not None:
            self.txckpt_cache_dir = os.fspath(txckpt_cache_dir)
        if txckpt_timeout is not None:
            self.txckpt_timeout = txckpt_timeout
        # Set before Trainer.__init__: it may call overridden methods (e.g. _get_output_dir).
        self._txckpt_tx = None
        #: Files of the open transaction written through it by _save_optimizer_and_scheduler.
        self._txckpt_streamed: dict[str, Any] = {}
        self._txckpt_pending_push: tuple[tuple, dict] | None = None
        #: The newest step this process knows to be committed in its lineage (resumed or saved).
        self._txckpt_last_step: int | None = None
        #: Remote root: the cache's checkpoint copies are dropped after train()'s first commit.
        self._txckpt_prune_after_commit = False
        #: Remote root: local copies made for Hub pushes, with the push job reading them.
        self._txckpt_push_copies: list[tuple[str, Any]] = []
        #: Remote root: the cache copy rank 0 fetched (and so verified) while resuming, by path.
        self._txckpt_verified: dict[str, str] = {}
        super().__init__(*args, **kwargs)
        self._txckpt_install_jit()

    # ----- where things go ---------------------------------------------------------------------
    def _txckpt_root(self, trial: Any = None) -> str:
        """The txckpt root: ``txckpt_root`` if set, else the run directory upstream would use
        (output_dir, or the trial's run directory during a hyperparameter search; with
        ``txckpt_root`` a trial gets the same sub-path under it)."""
        run_dir = super()._get_output_dir(trial)  # type: ignore[misc]
        if self.txckpt_root is None:
            return run_dir if _is_url(run_dir) else os.path.abspath(run_dir)
        root = os.fspath(self.txckpt_root)
        rel = os.path.relpath(run_dir, self.args.output_dir) if not _is_url(run_dir) else "."  # type: ignore[attr-defined]
        if rel != ".":
            root = root.rstrip("/") + "/" + rel.replace(os.sep, "/") if _is_url(root) else os.path.join(root, rel)
        return root if _is_url(root) else os.path.abspath(root)

    def _txckpt_cache(self) -> str:
        """The local cache of a remote root: ``<cache>/<txid>/checkpoint-N`` (fetched to resume
        or to load the best model), ``<cache>/push/...`` (Hub push sources), ``<cache>/staging``
        (the transactions' local scratch directories, uploaded at commit)."""
        if self.txckpt_cache_dir is not None:
            return os.path.abspath(os.fspath(self.txckpt_cache_dir))
        return os.path.join(os.path.abspath(self.args.output_dir), CACHE_DIR_NAME)  # type: ignore[attr-defined]

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
        follow_transformers_verbosity()  # the save's records show at transformers' verbosity
        step = int(self.state.global_step)
        if self._txckpt_last_step is not None and step == self._txckpt_last_step:
            # E.g. a JIT checkpoint requested right after a regular save or a resume: the committed
            # checkpoint-N already holds this step; saving it again would be a StepConflictError.
            log.info("checkpoint-%d is already committed in this lineage; not saving it again", step)
            return
        root = self._txckpt_root(trial)
        self._txckpt_pending_push = None
        with txckpt.transaction(
            root, step, storage_options=self.txckpt_storage_options,
            metadata=self._txckpt_metadata(trial), timeout=self.txckpt_timeout,
        ) as tx:
            self._txckpt_tx = tx
            try:
                if _is_remote(root):
                    self._txckpt_make_scratch(tx)
                # <root>/checkpoint-N on a local disk; the transaction's own key on object stores.
                expected = tx.final_path
                self._txckpt_streamed = {}
                self._txckpt_resolve_best(root, step)
                super()._save_checkpoint(model, trial, *args, **kwargs)  # type: ignore[misc]
                self._txckpt_check_streamed(tx)
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
                "checkpoint-%d was committed at %s, not at %s; trainer_state.json inside it "
                "names %s as best_model_checkpoint", step, committed, expected, expected,
            )
        if self._txckpt_prune_after_commit:
            self._txckpt_drop_cached_copies()
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
        if tx is None or not self.txckpt_stream_optimizer or not self._txckpt_plain_optimizer_save() \
                or not _same_dir(output_dir, tx.directory):
            return super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)  # type: ignore[misc]
        with _torch_save_through(tx, self._txckpt_streamed):
            return super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)  # type: ignore[misc]

    def _txckpt_plain_optimizer_save(self) -> bool:
        """Whether upstream's _save_optimizer_and_scheduler takes its plain branch (the same
        conditions in 4.57 and 5.x): ``torch.save`` of the optimizer and of the scheduler on the
        saving process, nothing else. DeepSpeed, FSDP, XLA and SageMaker MP are left alone."""
        import transformers.trainer as hf_trainer

        for probe in ("is_torch_xla_available", "is_sagemaker_mp_enabled"):
            fn = getattr(hf_trainer, probe, None)
            if fn is None or fn():
                return False
        return not (getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
                    or getattr(self, "is_fsdp_xla_enabled", False))

    def _txckpt_check_streamed(self, tx: Any) -> None:
        """A file written through the transaction and then rewritten in staging by other code
        would be committed with the first version's checksum: refuse (nothing is committed)."""
        changed = [n for n, sig in self._txckpt_streamed.items()
                   if sig is not None and _file_signature(os.path.join(tx.directory, n)) != sig]
        if changed:
            raise _errors.InvalidArgumentError(
                f"{changed} were rewritten in the checkpoint directory after txckpt wrote them "
                "(by a subclass?); set txckpt_stream_optimizer = False on the Trainer class so that "
                "txckpt hashes them at commit instead"
            )

    def _txckpt_make_scratch(self, tx: Any) -> None:
        """On a remote root ``tx.directory`` is a local scratch directory (uploaded at commit).
        txckpt creates it under ``$TXCKPT_STAGING_DIR``, else the system temp dir; unless the
        user chose, put it in the run's cache, next to output_dir, not in a possibly small /tmp
        (and where the next run's start removes what a hard kill left)."""
        if os.environ.get(STAGING_ENV):
            tx.directory
            return
        base = os.path.join(self._txckpt_cache(), STAGING_DIR_NAME)
        os.makedirs(base, exist_ok=True)
        with _env_var(STAGING_ENV, base):
            tx.directory

    def _txckpt_clean_staging(self) -> None:
        """Remove scratch directories that a hard-killed save left in the cache's staging dir.
        Runs at train() start on each node's local rank 0, before any rank can save."""
        base = os.path.join(self._txckpt_cache(), STAGING_DIR_NAME)
        if os.environ.get(STAGING_ENV) or not os.path.isdir(base):
            return
        for name in os.listdir(base):
            if name.startswith("txckpt-"):
                log.info("removing the staging leftover %s", os.path.join(base, name))
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)

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
        strategy = getattr(self.args.save_strategy, "value", self.args.save_strategy)  # type: ignore[attr-defined]
        if not best_step or int(best_step) == step or strategy not in ("steps", "epoch", "best"):
            return  # the step being saved: upstream names staging, _txckpt_publish_best fixes it
        current = self.state.best_model_checkpoint
        if current is not None and _checkpoint_name_step(current) == int(best_step):
            return  # resolved at an earlier save
        path = _committed_step_path(root, self.txckpt_storage_options, int(best_step))
        if path is not None:
            self.state.best_model_checkpoint = path

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
        copy = None
        if _is_remote(os.fspath(checkpoint_folder)) and self._txckpt_would_push():
            # Upstream copies files out of the folder and uploads it with local paths: push
            # from a verified local copy of the committed checkpoint.
            try:
                copy = self._txckpt_push_copy(os.fspath(checkpoint_folder))
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; a push is optional
                log.warning("not pushing %s to the Hub: fetching a local copy failed (%s: %s)",
                            checkpoint_folder, type(e).__name__, e)
                return
            checkpoint_folder = copy
        with _hub_uploads_skip_txckpt(self._txckpt_hub_ignores()):
            result = super()._push_from_checkpoint(checkpoint_folder, *args, **kwargs)  # type: ignore[misc]
        if copy is not None:
            self._txckpt_push_copies.append((copy, getattr(self, "push_in_progress", None)))
        return result

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        with _hub_uploads_skip_txckpt(self._txckpt_hub_ignores()):
            return super().push_to_hub(*args, **kwargs)  # type: ignore[misc]

    def _txckpt_hub_ignores(self) -> list[str]:
        """HUB_IGNORE_PATTERNS, plus the cache directory if it is inside output_dir under another name."""
        extra = []
        out = os.path.abspath(self.args.output_dir)  # type: ignore[attr-defined]
        cache = self._txckpt_cache()
        if _is_within(cache, out) and os.path.realpath(cache) != os.path.realpath(out):
            rel = os.path.relpath(cache, out).replace(os.sep, "/")
            extra = [rel, rel + "/*"]
        return HUB_IGNORE_PATTERNS + [p for p in extra if p not in HUB_IGNORE_PATTERNS]

    def _txckpt_would_push(self) -> bool:
        """Whether upstream's _push_from_checkpoint will read the folder (its early returns,
        identical in 4.57 and 5.x): only then is a remote checkpoint worth fetching."""
        strategy = getattr(self.args, "hub_strategy", None)  # type: ignore[attr-defined]
        if not self.is_world_process_zero() or getattr(strategy, "value", strategy) == "end":  # type: ignore[attr-defined]
            return False
        job = getattr(self, "push_in_progress", None)
        return bool(self.args.hub_always_push) or job is None or job.is_done()  # type: ignore[attr-defined]

    def _txckpt_push_copy(self, remote: str) -> str:
        """Rank 0: a verified local copy of committed checkpoint ``remote`` for a Hub push, in
        ``<cache>/push/<txid>/checkpoint-N`` (the name upstream gives the pushed folder). Copies
        whose push has finished are removed first."""
        self._txckpt_drop_push_copies()
        manifest = txckpt.read_manifest(remote, storage_options=self.txckpt_storage_options)
        dest = os.path.join(self._txckpt_cache(), PUSH_DIR_NAME, manifest.txid, f"{PREFIX_CHECKPOINT_DIR}-{manifest.step}")
        return self._txckpt_fetch_here(remote, dest)

    def _txckpt_drop_push_copies(self) -> None:
        """Remove the push sources whose upload has finished (rank 0)."""
        keep = []
        for path, job in self._txckpt_push_copies:
            if job is None or job.is_done():
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            else:
                keep.append((path, job))
        self._txckpt_push_copies = keep

    # ----- remote roots: local copies --------------------------------------------------------
    def _txckpt_fetch_timeout(self) -> float:
        """A fetch happens between two collectives: the others wait for the download."""
        return max(coordination_timeout(self.txckpt_timeout), float(getattr(self.args, "ddp_timeout", 0) or 0))

    def _txckpt_fetch_here(self, remote: str, dest: str) -> str:
        """This process's verified copy of committed checkpoint ``remote`` at ``dest`` (reused if
        it already holds the same manifest and verifies)."""
        so = self.txckpt_storage_options
        if self._txckpt_verified.pop(remote, None) == dest:
            return dest  # fetched and verified by this resume's fallback check: not twice
        try:
            return txckpt.fetch_checkpoint(remote, dest, storage_options=so)
        except OSError as e:
            if isinstance(e, _errors.TxckptError) or not os.path.isfile(os.path.join(dest, txckpt.MANIFEST_NAME)):
                raise
            # Another process renamed its copy into dest while this one downloaded: check that one.
            return txckpt.fetch_checkpoint(remote, dest, storage_options=so)

    def _txckpt_fetch_committed(self, remote: str) -> str:
        """Every rank: a verified local copy of committed checkpoint ``remote`` in
        ``<cache>/<txid>/checkpoint-N``. Rank 0 reads the manifest and fetches first; then each
        other node's local rank 0; then the remaining ranks (which, on one node or a shared
        cache, find the copy and only verify it). So no two processes ever download into the
        same directory at once. Any rank's failure is raised on every rank."""
        coord = current_coordinator(self._txckpt_fetch_timeout())
        info: dict[str, Any] = {}
        own: BaseException | None = None
        if coord.rank == 0:
            try:
                m = txckpt.read_manifest(remote, storage_options=self.txckpt_storage_options)
                info = {"txid": m.txid, "step": m.step}
            except BaseException as e:  # noqa: BLE001 - every rank must learn it
                own, info = e, {"error": _describe(e, 0)}
        info = coord.broadcast(info)
        if own is not None:
            raise own
        if "error" in info:
            raise _rebuild_error(info["error"])
        dest = os.path.join(self._txckpt_cache(), info["txid"], f"{PREFIX_CHECKPOINT_DIR}-{info['step']}")
        if coord.world_size == 1:
            return self._txckpt_fetch_here(remote, dest)
        local_rank = int(getattr(self.args, "local_process_index", coord.rank))
        turns = (coord.rank == 0, coord.rank != 0 and local_rank == 0, coord.rank != 0 and local_rank != 0)
        for mine in turns:
            report = None
            if mine:
                try:
                    self._txckpt_fetch_here(remote, dest)
                except BaseException as e:  # noqa: BLE001
                    own, report = e, _describe(e, coord.rank)
            reports = coord.gather(report)
            verdict = coord.broadcast(next((r for r in reports or [] if r), None))
            if own is not None:
                raise own
            if verdict is not None:
                raise _rebuild_error(verdict)
        return dest

    def _txckpt_drop_cached_copies(self) -> None:
        """After the first commit of a train() on a remote root, nothing reads the cache's
        checkpoint copies any more (upstream reads the resumed one before the first update step;
        the commit's collectives mean every rank is past that; an earlier run's best copy is
        stale): remove them (not staging, not push sources), on each node, then barrier so no
        rank fetches into the cache (the best model at the end) while another still removes."""
        self._txckpt_prune_after_commit = False
        if int(getattr(self.args, "local_process_index", 0)) == 0:
            cache = self._txckpt_cache()
            for name in (os.listdir(cache) if os.path.isdir(cache) else []):
                if name not in (STAGING_DIR_NAME, PUSH_DIR_NAME):
                    shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
        current_coordinator(self.txckpt_timeout).barrier()

    def _load_best_model(self, *args: Any, **kwargs: Any) -> Any:
        """Remote root: ``best_model_checkpoint`` names the committed remote checkpoint. Upstream
        loads it from local paths: load it from a verified local copy in the cache (every rank
        calls this, after upstream's barrier). The state keeps naming the remote checkpoint."""
        best = self.state.best_model_checkpoint
        if best is None or not _is_remote(best):
            return super()._load_best_model(*args, **kwargs)  # type: ignore[misc]
        try:
            local = self._txckpt_fetch_committed(best)
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
        from transformers.trainer_callback import TrainerState

        remote: list[str] = []
        descriptor = TrainerState.__dict__.get("load_from_json")
        if not isinstance(descriptor, classmethod):  # a transformers this was not written for
            return super()._init_training_state(*args, **kwargs)  # type: ignore[misc]
        real = descriptor.__get__(None, TrainerState)

        def load_from_json(json_path: str) -> Any:
            state = real(json_path)
            if state.best_model_checkpoint is not None and _is_remote(state.best_model_checkpoint):
                remote.append(state.best_model_checkpoint)
                state.best_model_checkpoint = None
            return state

        TrainerState.load_from_json = staticmethod(load_from_json)
        try:
            result = super()._init_training_state(*args, **kwargs)  # type: ignore[misc]
        finally:
            TrainerState.load_from_json = descriptor
        if remote and self.state.best_model_checkpoint is None:
            try:
                txckpt.read_manifest(remote[-1], storage_options=self.txckpt_storage_options)
                self.state.best_model_checkpoint = remote[-1]
            except (_errors.CheckpointNotFoundError, _errors.ManifestError):
                log.warning("the best checkpoint %s recorded in the resumed state is gone; "
                            "ignoring it for this run", remote[-1])
        return result

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
        ``sort_checkpoints``, which a subclass cannot redirect, with ``rmtree`` (other lineages'
        checkpoints and internal names included). Do the same through txckpt first
        (:meth:`_txckpt_keep_only_best`), then hide the limit from upstream's cleanup."""
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
        (``txckpt.retention.rewind``: a fork entry, a retire entry, then the data); other lineages
        are not touched. Rank 0, like upstream's ``should_save`` cleanup; a failure is logged,
        never fatal (the newest then stays, as after a crash in between)."""
        best = self.state.best_model_checkpoint
        if best is None or not self.args.should_save or not self.is_world_process_zero():  # type: ignore[attr-defined]
            return
        from txckpt.retention import rewind

        root = self._txckpt_root(trial)
        try:
            gone = rewind(txckpt.open_root(root, self.txckpt_storage_options), best)
        except Exception as e:  # noqa: BLE001 - the checkpoints are committed; this only frees space
            log.warning("save_total_limit=1: keeping only the best checkpoint %s at the end of "
                        "training failed (%s: %s); the newest is kept too", best, type(e).__name__, e)
            return
        if gone:  # (rewind logs what it retired) the lineage's newest is the best now
            self._txckpt_last_step = _checkpoint_name_step(best)

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
            log.warning("retention after the commit failed (%s: %s); nothing was deleted "
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
        log.info("JIT checkpoint at step %d", self.state.global_step)
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
        try:
            result = super().train(  # type: ignore[misc]
                resume_from_checkpoint=resolved, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
            if not hasattr(Trainer, "_finalize_training") and self.args.save_total_limit == 1 \
                    and self.state.best_model_checkpoint is not None:
                # transformers 4.x: its inline end-of-training cleanup got no checkpoints from
                # _sorted_checkpoints; keep only the best here, as 5.x's _finalize_training does.
                self._txckpt_keep_only_best(trial)
            return result
        finally:
            self._txckpt_drop_push_copies()  # upstream waited for the last push at the end

    def _txckpt_resolve_resume(self, resume: str | bool | None, trial: Any) -> str | None:
        """Rank 0 decides (and records any lineage change); every rank gets its answer. A remote
        answer is fetched into the local cache on every rank, and the local copy returned."""
        root = self._txckpt_root(trial)
        coord = current_coordinator(self.txckpt_timeout)
        if _is_remote(root) and int(getattr(self.args, "local_process_index", 0)) == 0:
            # Before the broadcast: no rank can be saving (into staging) until every rank is past it.
            self._txckpt_clean_staging()
        own_error: BaseException | None = None
        answer: dict[str, Any] | None = None
        if coord.rank == 0:
            try:
                answer = {"path": self._txckpt_resolve_on_rank0(resume, root)}
            except BaseException as e:  # noqa: BLE001 - every rank must learn it
                own_error = e
                answer = {"error": _describe(e, 0)}
        answer = coord.broadcast(answer)
        if own_error is not None:
            raise own_error
        if "error" in answer:
            raise _rebuild_error(answer["error"])
        if "path" not in answer:  # never expected: a collective mismatch would show here
            raise RuntimeError(f"txckpt: rank {coord.rank} got {answer!r} from rank 0 instead of the resume decision")
        path = answer["path"]
        local = path
        # Remote root: after this run's first commit, the cache's checkpoint copies (this resume's,
        # an earlier run's best) are no longer read by anyone.
        self._txckpt_prune_after_commit = _is_remote(root)
        if path is not None and _is_remote(path):
            local = self._txckpt_fetch_committed(path)
            log.info("resuming from %s (local copy %s)", path, local)
        self._txckpt_last_step = _step_of(local) if path is not None and _is_within(path, root) else None
        return local

    def _txckpt_resume_check(self, root: str) -> Any:
        """How a restart verifies the checkpoint it continues from (upstream loads files without
        checking them): on a local root, txckpt's verification (one read); on a remote one the
        fetch into the cache, which verifies, is the check, so the copy checked is the copy
        loaded. With "raise" a remote root needs no check here: the fetch after it raises."""
        so = self.txckpt_storage_options
        if not _is_remote(root):
            return lambda path: (txckpt.verify_checkpoint(path, storage_options=so), path)[1]
        if self.txckpt_on_damaged == "raise":
            return None

        def fetch(path: str) -> str:
            m = txckpt.read_manifest(path, storage_options=so)
            dest = os.path.join(self._txckpt_cache(), m.txid, f"{PREFIX_CHECKPOINT_DIR}-{m.step}")
            self._txckpt_verified = {path: self._txckpt_fetch_here(path, dest)}
            return path

        return fetch

    def _txckpt_resolve_on_rank0(self, resume: str | bool | None, root: str) -> str | None:
        # Runs on rank 0 alone, which broadcasts the answer: lineage changes here are not
        # collectives (collective=False), or the other ranks would be waited for twice.
        so = self.txckpt_storage_options
        if resume is True:
            path = txckpt.open_root(root, so).resume(
                on_damaged=self.txckpt_on_damaged, verify=self._txckpt_resume_check(root),
            ) if _exists(root, so) else None
            if path is None:
                path = _external_parent_of_empty_head(root, so)
                if path is not None:
                    log.warning("the current lineage of %s has no checkpoint yet; it started from "
                                "the external checkpoint %s, resuming from there", root, path)
            if path is None:
                where = self.args.output_dir if self.txckpt_root is None else root
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
                        "resume_from_checkpoint=True.", root, os.path.basename(newest),
                    )
                txckpt.new_lineage(root, storage_options=so, collective=False)
            return None
        path = os.fspath(resume)
        if not _is_url(path):
            path = os.path.abspath(path)
        named = _named_step(path, root)
        if _is_within(path, root):
            if named is not None and _is_remote(root):
                # Object stores have no checkpoint-N names (a checkpoint stays at its own key):
                # <root>/checkpoint-K means step K of the current lineage, as on a local disk.
                try:
                    return txckpt.resume(root, path=path, storage_options=so, collective=False)
                except _errors.CheckpointNotFoundError:
                    return txckpt.resume(root, named, storage_options=so, collective=False)
            return txckpt.resume(root, path=path, storage_options=so, collective=False)
        out = os.path.abspath(self.args.output_dir)
        local_step = _named_step(path, out)
        if self.txckpt_root is not None and local_step is not None and not os.path.exists(path):
            # The stock spelling "<output_dir>/checkpoint-K", with the checkpoints elsewhere.
            log.info("%s does not exist; the root is %s, resuming its step %d", path, root, local_step)
            return txckpt.resume(root, local_step, storage_options=so, collective=False)
        txckpt.new_lineage(root, external_parent=path, storage_options=so, collective=False)
        return path if _is_url(path) else os.fspath(resume)


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


CACHE_DIR_NAME = ".txckpt-cache"
STAGING_DIR_NAME = "staging"
PUSH_DIR_NAME = "push"
STAGING_ENV = "TXCKPT_STAGING_DIR"


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


def _is_remote(path: str) -> bool:
    """A root or checkpoint that the Trainer cannot read through local paths (any fsspec URL
    but file://)."""
    return _is_url(path) and not (path.startswith("file://") and "::" not in path)


def _named_step(path: str, parent: str) -> int | None:
    """K if ``path`` is ``<parent>/checkpoint-K``."""
    if _is_url(path) != _is_url(parent):
        return None
    head, name = (path.rstrip("/").rsplit("/", 1) + [""])[:2] if _is_url(path) else os.path.split(path)
    m = _CHECKPOINT_RE.match(name)
    same = head.rstrip("/") == parent.rstrip("/") if _is_url(path) else os.path.realpath(head) == os.path.realpath(parent)
    return int(m.group(1)) if m and same else None


@contextlib.contextmanager
def _env_var(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _describe(e: BaseException, rank: int) -> dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e), "rank": rank}


def _file_signature(path: str) -> tuple[int, int, int, int] | None:
    """What changes when a file is rewritten (in place or replaced); None for a remote root's
    transaction files, which are not in the local directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _same_dir(a: str, b: str) -> bool:
    if _is_url(a) or _is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _is_within(path: str, root: str) -> bool:
    if _is_url(path) or _is_url(root):
        return path.rstrip("/").startswith(root.rstrip("/") + "/")
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def _exists(root: str, storage_options: dict | None) -> bool:
    return _is_url(root) or storage_options is not None or os.path.isdir(root)


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


def _checkpoint_name_step(path: str) -> int | None:
    """K for a path whose last component is ``checkpoint-K`` (published or a home), else None."""
    m = _CHECKPOINT_RE.match(os.path.basename(path.rstrip("/").rstrip(os.sep)))
    return int(m.group(1)) if m else None


def _committed_step_path(root: str, storage_options: dict | None, step: int) -> str | None:
    """Where the current lineage's committed checkpoint of ``step`` is; None if it has none
    (never saved, or retired)."""
    r = txckpt.open_root(root, storage_options)
    try:
        c = r.history().find(step=step)
    except _errors.CheckpointNotFoundError:
        return None
    return r.locate(c.ref)


def _step_of(path: str) -> int | None:
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None


#: Upstream uploads the whole output_dir to the Hub, ignoring only "_*" and "checkpoint-*":
#: without these, txckpt's log and the abandoned lineages' checkpoints under .txckpt/ would go too.
HUB_IGNORE_PATTERNS = [".txckpt", ".txckpt/*", "*/.txckpt/*", ".txckpt-cache", ".txckpt-cache/*"]


@contextlib.contextmanager
def _hub_uploads_skip_txckpt(ignores: list[str] | None = None):
    """Add ``ignores`` (default HUB_IGNORE_PATTERNS) to every ``upload_folder`` the Trainer makes in
    the block: 5.x calls ``hf_api().upload_folder`` (an HfApi instance), 4.x the module-level
    ``upload_folder`` that ``transformers.trainer`` imported (a bound method of huggingface_hub's
    default HfApi)."""
    import huggingface_hub
    import transformers.trainer as hf_trainer

    def with_ignores(kwargs: dict[str, Any]) -> dict[str, Any]:
        patterns = kwargs.get("ignore_patterns") or []
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        kwargs["ignore_patterns"] = patterns + [p for p in (ignores or HUB_IGNORE_PATTERNS) if p not in patterns]
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
def _torch_save_through(tx: Any, streamed: dict[str, Any]):
    """While the block runs, a ``torch.save(obj, path)`` made by this thread with ``path`` inside
    ``tx.directory`` (and no other arguments) writes through ``tx.open`` instead, recording the
    file's signature in ``streamed``. Anything else goes to torch.save unchanged."""
    import threading

    import torch

    from txckpt.manifest import kind_for_name
    from txckpt.serialization import _torch_save_config

    real = torch.save
    me = threading.get_ident()
    directory = os.path.realpath(tx.directory)

    @functools.wraps(real)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        name = None
        if not args and not kwargs and isinstance(f, (str, os.PathLike)) and threading.get_ident() == me:
            path = os.path.realpath(os.fspath(f))
            if path.startswith(directory + os.sep):
                name = os.path.relpath(path, directory).replace(os.sep, "/")
        if name is None or name in streamed:
            return real(obj, f, *args, **kwargs)
        out = tx.open(name, "wb")
        try:
            with _torch_save_config():
                real(obj, out)
            out.kind = kind_for_name(name)
            out.close()
        except BaseException:
            out.abort()
            raise
        streamed[name] = _file_signature(os.path.join(tx.directory, name))
        return None

    torch.save = save
    try:
        yield
    finally:
        torch.save = real


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


def _rebuild_error(err: dict[str, Any]) -> BaseException:
    msg = f"rank {err.get('rank', 0)}: {err.get('message', '')}"
    cls = getattr(_errors, err.get("type", ""), None)
    if isinstance(cls, type) and issubclass(cls, _errors.TxckptError):
        return cls(msg)
    builtin = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError,
               "OSError": OSError, "PermissionError": PermissionError}
    return builtin.get(err.get("type", ""), RuntimeError)(msg)


def _apply_retention(root: str, storage_options: dict | None, keep_last: int, best: str | None) -> None:
    """The one place that talks to txckpt's retention API: ``save_total_limit`` newest of the
    current lineage plus the best; fork points, the newest and other lineages' checkpoints are
    kept by the policy itself; deletion is two-phase (retire entry, then data)."""
    from txckpt.retention import RetentionPolicy, apply_retention

    policy = RetentionPolicy.from_save_total_limit(keep_last, best)
    gone = apply_retention(txckpt.open_root(root, storage_options), policy)
    for c in gone:
        log.info("retention (save_total_limit=%d) deleted checkpoint-%d (txid %s)", keep_last, c.step, c.txid)


class TransactionalTrainer(TransactionalCheckpointMixin, Trainer):
    """``transformers.Trainer`` with :class:`TransactionalCheckpointMixin`."""


__all__ = ["TransactionalCheckpointMixin", "TransactionalTrainer"]
