"""Hugging Face Accelerate: ``save_state`` / ``load_state`` as txckpt transactions.

:class:`TransactionalAccelerator` is an ``accelerate.Accelerator`` whose ``save_state`` writes
everything accelerate writes (models, optimizers, schedulers, samplers, the scaler, every
process's RNG state, ``register_for_checkpointing`` objects, files of
``register_save_state_pre_hook`` hooks) into one transaction's staging directory, committed
together on all processes, and whose ``load_state`` resumes along txckpt lineages. See
docs/accelerate.md.

* Automatic naming (``ProjectConfiguration(automatic_checkpoint_naming=True)``): the root is
  ``project_dir/checkpoints``, whose naming (``txckpt/_base/naming.py``) is accelerate's
  ``checkpoint_<i>``; txckpt step i is accelerate's iteration i, taken from the lineage (the
  next step after the current lineage's newest), so a save after a rollback never collides with,
  nor deletes, anything. ``total_limit`` is txckpt's lineage-aware retention, after the commit.
* ``save_state(output_dir)``, automatic naming off: a checkpoint of a root when ``output_dir``
  is ``<root>/<prefix><step>`` and the root is ``project_dir`` or already a txckpt root of that
  naming (``project_dir/step_4``: step 4, naming ``step_``), published at that name. Any other
  directory (``initial``, a tempfile name, ``out/state``) is a directory of its own
  (txckpt/integrations/_accelerate/dirs.py): its content is replaced atomically, it holds only
  the checkpoint and its manifest, and no directory becomes a root. The step is accelerate's
  iteration (one past the checkpoint last loaded or saved).
* ``load_state()``: the newest committed checkpoint of the current lineage (a restart) of
  ``project_dir/checkpoints`` (automatic naming) or ``project_dir`` (explicit directories);
  ``load_state(path)`` of an older checkpoint forks a new lineage (one warning names every
  checkpoint it abandons; none is deleted or overwritten).
* ``project_dir`` (or ``output_dir``) may be an fsspec URL: accelerate writes into a local
  scratch directory under ``txckpt_local_dir`` that the transaction uploads, and a load fetches
  (and verifies) the checkpoint there first.
* ``save_on_preemption=True`` (or a grace in seconds): the constructor installs
  ``txckpt.preemption``'s handlers (unless the script did), and the loop calls
  ``save_state_if_preempted()`` at each step boundary, on every process: one all-reduce; once
  any process got SIGTERM / SIGUSR1, every process saves that step through ``save_state`` and
  the process exits through ``txckpt.preemption.exit()`` (status 128 + signum).
  ``preemption_requested()`` is the question alone, for loops that stop their own way.

* Exact resume mid-epoch: ``save_state`` also writes, per process, where each prepared
  DataLoader's running epoch started (``txckpt_epoch_start_<i>.pt``: the RNG and sampler
  generator states its iterator drew from), and the first iteration after ``load_state``
  replays that start, then continues from the saved step's RNG. Stock accelerate restores the
  RNGs before the loop makes the epoch's iterator, which then draws another order and shifts
  every later dropout draw (txckpt/integrations/_accelerate/epoch.py; docs/preemption.md).

The core of txckpt never imports accelerate; this module and its accelerate_* helpers are the
only ones that do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Any, Mapping

from accelerate import Accelerator

import txckpt
from txckpt import preemption
from txckpt._base.coordination import decide_on_rank0
from txckpt.errors import CheckpointNotFoundError, InvalidArgumentError
from txckpt._root.fallback import check_on_damaged
from txckpt._base.layout import entry_key, is_url
from txckpt._base.naming import DEFAULT as DEFAULT_NAMING, Naming, record_naming, split_name
from txckpt._read.reader import RootContext, names_a_checkpoint, parse
from txckpt._maintenance.retention import RetentionPolicy, apply_retention
from txckpt._root.root import durable_default
from txckpt._storage import open_storage

from ._accelerate.dirs import dir_step, save_dir
from ._accelerate.grouped import grouped_models_loaded, grouped_models_through
from ._accelerate.epoch import read_epoch_starts, record_of, track, write_epoch_starts

log = logging.getLogger("txckpt")

#: accelerate's automatic names: ``project_dir/checkpoints/checkpoint_<iteration>``.
ACCELERATE_NAMING = Naming("checkpoint_")


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name if is_url(root) else os.path.join(root, name)


def _split(path: str) -> tuple[str, str]:
    path = path.rstrip("/") if is_url(path) else os.path.abspath(os.path.expanduser(path))
    if is_url(path):
        parent, _, name = path.rpartition("/")
        return parent, name
    return os.path.dirname(path), os.path.basename(path)


def _same_dir(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _preemption_grace(save_on_preemption: Any) -> float | None:
    """``save_on_preemption``'s grace: None for True (and for False, unused), else the number of
    seconds, as the Trainer's ``txckpt_save_on_preemption`` reads it."""
    if isinstance(save_on_preemption, bool):
        return None
    try:
        grace_s = float(save_on_preemption)
    except (TypeError, ValueError):
        grace_s = float("nan")
    if not (0 <= grace_s < float("inf")):
        raise InvalidArgumentError(
            f"save_on_preemption must be True, False or a grace in seconds (>= 0), not {save_on_preemption!r}"
        )
    return grace_s


