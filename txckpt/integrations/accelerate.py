"""Hugging Face Accelerate: ``save_state`` / ``load_state`` as txckpt transactions.

:class:`TransactionalAccelerator` is an ``accelerate.Accelerator`` whose ``save_state`` writes
everything accelerate writes (models, optimizers, schedulers, samplers, the scaler, every
process's RNG state, ``register_for_checkpointing`` objects, files of
``register_save_state_pre_hook`` hooks) into one transaction's staging directory, committed
together on all processes, and whose ``load_state`` resumes along txckpt lineages. See
docs/accelerate.md.

* Automatic naming (``ProjectConfiguration(automatic_checkpoint_naming=True)``): the root is
  ``project_dir/checkpoints``, whose naming (``txckpt/naming.py``) is accelerate's
  ``checkpoint_<i>``; txckpt step i is accelerate's iteration i, taken from the lineage (the
  next step after the current lineage's newest), so a save after a rollback never collides with,
  nor deletes, anything. ``total_limit`` is txckpt's lineage-aware retention, after the commit.
* ``save_state(output_dir)``: the root is ``output_dir``'s parent and the checkpoint is
  published at ``output_dir``'s own name, ``<prefix><step>`` (``out/step_4``: step 4, naming
  ``step_``).
* ``load_state()``: the newest committed checkpoint of the current lineage (a restart);
  ``load_state(path)`` of an older checkpoint forks a new lineage (one warning names every
  checkpoint it abandons; none is deleted or overwritten).
* ``project_dir`` (or ``output_dir``) may be an fsspec URL: accelerate writes into a local
  scratch directory under ``txckpt_local_dir`` that the transaction uploads, and a load fetches
  (and verifies) the checkpoint there first.

The core of txckpt never imports accelerate; this module is the only one that does.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Mapping

from accelerate import Accelerator

import txckpt
from txckpt.coordination import decide_on_rank0
from txckpt.errors import CheckpointNotFoundError, InvalidArgumentError
from txckpt.layout import is_url
from txckpt.naming import Naming, record_naming, split_name

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


class TransactionalAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose checkpoints are txckpt transactions (module doc).

    Keywords besides accelerate's:

    * ``txckpt_storage_options``: fsspec options for a URL ``project_dir`` / ``output_dir``.
    * ``txckpt_local_dir``: local scratch for a URL root (upload staging, fetched copies);
      default: a fresh temporary directory per process. It belongs to the run.
    * ``txckpt_timeout``: seconds a process waits for the others inside a save.
    * ``on_damaged``: ``"raise"`` (default) or ``"fallback"``, as ``txckpt.resume``'s: with
      ``"fallback"``, ``load_state()`` (a restart) whose newest checkpoint fails verification
      forks from the newest one that verifies, with one warning naming each damaged file.
    """

    def __init__(self, *args: Any, txckpt_storage_options: Mapping[str, Any] | None = None,
                 txckpt_local_dir: str | os.PathLike | None = None, txckpt_timeout: float | None = None,
                 on_damaged: str = "raise", **kwargs: Any):
        from txckpt.fallback import check_on_damaged

        check_on_damaged(on_damaged)
        self.txckpt_storage_options = dict(txckpt_storage_options or {})
        self.txckpt_local_dir = None if txckpt_local_dir is None else os.fspath(txckpt_local_dir)
        self.txckpt_timeout = txckpt_timeout
        self.on_damaged = on_damaged
        self._txckpt_named: dict[str, Naming] = {}
        super().__init__(*args, **kwargs)

    # ----- where things go ---------------------------------------------------------------------
    def txckpt_root(self) -> str:
        """The root of automatic naming: ``project_dir/checkpoints``."""
        if self.project_dir is None:
            raise InvalidArgumentError(
                "automatic_checkpoint_naming needs a project_dir (ProjectConfiguration(project_dir=...))")
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
            state = r._known_state if r.writer_lineage is not None and r._known_state is not None else r.state()
            if state.seq < 0 and r.legacy_checkpoints():
                r.adopt()  # a stock accelerate project: its checkpoint_<i> become a lineage
                state = r.state()
            tip = state.head_tip
            return max(int(self.project_configuration.iteration), 0 if tip is None else tip.step + 1)

        return decide_on_rank0(plan, phase="save step")

    # ----- save --------------------------------------------------------------------------------
    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """Save everything accelerate saves as one committed checkpoint; returns its path."""
        auto = bool(self.project_configuration.automatic_checkpoint_naming)
        if auto:
            root, naming = self.txckpt_root(), ACCELERATE_NAMING
            self._use_naming(root, naming)
            step = self._next_step(root)
        else:
            if output_dir is None:
                raise InvalidArgumentError(
                    "save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
            root, name = _split(os.fspath(output_dir))
            naming, step = split_name(name)
            self._use_naming(root, naming)
        local_dir = self._scratch() if is_url(root) else None
        with txckpt.transaction(root, step, storage_options=self.txckpt_storage_options,
                                timeout=self.txckpt_timeout, local_dir=local_dir) as tx:
            self.project_configuration.automatic_checkpoint_naming = False  # write where told
            try:
                super().save_state(tx.directory, safe_serialization=safe_serialization, **save_model_func_kwargs)
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
        from txckpt.retention import RetentionPolicy, apply_retention

        try:
            for c in apply_retention(self._root(root), RetentionPolicy(keep_last=max(limit, 1))):
                log.info("total_limit=%d: retired %s (txid %s)", limit,
                         ACCELERATE_NAMING.public(c.step), c.txid)
        except Exception as e:  # the checkpoint is committed; the next save retries retention
            log.warning("retention after the save failed (%s: %s); the next save retries it",
                        type(e).__name__, e)

    # ----- load --------------------------------------------------------------------------------
    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> str:
        """``None``: the newest committed checkpoint of the current lineage (a restart). A path:
        that committed checkpoint; an older one forks a new lineage (a rollback). Returns the
        path loaded."""
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise InvalidArgumentError("No input_dir provided and automatic checkpoint naming is disabled.")
            root = self.txckpt_root()
            self._use_naming(root, ACCELERATE_NAMING)
            where = txckpt.resume(root, on_damaged=self.on_damaged, storage_options=self.txckpt_storage_options)
            if where is None:
                raise CheckpointNotFoundError(
                    f"{root} has no committed checkpoint of the current lineage to load; "
                    "start from scratch (skip load_state) or pass a checkpoint's path")
        else:
            where = self._resume_at(os.fspath(input_dir))
        local = self._local_copy(where)
        manifest = txckpt.read_manifest(local)
        super().load_state(local, load_kwargs=load_kwargs, **load_model_func_kwargs)
        # accelerate reads the files by path, outside txckpt's reader (which follows a checkpoint
        # that moved, protocol §6a). No process returns before every one has read them: else the
        # main process's next rollback could unpublish this checkpoint (rename it to its home)
        # while another process still reads it by its public name (seen as a FileNotFoundError).
        self.wait_for_everyone()
        self.project_configuration.iteration = manifest.step + 1
        return where

    def _resume_at(self, path: str) -> str:
        """Resume at checkpoint ``path`` (its public name or its home): fork if it is not the
        current lineage's newest. A directory outside any txckpt root is loaded as it is."""
        from txckpt.reader import RootContext, parse

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


__all__ = ["TransactionalAccelerator", "ACCELERATE_NAMING"]