# accelerate ships no annotations mypy reads: its Accelerator is Any to the checker.
class TransactionalAccelerator(Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` whose checkpoints are txckpt transactions (module doc).

    Keywords besides accelerate's:

    * ``txckpt_storage_options``: fsspec options for a URL ``project_dir`` / ``output_dir``.
    * ``txckpt_local_dir``: local scratch for a URL root (upload staging, fetched copies);
      default: a fresh temporary directory per process. It belongs to the run.
    * ``txckpt_timeout``: seconds a process waits for the others inside a save.
    * ``on_damaged``: ``"raise"`` (default) or ``"fallback"``, as ``txckpt.resume``'s: with
      ``"fallback"``, ``load_state()`` (a restart) whose newest checkpoint fails verification
      forks from the newest one that verifies, with one warning naming each damaged file.
    * ``save_on_preemption``: ``True``, or a grace in seconds (``txckpt.preemption.install``'s
      ``grace_s``): SIGTERM / SIGUSR1 no longer kill the process; :meth:`save_state_if_preempted`
      saves and exits at the next step boundary (docs/accelerate.md, "Preemption"). The handlers
      are installed here (construct it on the main thread), unless the script installed them.
    * ``incremental``: ``True`` keeps each file a committed checkpoint of the root already holds
      byte for byte (a frozen model's weights, an unchanged sampler or scaler) once: a hard link
      on a local root, a server-side copy instead of an upload on an object store
      (docs/incremental.md). A model with both frozen and trained parameters is saved grouped:
      its ``model{_i}.safetensors`` as stock shards, the unchanged tensors (by digest) in one of
      their own that is shared; this ``load_state`` reads it, a stock ``Accelerator.load_state``
      does not (txckpt/integrations/_accelerate/grouped.py). Saves into a root only (automatic
      naming, or ``<root>/<name>_<i>``); a directory of its own (``save_state(d)`` elsewhere)
      has no earlier checkpoint to share with.
    * ``tiered``: a :class:`txckpt.TieredRoot`: automatic naming saves into its fast tier instead
      of ``project_dir/checkpoints`` (each commit then replicated to its durable tier, retention
      keeping what is not durable yet), and ``load_state()`` on an empty fast tier (a new node)
      first restores the durable tier's newest checkpoint there (docs/tiered.md).
    """

    def __init__(
        self,
        *args: Any,
        txckpt_storage_options: Mapping[str, Any] | None = None,
        txckpt_local_dir: str | os.PathLike[str] | None = None,
        txckpt_timeout: float | None = None,
        on_damaged: str = "raise",
        save_on_preemption: bool | float | None = False,
        incremental: bool = False,
        tiered: txckpt.TieredRoot | None = None,
        **kwargs: Any,
    ):
        check_on_damaged(on_damaged)
        if tiered is not None and not isinstance(tiered, txckpt.TieredRoot):
            raise InvalidArgumentError(f"tiered must be a txckpt.TieredRoot, not {type(tiered).__name__}")
        self.txckpt_tiered = tiered
        save_on_preemption = False if save_on_preemption is None else save_on_preemption
        grace_s = _preemption_grace(save_on_preemption)
        self.txckpt_storage_options = dict(txckpt_storage_options or {})
        self.txckpt_local_dir = None if txckpt_local_dir is None else os.fspath(txckpt_local_dir)
        self.txckpt_timeout = txckpt_timeout
        self.on_damaged = on_damaged
        self.incremental = bool(incremental)
        self._txckpt_named: dict[str, Naming] = {}
        self.save_on_preemption = save_on_preemption
        self._txckpt_installed_preemption = False
        super().__init__(*args, **kwargs)
        # After accelerate's own set-up, so that a constructor that raises leaves no handler behind.
        if save_on_preemption is not False and not preemption.installed():
            preemption.install(grace_s=grace_s)
            self._txckpt_installed_preemption = True

    # ----- where things go ---------------------------------------------------------------------
    def txckpt_root(self) -> str:
        """The root of automatic naming: ``project_dir/checkpoints`` (``tiered``: its fast tier)."""
        if self.txckpt_tiered is not None:
            return self.txckpt_tiered.fast
        if self.project_dir is None:
            raise InvalidArgumentError(
                "automatic_checkpoint_naming needs a project_dir (ProjectConfiguration(project_dir=...))"
            )
        return _join(os.fspath(self.project_dir), "checkpoints")

    def _scratch(self) -> str:
        if self.txckpt_local_dir is None:
            self.txckpt_local_dir = tempfile.mkdtemp(prefix="txckpt-accelerate-")
        os.makedirs(self.txckpt_local_dir, exist_ok=True)
        return self.txckpt_local_dir

    def _root(self, root: str) -> txckpt.CheckpointRoot:
        return txckpt.open_root(root, self.txckpt_storage_options)

    def _use_naming(self, root: str, naming: Naming) -> None:
        """Record ``naming`` as the root's (once per root and process; rank 0 writes, every process
        learns the outcome, so a conflict raises on all of them)."""
        if self._txckpt_named.get(root) == naming:
            return
        r = self._root(root)

        def record() -> str:
            if not is_url(root):
                os.makedirs(root, exist_ok=True)  # as stock save_state does
            return record_naming(r.storage, naming, durable=r.durable).prefix

        prefix = decide_on_rank0(record, phase="naming")
        r.publication.naming = Naming(prefix)
        self._txckpt_named[root] = r.publication.naming

    def _next_step(self, root: str) -> int:
        """Accelerate's iteration from the lineage: after the current lineage's newest step,
        or the iteration asked for (``project_configuration.iteration``) if that is later."""

        def plan() -> int:
            r = self._root(root)
            # A session holding the head plans against the state it knows (its last commit), as
            # the save itself does (protocol §8 step 1): a stale plan fails at the commit.
            state = r.known_state if r.writer_lineage is not None and r.known_state is not None else r.state()
            if state.seq < 0 and r.legacy_checkpoints():
                r.adopt()  # a stock accelerate project: its checkpoint_<i> become a lineage
                state = r.state()
            tip = state.head_tip
            return max(int(self.project_configuration.iteration), 0 if tip is None else tip.step + 1)

        return decide_on_rank0(plan, phase="save step")

    def _placement(self, output_dir: str) -> tuple[str, Naming, int] | None:
        """(root, naming, step) if ``output_dir`` is ``<root>/<prefix><step>`` of ``project_dir``
        or of a directory that is a txckpt root already (with that naming); None: a directory
        of its own (module doc). No directory the user did not name becomes a root."""
        root, name = _split(output_dir)
        try:
            naming, step = split_name(name)
        except InvalidArgumentError:
            return None
        if self.project_dir is not None and _same_dir(root, os.fspath(self.project_dir)):
            return root, naming, step
        if names_a_checkpoint(_join(root, name), self.txckpt_storage_options):
            if open_storage(root, self.txckpt_storage_options).exists(entry_key(0)):
                return root, naming, step
        return None

    def _save_dir(self, d: str, safe_serialization: bool, kwargs: dict[str, Any]) -> str:
        """save_state(d) into a local directory of its own (txckpt/integrations/_accelerate/dirs.py)."""
        base = int(self.project_configuration.iteration)

        def plan() -> int:
            held = dir_step(os.path.abspath(os.path.expanduser(d)))
            return max(base, 0 if held is None else held + 1)

        step = decide_on_rank0(plan, phase="save step", timeout=self.txckpt_timeout)
        stock_save = super().save_state

        def save_into(directory: str) -> None:
            stock_save(directory, safe_serialization=safe_serialization, **kwargs)
            self._write_epoch_starts(directory)

        path = save_dir(
            d, step, save_into, main=self.is_main_process, timeout=self.txckpt_timeout, durable=durable_default()
        )
        self.project_configuration.iteration = step + 1
        return path

    # ----- data loaders ------------------------------------------------------------------------
    def prepare_data_loader(self, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        """accelerate's, and the loader records where each epoch starts (an exact resume
        mid-epoch: txckpt/integrations/_accelerate/epoch.py)."""
        return track(super().prepare_data_loader(data_loader, *args, **kwargs))

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's; the copy shares the prepared loader's epoch record, so the first
        iteration after ``load_state`` replays the saved epoch's start (use this method, not the
        module-level ``accelerate.skip_first_batches``, whose copy txckpt never sees)."""
        record = record_of(dataloader)
        skipped = super().skip_first_batches(dataloader, num_batches=num_batches)
        return skipped if record is None else track(skipped, record)

    def _write_epoch_starts(self, directory: str) -> None:
        write_epoch_starts(self._dataloaders, self.process_index, directory)

    # ----- save --------------------------------------------------------------------------------
    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save everything accelerate saves as one committed checkpoint; returns its path."""
        auto = bool(self.project_configuration.automatic_checkpoint_naming)
        if auto:
            root, naming = self.txckpt_root(), ACCELERATE_NAMING
            self._use_naming(root, naming)
            step = self._next_step(root)
        else:
            if output_dir is None:
                raise InvalidArgumentError(
                    "save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)"
                )
            placed = self._placement(os.fspath(output_dir))
            if placed is None and not is_url(os.fspath(output_dir)):
                return self._save_dir(os.fspath(output_dir), safe_serialization, save_model_func_kwargs)
            if placed is None:  # a URL of its own: it is the root (object stores have no swap)
                root, naming = os.fspath(output_dir).rstrip("/"), DEFAULT_NAMING
                self._use_naming(root, naming)
                step = self._next_step(root)
            else:
                root, naming, step = placed
                self._use_naming(root, naming)
        local_dir = self._scratch() if is_url(root) else None
        with txckpt.transaction(
            root,
            step,
            storage_options=self.txckpt_storage_options,
            timeout=self.txckpt_timeout,
            local_dir=local_dir,
            incremental=self.incremental,
        ) as tx:
            self.project_configuration.automatic_checkpoint_naming = False  # write where told
            # Incremental: each model's file is saved grouped, its unchanged tensors in a shard
            # of their own that is shared (txckpt/integrations/_accelerate/grouped.py).
            grouped = grouped_models_through(tx, list(self._models)) if self.incremental else None
            try:
                with grouped if grouped is not None else contextlib.nullcontext():
                    super().save_state(tx.directory, safe_serialization=safe_serialization, **save_model_func_kwargs)
                self._write_epoch_starts(tx.directory)
            finally:
                self.project_configuration.automatic_checkpoint_naming = auto
        self.project_configuration.iteration = step + 1
        assert tx.path is not None
        limit = self.project_configuration.total_limit
        if auto and limit is not None and self.is_main_process:
            self._retain(root, int(limit))
        return tx.path

    def _retain(self, root: str, limit: int) -> None:
        """``total_limit`` newest of the current lineage, after the commit; fork points (the
        checkpoint a rollback resumed from) and other lineages' checkpoints are kept by the
        policy; deletion is two-phase (docs/retention.md). A failure never fails the save."""
        try:
            for c in apply_retention(self._root(root), RetentionPolicy(keep_last=max(limit, 1))):
                log.info("total_limit=%d: retired %s (txid %s)", limit, ACCELERATE_NAMING.public(c.step), c.txid)
        except Exception as e:  # the checkpoint is committed; the next save retries retention
            log.warning("retention after the save failed (%s: %s); the next save retries it", type(e).__name__, e)

    # ----- preemption --------------------------------------------------------------------------
    def preemption_requested(self) -> bool:
        """Whether to save and stop at this step boundary: ``txckpt.preemption.requested()``.
        With more than one process it is one all-reduce (of one integer, on txckpt's gloo group),
        True on every process at the same call if any of them received SIGTERM / SIGUSR1, so
        every process must call it at the same points of the loop (as ``check_trigger``). Once
        True it stays True. False while no handler is installed (``save_on_preemption`` off and
        no ``txckpt.preemption.install()``), still collectively."""
        return preemption.requested()

    def save_state_if_preempted(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> None:
        """The step boundary of a preemptible loop, in one call on every process: returns at
        once (after the one collective of :meth:`preemption_requested`) while no process has been
        signalled; otherwise ``save_state(output_dir, ...)`` saves this step on every process
        (committed before anything else happens), then ``txckpt.preemption.exit()`` ends the
        process: pending async saves finish within the grace, what committed is logged, and
        SystemExit carries 128 + the signal's number (143 for SIGTERM) to the scheduler."""
        if not self.preemption_requested():
            return
        log.warning(
            "txckpt: preemption: saving the state at this step boundary, then the process exits with status %d",
            preemption.exit_status(),
        )
        path = self.save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
        log.warning("txckpt: preemption: saved %s", path)
        preemption.exit()

    def end_training(self) -> None:
        """accelerate's ``end_training``; then the signal handlers ``save_on_preemption``
        installed are put back, unless a signal was received or agreed (its exit still needs them)."""
        super().end_training()
        if self._txckpt_installed_preemption and not preemption.exit_status():
            self._txckpt_installed_preemption = False
            preemption.uninstall()

    # ----- load --------------------------------------------------------------------------------
    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> str:
        """``None``: the newest committed checkpoint of the current lineage (a restart). A path:
        that committed checkpoint; an older one forks a new lineage (a rollback). Returns the
        path loaded."""
        if input_dir is None:
            if self.project_configuration.automatic_checkpoint_naming:
                root = self.txckpt_root()
                self._use_naming(root, ACCELERATE_NAMING)
                if self.txckpt_tiered is not None:  # a new node: the durable tip, onto the fast tier
                    decide_on_rank0(self.txckpt_tiered.restore, phase="tiered restore")
            elif self.project_dir is not None:
                root = os.fspath(self.project_dir)  # save_state(f"{project_dir}/step_{n}")'s root
            else:
                raise InvalidArgumentError(
                    "No input_dir provided and automatic checkpoint naming is disabled: pass the directory "
                    "save_state wrote, or set ProjectConfiguration(project_dir=...) to resume its newest "
                    "checkpoint"
                )
            where = txckpt.resume(root, on_damaged=self.on_damaged, storage_options=self.txckpt_storage_options)
            if where is None:
                raise CheckpointNotFoundError(
                    f"{root} has no committed checkpoint of the current lineage to load; "
                    "start from scratch (skip load_state) or pass a checkpoint's path"
                )
        else:
            where = self._resume_at(os.fspath(input_dir))
        local = self._local_copy(where)
        # A directory that stock accelerate wrote has no manifest: loaded as it is, as stock does.
        manifest = txckpt.read_manifest(local) if os.path.exists(os.path.join(local, txckpt.MANIFEST_NAME)) else None
        with grouped_models_loaded():  # a model an incremental save grouped (stock reads one file)
            super().load_state(local, load_kwargs=load_kwargs, **load_model_func_kwargs)
        read_epoch_starts(self._dataloaders, self.process_index, local)  # after accelerate restored the RNGs
        # accelerate reads the files by path, outside txckpt's reader (which follows a checkpoint
        # that moved, protocol §6a). No process returns before every one has read them: else the
        # main process's next rollback could unpublish this checkpoint (rename it to its home)
        # while another process still reads it by its public name (seen as a FileNotFoundError).
        self.wait_for_everyone()
        if manifest is not None:
            self.project_configuration.iteration = manifest.step + 1
        return where

    def _resume_at(self, path: str) -> str:
        """Resume at checkpoint ``path`` (its public name or its home): fork if it is not the
        current lineage's newest. A directory outside any txckpt root is loaded as it is."""
        if is_url(path) and open_storage(path, self.txckpt_storage_options).exists(entry_key(0)):
            # A URL saved as a directory of its own is a root: its newest checkpoint.
            resumed_dir = txckpt.resume(path, storage_options=self.txckpt_storage_options)
            if resumed_dir is None:
                raise CheckpointNotFoundError(f"{path} holds no committed checkpoint of its current lineage")
            return resumed_dir
        where = parse(path)
        ctx = None if where is None else RootContext.open(path, self.txckpt_storage_options)
        if where is None or ctx is None:
            return path  # plain accelerate output, or a copy: nothing to resume in
        if where.txid is None and not ctx.root.publication.publishes:
            # Object stores have no public names (a checkpoint stays at its own key):
            # <root>/checkpoint_K (out/step_K) means step K of the current lineage, as the same
            # path means on a local disk.
            resumed = txckpt.resume(where.root, step=where.step, storage_options=self.txckpt_storage_options)
        else:
            resumed = txckpt.resume(where.root, path=path, storage_options=self.txckpt_storage_options)
        if resumed is None:  # pragma: no cover - resume of a path returns its location or raises
            raise CheckpointNotFoundError(f"{path} is not a committed checkpoint")
        return resumed

    def _local_copy(self, where: str) -> str:
        """A verified local directory holding the checkpoint ``where``: itself on a local disk,
        a fetched copy (by txid, in ``txckpt_local_dir``) of a remote one."""
        if not is_url(where) or where.startswith("file://"):
            if os.path.exists(os.path.join(where, txckpt.MANIFEST_NAME)):
                txckpt.verify_checkpoint(where)
            return where
        manifest = txckpt.read_manifest(where, storage_options=self.txckpt_storage_options)
        dest = os.path.join(self._scratch(), "fetched", manifest.txid)
        return txckpt.fetch_checkpoint(where, dest, storage_options=self.txckpt_storage_options)


__all__ = ["TransactionalAccelerator"]  # public (docs/api.md); ACCELERATE_NAMING is internal
