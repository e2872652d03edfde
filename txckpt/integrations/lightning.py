"""PyTorch Lightning and Fabric: every checkpoint save is one txckpt transaction.

``Trainer(plugins=[TransactionalCheckpointIO()])`` (or ``Fabric(plugins=[...])``): each
``save_checkpoint(checkpoint, path)`` commits checkpoint ``checkpoint["global_step"]`` of the
current lineage of the root (the plugin's ``root``, else ``path``'s directory, the
ModelCheckpoint's ``dirpath``), holding the one file Lightning writes, under its name; the
user-facing ``path`` is a published name of those committed bytes (lightning_names.py). Loading
verifies every byte; ``ckpt_path="last"`` is the current lineage's newest committed checkpoint,
read from the log; resuming from an older checkpoint forks a lineage at the next save and warns.
docs/lightning.md is the user's page.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

try:  # the standalone packages: pytorch_lightning's Trainer checks lightning_fabric's CheckpointIO
    import lightning_fabric.plugins.environments as standalone_environments
    import lightning_fabric.plugins.io.checkpoint_io as standalone_io
    import pytorch_lightning.callbacks as standalone_callbacks
    import pytorch_lightning.trainer.connectors.checkpoint_connector as standalone_connector
except ImportError:  # only `lightning` installed: the usual case
    standalone_io = standalone_callbacks = standalone_connector = standalone_environments = None  # type: ignore[assignment]

from .. import preemption
from .._base import deps
from .._api import load_checkpoint as txckpt_load
from .._async.asyncsave import Job, LazySnapshot, submit, wait_for_root
from .._base.coordination import SingleProcess, TorchDistributed, current_coordinator
from .._base.layout import orphan_key
from .._base.rngstate import rng_state, set_rng_state
from ..errors import InvalidArgumentError, decode_error, encode_error
from .._maintenance.retention import finish_retired, retire
from .._root.root import CheckpointRoot, open_root
from ._lightning import sharded
from ._lightning.names import (
    Resolved,
    is_last,
    is_local,
    link_name,
    names_in,
    newest,
    publish_dir,
    resolve,
    split,
    unpublish_dir,
)

log = logging.getLogger("txckpt")

#: What the callbacks below look for in a Trainer, from both packages: pytorch_lightning's Trainer
#: holds pytorch_lightning's ModelCheckpoint and lightning_fabric's SLURMEnvironment (the same
#: code under other module names), which are not lightning.pytorch's classes.
_MODEL_CHECKPOINTS: tuple[Any, ...] = (ModelCheckpoint,)
_SLURM_ENVIRONMENTS: tuple[Any, ...] = (SLURMEnvironment,)
if standalone_callbacks is not None:
    _MODEL_CHECKPOINTS += (standalone_callbacks.ModelCheckpoint,)
    _SLURM_ENVIRONMENTS += (standalone_environments.SLURMEnvironment,)


@dataclass
class _Saved:
    """This plugin's newest save into one root: its step, and its committed path (or the future
    of it, for an async save), so that a second name for the same step links to it."""

    step: int
    name: str
    result: "str | Future[str]"
    sharded: bool = False  # a sharded strategy's: the checkpoint is the directory, no one file


def _step_of(checkpoint: Mapping[str, Any]) -> int | None:
    # Lightning's Trainer: global_step; Fabric's state: whatever the user put in, "step" commonly.
    for k in ("global_step", "step"):
        v = checkpoint.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return None


class TransactionalCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose saves are txckpt transactions (docs/lightning.md).

    ``root``: the txckpt root (a local path or any fsspec URL); None (the default): the directory
    of each path Lightning saves to, the ModelCheckpoint's ``dirpath``. ``storage_options`` go to
    fsspec. ``async_save=True``: the state is snapshotted before ``save_checkpoint`` returns and
    committed in the background (txckpt.async_save); ``teardown()`` waits for it, and a failure
    is raised by the next save or the teardown. ``async_save="lazy"``: the same, but the
    Trainer's optimizers' parameters and state are copied by the background, and their next
    step waits for that copy after its forward and backward (docs/lightning.md, "Lazy async
    saves"); without a Trainer (Fabric, a direct call) it saves as ``async_save=True``. With a
    sharded strategy (``ModelParallelStrategy``) both modes save every rank's shards through
    ``dcp.async_save`` (copied to host memory before returning), committed in the background.
    ``incremental=True``: a file already committed byte for byte is shared, not written
    (docs/incremental.md).
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        async_save: bool | str = False,
        incremental: bool = False,
    ) -> None:
        super().__init__()
        if async_save not in (True, False, "lazy"):
            raise InvalidArgumentError(
                f'async_save takes False, True (copy before returning) or "lazy" (the optimizers\' '
                f"tensors copied in the background, their next step waiting for it), not {async_save!r}"
            )
        self.root = os.fspath(root) if root is not None else None
        self.storage_options = dict(storage_options) if storage_options else None
        self.async_save: bool | str = async_save if async_save == "lazy" else bool(async_save)
        self.incremental = bool(incremental)
        self._loaded: dict[str, Resolved] = {}  # root url -> what was loaded since its last save
        self._saved: dict[str, _Saved] = {}  # root url -> this plugin's newest save there
        self._pending: list[Future] = []
        self._errors: list[BaseException] = []
        # An async save's name is linked by a done-callback, which runs after the future's
        # result is visible: whoever reads names (rotation, the next save) waits for these too.
        self._linking: list[tuple[Future, threading.Event]] = []
        # root url -> this plugin's saves committed under a last*.ckpt name, with the directory
        # of that name: stock Lightning overwrites last.ckpt, so one superseded here is retired.
        self._last_named: dict[str, list[tuple[_Saved, str]]] = {}
        #: The optimizers of the Trainer whose checkpoint is being saved, set by its
        #: dump_checkpoint (_dump_checkpoint below) just before it hands the dict here.
        self.trainer_optimizers: list[Any] = []
        self._group: Any = None  # background sharded saves' process group (_background_group)

    # ----- save ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(
                "TransactionalCheckpointIO takes its storage_options once, at construction "
                "(TransactionalCheckpointIO(storage_options=...)), not per save"
            )
        # This save's Trainer's optimizers (set by its dump_checkpoint), never a later save's.
        optimizers, self.trainer_optimizers = self.trainer_optimizers, []
        self._raise_failures()
        root_path, name = split(path, self.root)
        r = open_root(root_path, self.storage_options)
        step = _step_of(checkpoint)
        previous = self._saved.get(r.url)
        loaded = self._loaded.pop(r.url, None)
        if loaded is None and previous is not None and step == previous.step:
            # A second name for the step just saved (last.ckpt, a second ModelCheckpoint): the
            # same committed bytes, never a second write (docs/lightning.md, "Layout").
            self._add_name(r, previous, os.fspath(path))
            return
        wait_for_root(root_path, self.storage_options)  # the lineage an async save is changing
        self._raise_failures()  # the previous save's, now finished: this save is its next one
        step = self._begin(r, loaded, previous, step)
        files = {name: checkpoint}
        metadata = {"lightning": {"name": name, "epoch": checkpoint.get("epoch"), "global_step": step}}
        if self.async_save:
            lazy = optimizers if self.async_save == "lazy" else []
            future = self._async_save(root_path, step, files, metadata, lazy)
            saved = _Saved(step, name, future)
            self._pending.append(future)
        else:
            where = r.save(step, files, metadata=metadata, incremental=self.incremental, coordinator=SingleProcess())
            saved = _Saved(step, name, where)
        self._record(r, saved, path)

    def _begin(self, r: CheckpointRoot, loaded: Any, previous: _Saved | None, step: int | None) -> int:
        """What a new save does before it writes (on the one process that decides): the links of
        earlier saves in place, the superseded ``last`` checkpoint retired, the lineage chosen
        (a resume from an older checkpoint forks). Returns the save's step (the checkpoint's, or
        the one after the head's tip where the checkpoint has none)."""
        self._wait_links()
        self._retire_superseded(r)
        self._choose_lineage(r, loaded, previous is not None and (step is None or step > previous.step))
        if step is None:
            tip = r.state().head_tip
            step = 0 if tip is None else tip.step + 1
        return step

    def _record(self, r: CheckpointRoot, saved: _Saved, path: Any) -> None:
        self._saved[r.url] = saved
        if is_last(saved.name):
            self._last_named.setdefault(r.url, []).append((saved, os.path.dirname(os.path.abspath(os.fspath(path)))))
        self._add_name(r, saved, os.fspath(path))

    def _save_sharded(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any) -> None:
        """A sharded strategy's save (every rank calls it, in place of the strategy's own): ONE
        transaction for every rank's DCP shards and rank 0's ``meta.pt`` (_lightning/sharded.py),
        with the step, lineage and names of this plugin's other saves, decided on global rank 0."""
        self._raise_failures()
        path = strategy.broadcast(os.fspath(filepath))  # every rank the same path, as the strategy does
        root_path, name = split(path, self.root)
        r = open_root(root_path, self.storage_options)
        step = _step_of(checkpoint)
        previous = self._saved.get(r.url)
        loaded = self._loaded.pop(r.url, None)
        rank0 = strategy.global_rank == 0
        if loaded is None and previous is not None and step == previous.step:
            if rank0:  # a second name for the step just saved: the same committed files
                self._add_name(r, previous, path)
            strategy.barrier("txckpt-lightning-sharded-name")
            return
        # A new step: every rank's previous background save committed first (its failure raised
        # here, on each rank it failed on), so that rank 0 decides the lineage from the log.
        self.wait()
        failure: BaseException | None = None
        if rank0:  # one rank decides the lineage (a fork writes the log), before any rank plans
            try:
                step = self._begin(r, loaded, previous, step)
            except Exception as e:  # noqa: BLE001 - every rank raises it, below
                failure = e
        # The outcome, not only the step: a failure on rank 0 here would otherwise leave the
        # other ranks waiting in this broadcast (or in dcp.save) until their collective timeout.
        step, encoded = strategy.broadcast((step, None if failure is None else encode_error(failure, rank=0)))
        if failure is not None:
            raise failure
        if encoded is not None:
            shared = decode_error(encoded)  # the same class, message and fields (errors.py's codec)
            add_note = getattr(shared, "add_note", None)  # Python 3.11+
            if add_note is not None:
                add_note(f"raised on global rank 0 before the sharded save of {path}: every rank raises it")
            raise shared
        metadata = {"lightning": {"name": name, "epoch": checkpoint.get("epoch"), "global_step": step}}
        where = sharded.save(
            strategy,
            checkpoint,
            root_path,
            step,
            storage_options=self.storage_options,
            metadata=metadata,
            incremental=self.incremental,
            background=bool(self.async_save),
            group=self._background_group() if self.async_save else None,
        )
        if isinstance(where, Future):
            self._pending.append(where)
        saved = _Saved(step, name, where, sharded=True)
        if rank0:
            self._record(r, saved, path)
        else:
            self._saved[r.url] = saved
        strategy.barrier("txckpt-lightning-sharded-save")  # the name is published on every rank's return

    def _load_sharded(self, strategy: Any, found: Resolved, weights_only: Optional[bool]) -> dict[str, Any]:
        """A sharded strategy's load (every rank): the model and optimizer states through
        TransactionalReader, ``meta.pt`` verified; returns ``meta.pt``'s dict, as the strategy does."""
        sharded.load_states(strategy, found.checkpoint, self.storage_options)
        meta = txckpt_load(
            found.checkpoint,
            files=[sharded.META_NAME],
            storage_options=self.storage_options,
            map_location="cpu",
            weights_only=True if weights_only is None else weights_only,
        )[sharded.META_NAME]
        self._loaded[found.root] = found
        return dict(meta)

    def _async_save(
        self, root_path: str, step: int, files: dict[str, Any], metadata: dict[str, Any], optimizers: list[Any]
    ) -> Future:
        """txckpt.async_save of this process alone: Lightning calls its CheckpointIO on global
        rank 0 only, so the background save must not coordinate with the other ranks (they are
        training), nor create the async saves' gloo group (a collective they would never join):
        it commits with ``SingleProcess()``, as the synchronous save does. ``optimizers``
        (``async_save="lazy"``): as ``async_save(..., optimizer=)``, with the wait moved after
        the step's closure: Lightning's automatic optimization runs forward and backward inside
        ``step(closure)``."""
        so = self.storage_options

        def prepare(pool: Any, eager: Any) -> Job:
            if not optimizers:
                snapshot = pool.snapshot(files)  # before save_checkpoint returns
                return Job(
                    lambda coordinator: open_root(root_path, so).save(
                        step, snapshot, metadata=metadata, coordinator=coordinator, incremental=self.incremental
                    )
                )
            lazy = LazySnapshot(
                eager,
                files,
                optimizers,
                remedy='saves with TransactionalCheckpointIO(async_save=True), which copies before it returns, not "lazy"',
                after_closure=True,
            )

            def run(coordinator: Any) -> str:
                snapshot = lazy.take(pool)  # first: the optimizers' next step waits for it
                return open_root(root_path, so).save(
                    step, snapshot, metadata=metadata, coordinator=coordinator, incremental=self.incremental
                )

            return Job(run, lazy)

        return submit(root_path, so, prepare, step=step, alone=True)

    def _retire_superseded(self, r: CheckpointRoot) -> None:
        """Retire this plugin's checkpoints that were committed under a ``last*.ckpt`` name and
        are no longer the newest, where nothing else names them: what stock Lightning's
        overwrite of last.ckpt frees. Only this process's own saves: the checkpoint a run
        resumed from stays (as Lightning keeps it), and so do fork points and other lineages'."""
        entries = self._last_named.get(r.url)
        if not entries:
            return
        state = r.state()
        tip = state.head_tip
        keep: list[tuple[_Saved, str]] = []
        going: list[str] = []
        for saved, directory in entries:
            result = saved.result
            if isinstance(result, Future):
                if not result.done():
                    keep.append((saved, directory))
                    continue
                if result.cancelled() or result.exception() is not None:
                    continue  # never committed
                result = result.result()
            committed = result if saved.sharded else f"{result.rstrip('/')}/{saved.name}"
            found = resolve(committed, None, self.storage_options)
            if found is None or found.record.lineage != state.head:
                continue
            if tip is not None and found.record.txid == tip.txid:
                keep.append((saved, directory))
                continue
            if is_local(r) and [
                n for n in names_in(directory, os.path.join(found.checkpoint, found.file)) if not is_last(n)
            ]:
                continue  # a top-k name holds it: ModelCheckpoint's rotation decides
            going.append(found.record.txid)
        self._last_named[r.url] = keep
        if going and retire(r, going):
            finish_retired(r)

    def _choose_lineage(self, r: CheckpointRoot, loaded: Resolved | None, continuing: bool) -> None:
        """Which lineage this save continues. After a load: the loaded checkpoint's (a rollback
        forks and warns; one of another root becomes the external parent of a new lineage).
        ``continuing``: this plugin saved an older step here since: the same lineage. Otherwise
        (a first save, or a step counter that went back: a run from scratch), into a root with
        checkpoints: a new lineage (it continues nothing; what is there stays)."""
        if loaded is not None:
            if loaded.root == r.url:
                r.resume(path=loaded.checkpoint)
            else:
                r.new_lineage(external_parent=loaded.checkpoint)
            return
        if continuing:
            return
        state = r.state() if r.storage.exists(".txckpt") else None
        if state is not None and state.head_tip is not None:
            log.warning(
                "%s: this run loaded no checkpoint, so it starts a new lineage; the checkpoints "
                "already there stay (`txckpt log %s`)",
                r.url,
                r.url,
            )
            r.new_lineage()

    def _add_name(self, r: CheckpointRoot, saved: _Saved, path: str) -> None:
        """Publish ``path`` as a name of ``saved``'s committed file: now, or when its async save
        commits. Object stores have no links: there the name is resolved through the log."""
        if not is_local(r):
            return
        path = os.path.abspath(os.path.expanduser(path))
        result = saved.result

        def publish(where: str) -> None:
            if not os.path.isdir(os.path.dirname(path)):  # a root elsewhere, and no dirpath here
                return
            # Where a checkpoint txckpt did not commit holds the name: the root's orphans.
            aside = r.storage.local_path(orphan_key(os.path.basename(path)))
            assert aside is not None  # a local root
            try:
                if saved.sharded:
                    publish_dir(where, path, durable=r.durable, aside=aside)
                else:
                    link_name(os.path.join(where, saved.name), path, durable=r.durable, aside=aside)
            except OSError as e:  # the bytes are committed; only the link is missing
                log.warning(
                    "could not link %s to committed checkpoint %s (%s); it still loads "
                    "through the plugin (the log), not with torch.load",
                    path,
                    where,
                    e,
                )

        if isinstance(result, Future):
            linked = threading.Event()
            self._linking.append((result, linked))

            def when_done(f: Future) -> None:
                try:
                    if not f.cancelled() and f.exception() is None:
                        publish(f.result())
                finally:
                    linked.set()

            result.add_done_callback(when_done)
        else:
            publish(result)

    def _background_group(self) -> Any:
        """The gloo group of every rank that background sharded saves run their collectives on
        (DCP's plan and commit), so that they never interleave with training's on the default
        group. Made once, at the first such save, which every rank runs."""
        if self._group is None:
            dist = deps.torch.distributed
            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        return self._group

    # ----- load ---------------------------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        self.wait()
        found = resolve(path, self.root, self.storage_options)
        if found is None:
            log.warning(
                "%s is not a checkpoint committed by txckpt (no log, or a file written "
                "without it): loaded as Lightning loads it, unverified",
                path,
            )
            return lightning_load(path, map_location=map_location, weights_only=weights_only)
        if not found.file:
            raise InvalidArgumentError(
                f"{found.checkpoint} is a ModelParallelStrategy checkpoint (DCP shards and meta.pt): load it "
                "with a ModelParallelStrategy Trainer and this plugin (fit(ckpt_path=...)), not through "
                "CheckpointIO.load_checkpoint"
            )
        state = txckpt_load(
            found.checkpoint,
            files=[found.file],
            storage_options=self.storage_options,
            map_location=map_location if map_location is not None else "cpu",
            weights_only=True if weights_only is None else weights_only,
        )
        self._loaded[found.root] = found
        return state[found.file]

    def last_checkpoint_path(self, roots: list[str]) -> str | None:
        """``ckpt_path="last"``: the newest committed checkpoint of the current lineage of
        ``roots`` (the ModelCheckpoints' dirpaths, or the plugin's root), newest commit first,
        as the path of its file; None if none has one. Warns if another lineage holds a newer step."""
        candidates = []
        for root_path in dict.fromkeys([self.root] if self.root is not None else roots):
            r = open_root(root_path, self.storage_options)
            wait_for_root(root_path, self.storage_options)
            try:
                if not r.storage.exists(".txckpt") or r.state().seq < 0:
                    continue
            except FileNotFoundError:
                continue
            found = newest(r)
            if found is not None:
                candidates.append((found, r))
        if not candidates:
            return None
        found, r = max(candidates, key=lambda fr: fr[0].record.time)
        history = r.history()
        newer = [
            c for c in history.checkpoints.values() if c.step > found.record.step and c.txid not in history.retired
        ]
        if newer:
            top = max(newer, key=lambda c: c.step)
            log.warning(
                'ckpt_path="last" resumes step %d, the newest checkpoint of the current lineage of %s; '
                "step %d (lineage %s) is newer but not of the current lineage: a rollback or a run "
                "from scratch abandoned it (`txckpt log %s`)",
                found.record.step,
                r.url,
                top.step,
                top.lineage,
                r.url,
            )
        if not found.file:  # a sharded strategy's: the checkpoint directory, as stock's path is
            return found.checkpoint
        return f"{found.checkpoint.rstrip('/')}/{found.file}"

    # ----- remove -------------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """ModelCheckpoint's rotation: the name goes, and the checkpoint is retired through
        txckpt when nothing else names it and it is the current lineage's own: another
        lineage's checkpoint keeps its name and data, a leased one is deleted when its reader is
        done, the newest and fork points are never retired (protocol §11)."""
        self.wait()
        root_path, name = split(path, self.root)
        r = open_root(root_path, self.storage_options)
        found = resolve(path, self.root, self.storage_options)
        if found is not None and found.record.lineage != r.state().head:
            log.info("%s names a checkpoint of lineage %s, not the current one: kept", path, found.record.lineage)
            return
        local = (
            is_local(r)
            and found is not None
            and found.checkpoint.rstrip("/") != os.path.dirname(os.path.abspath(os.fspath(path)))
        )
        if local and os.path.isfile(os.fspath(path)):
            os.unlink(os.fspath(path))
        elif local and found is not None and not found.file and os.path.isdir(os.fspath(path)):
            unpublish_dir(os.fspath(path))  # a sharded checkpoint's directory of links
        if found is None or is_last(name):
            return
        others = (
            names_in(
                os.path.dirname(os.path.abspath(os.fspath(path))),
                os.path.join(found.checkpoint, found.file),
                besides=name,
            )
            if is_local(r)
            else []
        )
        if [n for n in others if not is_last(n)]:
            return  # a second callback's name still holds these bytes
        # A last*.ckpt name does not keep a checkpoint: it follows the newest, which is never
        # retired (ModelCheckpoint removes the old top-k before it moves last.ckpt on).
        if retire(r, [found.record.txid]):
            finish_retired(r)

    # ----- teardown -----------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for this plugin's async saves; raise the first failure not reported yet."""
        pending, self._pending = self._pending, []
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # reported below, once
                self._errors.append(e)
        self._wait_links()
        self._raise_failures()

    def teardown(self) -> None:
        self.wait()
        for url in list(self._last_named):
            self._retire_superseded(open_root(url, self.storage_options))

    def _wait_links(self) -> None:
        """Wait for the name links of the async saves that have finished (their callbacks run
        right after); those still saving keep theirs for later."""
        still = []
        for future, linked in self._linking:
            if future.done():
                linked.wait()
            else:
                still.append((future, linked))
        self._linking = still

    def _raise_failures(self) -> None:
        still = []
        for f in self._pending:
            if f.done():
                if f.exception() is not None:
                    self._errors.append(f.exception())  # type: ignore[arg-type]
            else:
                still.append(f)
        self._pending = still
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first


class SaveOnPreemption(Callback):
    """SIGTERM (and SIGUSR1, or the ``SLURMEnvironment``'s requeue signal) make the Trainer save
    at its next step boundary, every rank the same step, then the process exit with 128 + the
    signal's number (docs/lightning.md, "Preemption"; docs/preemption.md is the contract).

    ``Trainer(callbacks=[ModelCheckpoint(dirpath=...), SaveOnPreemption(grace_s=100)],
    plugins=[TransactionalCheckpointIO()])``. When training starts, it installs
    ``txckpt.preemption``'s handlers (unless the script did) in place of Lightning's, which would
    stop a SIGTERM'd run without a save and save a SLURM one from inside the handler. At the end
    of each training batch every rank asks ``txckpt.preemption.requested()`` (one all-reduce in a
    process group); once True, the Trainer saves that step through ``trainer.save_checkpoint``
    into the first ModelCheckpoint's dirpath, under its file name, and stops; when training ends
    the pending saves finish (within ``grace_s``), and ``SystemExit(128 + signum)`` leaves
    ``fit``. Under a ``SLURMEnvironment(auto_requeue=True)``, a preemption by its requeue signal
    runs ``scontrol requeue`` from global rank 0 once the save committed, as Lightning's own
    handler does. The requeued run's ``fit(ckpt_path="last")`` resumes that step.

    ``grace_s``: seconds from the signal after which the process exits anyway (a little less
    than the scheduler's grace before its SIGKILL); None: no deadline. A second signal exits at
    once, and the root keeps its last committed checkpoint.
    """

    def __init__(self, grace_s: float | None = None) -> None:
        super().__init__()
        if grace_s is not None and (
            isinstance(grace_s, bool)
            or not isinstance(grace_s, (int, float))
            or not (0 <= float(grace_s) < float("inf"))
        ):
            raise InvalidArgumentError(
                f"SaveOnPreemption(grace_s=...) takes seconds >= 0 (a little less than the scheduler's "
                f"grace before its SIGKILL) or None (no deadline), not {grace_s!r}"
            )
        self.grace_s = None if grace_s is None else float(grace_s)
        #: The global step the preemption saved, once every rank agreed on it (None before).
        self.saved_step: int | None = None
        self._installed_here = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Here, not in setup(): Lightning registers its own SIGTERM / SIGUSR1 handlers just before
        # the training starts (its _SignalConnector) and restores what was there before them at
        # its teardown; installed after them, ours are the ones a signal meets.
        self.saved_step = None
        if not preemption.installed():
            environment = trainer._accelerator_connector.cluster_environment
            signals = list(preemption.DEFAULT_SIGNALS)
            if isinstance(environment, _SLURM_ENVIRONMENTS) and environment.requeue_signal is not None:
                signals.append(int(environment.requeue_signal))
            preemption.install(tuple(dict.fromkeys(int(s) for s in signals)), grace_s=self.grace_s)
            self._installed_here = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.saved_step is not None or not preemption.requested():  # every rank: one collective
            return
        self.saved_step = int(trainer.global_step)
        log.warning(
            "txckpt: preemption: saving step %d, then training stops and the process exits with status %d",
            self.saved_step,
            preemption.exit_status(),
        )
        path = self._path(trainer)
        trainer.save_checkpoint(path)  # every rank calls it; the strategy saves from rank 0
        trainer.should_stop = True
        if trainer.is_global_zero:
            io = trainer.strategy.checkpoint_io
            pending = isinstance(io, TransactionalCheckpointIO) and bool(io.async_save)
            log.warning(
                "txckpt: preemption: %s step %d as %s",
                "saving (async)" if pending else "saved",
                self.saved_step,
                path,
            )

    def _path(self, trainer: Any) -> str:
        """The first ModelCheckpoint's file name for this step, in its dirpath: where
        ``ckpt_path="last"`` looks, under a name its users know."""
        callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, _MODEL_CHECKPOINTS)]
        if not callbacks or callbacks[0].dirpath is None:
            raise InvalidArgumentError(
                'SaveOnPreemption saves into a ModelCheckpoint\'s dirpath (where fit(ckpt_path="last") '
                "looks): give the Trainer a ModelCheckpoint (enable_checkpointing=True, or callbacks=[...])"
            )
        cb = callbacks[0]
        dirpath = cb.dirpath
        assert dirpath is not None  # checked above
        metrics = dict(trainer.callback_metrics)
        metrics["epoch"] = deps.torch.tensor(trainer.current_epoch)
        metrics["step"] = deps.torch.tensor(trainer.global_step)
        return os.path.join(os.fspath(dirpath), os.path.basename(cb.format_checkpoint_name(metrics)))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        try:
            if self.saved_step is not None:
                try:
                    preemption.exit()  # waits for the pending saves, logs them; SystemExit(128 + signum)
                except SystemExit:
                    self._requeue(trainer)
                    raise
        finally:
            self._uninstall()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        if self._installed_here:
            self._installed_here = False
            preemption.uninstall()

    def _requeue(self, trainer: Any) -> None:
        """What Lightning's SLURM handler does after its save: requeue the job, from global rank
        0, when the preemption was the SLURMEnvironment's requeue signal and it auto-requeues."""
        environment = trainer._accelerator_connector.cluster_environment
        signum = preemption.exit_status() - 128
        if not (
            isinstance(environment, _SLURM_ENVIRONMENTS)
            and environment.auto_requeue
            and environment.requeue_signal is not None
            and signum == int(environment.requeue_signal)
            and trainer.is_global_zero
        ):
            return
        job = os.environ.get("SLURM_JOB_ID", "")
        if os.environ.get("SLURM_ARRAY_JOB_ID"):
            job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
        try:
            status = subprocess.call(["scontrol", "requeue", job])
        except OSError as e:
            log.error("txckpt: preemption: could not run scontrol requeue %s (%s): the job is not requeued", job, e)
            return
        if status == 0:
            log.warning("txckpt: preemption: requeued SLURM job %s", job)
        else:
            log.error("txckpt: preemption: scontrol requeue %s exited %d: the job is not requeued", job, status)


class ExactResume(Callback):
    """Makes a run resumed from a checkpoint (``fit(ckpt_path="last")``, after a SIGKILL or a
    preemption, mid-epoch or not) train as the uninterrupted run would have, bit for bit on CPU:
    the same batches in the same order, the same dropout (docs/lightning.md, "Exact resume").

    Stock Lightning 2.x, resuming mid-epoch with a DataLoader that has no ``state_dict``, starts
    the epoch's iterator again from its first batch (it warns) and saves no random generator, so
    the shuffle, the dropout and the batches after the resume point differ. This callback keeps,
    per rank, in the checkpoint (its callback state, gathered from every rank at each save): the
    generators (``txckpt.rng_state()``) at the save and at the epoch's iterator's creation, and
    the number of batches the epoch had done. On a resume mid-epoch, when training starts, it builds
    the epoch's iterator again from the epoch-start generators and the samplers' epoch (so the
    shuffle and the workers' seeds are drawn the same), skips the batches done, then puts back
    the generators of the save; at an epoch's end, it puts back the generators of the save
    before Lightning builds the next epoch's iterator.

    A DataLoader without ``len()`` (an IterableDataset) works too: Lightning fetches one batch
    ahead there, and the skip goes through its fetcher, which does the same; such a dataset must
    draw its order when its iteration starts (or in its workers, from their seeds), not from
    torch's generator between batches in the main process, whose draws then interleave with the
    training step's. A dataset whose items draw from generators of their own (not Python's,
    numpy's global or torch's) is outside what it can restore.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Any = None
        self._epoch_start: dict[str, Any] | None = None  # this rank's generators before the epoch's iter()
        #: After a load: the generators to build the epoch's iterator from, the batches it had
        #: done (skipped), and the generators of the save (restored after the skip).
        self._resume: tuple[dict[str, Any], int, dict[str, Any]] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        # The first epoch's iterator is created by FitLoop.setup_data, after this hook and the
        # checkpoint's restore, before any epoch hook: its generators are these.
        self._epoch_start = rng_state()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # Later epochs create their iterator after this hook (the training epoch loop's start).
        if trainer.current_epoch > 0:
            self._epoch_start = rng_state()

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None:  # a save outside fit: nothing to resume exactly
            return {}
        own = {"at_save": rng_state(), "epoch_start": self._epoch_start}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return {
            "ranks": _gather(own),  # every rank dumps the checkpoint; rank 0's is written
            "done": int(progress.processed),
            "batches": trainer.num_training_batches,  # inf for a loader without len()
            # the epoch's end, where the loader's length does not tell it (it has none)
            "last": bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        ranks = state_dict.get("ranks")
        if trainer is None or not ranks:
            return
        if len(ranks) != trainer.world_size:
            log.warning(
                "txckpt: ExactResume: the checkpoint holds the generators of %d rank(s), this run has %d: "
                "the resume is not exact (the dropout and the shuffle differ from the uninterrupted run)",
                len(ranks),
                trainer.world_size,
            )
            return
        own = ranks[trainer.global_rank]
        done, batches = int(state_dict["done"]), state_dict["batches"]
        if 0 < done < batches and not state_dict.get("last") and own["epoch_start"] is not None:
            self._resume = (own["epoch_start"], done, own["at_save"])
        else:  # at an epoch's end: the next epoch's iterator (FitLoop.setup_data makes it
            # after this load) draws from the generators of the save
            set_rng_state(own["at_save"])
            self._resume = (own["at_save"], 0, own["at_save"])

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Rebuild the resumed epoch's iterator as the uninterrupted run built it. Lightning made
        one already (FitLoop.setup_data), before the samplers' ``set_epoch`` and from other
        generators: a DistributedSampler, or DataLoader workers that take their indices when the
        iterator starts, would give the first epoch's order."""
        resume, self._resume = self._resume, None
        if resume is None:
            return
        epoch_start, done, at_save = resume
        fit_loop = trainer.fit_loop
        fetcher = fit_loop._data_fetcher
        if fetcher is None:
            set_rng_state(at_save)
            log.warning("txckpt: ExactResume: the Trainer has no training data fetcher; the resume is not exact")
            return
        epoch = fit_loop.epoch_progress.current.processed  # what Lightning's set_epoch passes next
        epoch_samplers: list[Any] = [
            sampler
            for loader in fit_loop._combined_loader.flattened
            for sampler in (
                getattr(loader, "sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None),
            )
            if hasattr(sampler, "set_epoch")
        ]
        if not done and not epoch_samplers:
            return  # at an epoch's end, with an order that no epoch number changes: as it is
        for sampler in epoch_samplers:
            sampler.set_epoch(epoch)
        set_rng_state(epoch_start)  # the iterator draws its seeds (shuffle, workers) as the run did
        iter(fetcher)  # a loader without len(): Lightning's fetcher takes one batch ahead here
        if done:
            # The epoch's first batches, trained on before the save. Without len(), through the
            # fetcher, which keeps fetching one ahead: at the save it had taken done + 1 batches,
            # and so it has now, the generators of the save being those after that fetch.
            skip = fetcher.iterator if fetcher.length is not None else fetcher
            for _ in range(done):
                next(skip)
            set_rng_state(at_save)  # (at an epoch's end the save's are what the iterator drew from)


def _gather(own: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``own`` (in rank order) on every rank, on txckpt's gloo group; ``[own]``
    outside a process group."""
    coord = current_coordinator(phase="lightning-exact-resume")
    if not isinstance(coord, TorchDistributed):
        return [own]
    out: list[Any] = [None] * coord.world_size
    deps.torch_distributed.all_gather_object(out, own, group=coord.group)
    return out


def _parse_ckpt_path(original: Callable[..., Any], checkpoint_class: type) -> Callable[..., Any]:
    """``ckpt_path="last"`` read from the log where the strategy's CheckpointIO is ours, instead
    of Lightning's newest-mtime ``last*.ckpt`` of the dirpaths (stock behaviour otherwise)."""

    def parse(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        io = getattr(self.trainer.strategy, "checkpoint_io", None)
        if ckpt_path == "last" and isinstance(io, TransactionalCheckpointIO):
            roots = []
            for cb in self.trainer.checkpoint_callbacks:
                if isinstance(cb, checkpoint_class):
                    # dirpath=None: Lightning's own default (default_root_dir/.../checkpoints),
                    # as its _find_last_checkpoints resolves it.
                    # getattr: a name-mangled private method of ModelCheckpoint.
                    resolve = getattr(cb, "_ModelCheckpoint__resolve_ckpt_dir")  # noqa: B009
                    dirpath = getattr(cb, "dirpath", None) or resolve(self.trainer)
                    roots.append(os.fspath(dirpath))
            found = io.last_checkpoint_path(roots)
            if found is not None:
                return found
        return original(self, state_fn, ckpt_path, model_provided, model_connected)

    parse.__wrapped__ = original  # type: ignore[attr-defined]
    return parse


def _dump_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """The Trainer's checkpoint dict, made just before the strategy hands it to its CheckpointIO:
    where that is ours, it learns the Trainer's optimizers (a CheckpointIO never sees the Trainer)
    for ``async_save="lazy"``."""

    def dump(self: Any, weights_only: Any = None) -> Any:
        checkpoint = original(self, weights_only)
        io = getattr(self.trainer.strategy, "checkpoint_io", None)
        if isinstance(io, TransactionalCheckpointIO) and io.async_save == "lazy" and not weights_only:
            io.trainer_optimizers = list(self.trainer.optimizers)
        return checkpoint

    dump.__wrapped__ = original  # type: ignore[attr-defined]
    return dump


def _sharded_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """ModelParallelStrategy's ``save_checkpoint`` (which bypasses its CheckpointIO) through this
    plugin's one-transaction DCP save where the strategy's CheckpointIO is ours; stock otherwise.
    (FSDPStrategy's sharded saves stay stock: FSDP1 needs a GPU, which the tests here do not
    have; docs/lightning.md, "Sharded strategies".)"""

    def save_checkpoint(self: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> Any:
        io = self.checkpoint_io
        if not (isinstance(io, TransactionalCheckpointIO) and sharded.is_sharded_strategy(self)):
            return original(self, checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise InvalidArgumentError(
                "TransactionalCheckpointIO takes its storage_options once, at construction "
                "(TransactionalCheckpointIO(storage_options=...)), not per save"
            )
        io._save_sharded(self, checkpoint, filepath)
        return None

    save_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return save_checkpoint


def _sharded_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """ModelParallelStrategy's ``load_checkpoint``: a checkpoint this plugin committed is read
    through TransactionalReader; any other path (a stock directory, a full checkpoint file) as
    the strategy reads it."""

    def load_checkpoint(self: Any, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Any:
        io = self.checkpoint_io
        if isinstance(io, TransactionalCheckpointIO) and sharded.is_sharded_strategy(self):
            io.wait()
            path = self.broadcast(os.fspath(checkpoint_path))
            found = resolve(path, io.root, io.storage_options)
            if found is not None and not found.file:
                return io._load_sharded(self, found, weights_only)
        return original(self, checkpoint_path, weights_only)

    load_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return load_checkpoint


def _teardown(original: Callable[..., Any]) -> Callable[..., Any]:
    """ModelParallelStrategy's ``teardown``, which (unlike the base Strategy's) does not tear its
    CheckpointIO down: where that is ours, its teardown runs too (the superseded ``last.ckpt``
    checkpoint of the run is retired there, as under every other strategy)."""

    def teardown(self: Any) -> Any:
        result = original(self)
        io = self.checkpoint_io
        if isinstance(io, TransactionalCheckpointIO):
            io.teardown()
        return result

    teardown.__wrapped__ = original  # type: ignore[attr-defined]
    return teardown


def _install_strategy(strategy: Any) -> None:
    if not hasattr(strategy.save_checkpoint, "__wrapped__"):  # once per process
        strategy.save_checkpoint = _sharded_save(strategy.save_checkpoint)
        strategy.load_checkpoint = _sharded_load(strategy.load_checkpoint)
        strategy.teardown = _teardown(strategy.teardown)


def _install(connector: Any, checkpoint_class: type) -> None:
    if not hasattr(connector._parse_ckpt_path, "__wrapped__"):  # once per process
        connector._parse_ckpt_path = _parse_ckpt_path(connector._parse_ckpt_path, checkpoint_class)
    if not hasattr(connector.dump_checkpoint, "__wrapped__"):
        connector.dump_checkpoint = _dump_checkpoint(connector.dump_checkpoint)


_install(_CheckpointConnector, ModelCheckpoint)
_install_strategy(ModelParallelStrategy)
if standalone_io is not None:
    # pytorch_lightning 2.x is the same code under other module names: its Trainer accepts a
    # plugin that is an instance of lightning_fabric's CheckpointIO (an ABC: register ours).
    standalone_io.CheckpointIO.register(TransactionalCheckpointIO)
    _install(standalone_connector._CheckpointConnector, standalone_callbacks.ModelCheckpoint)

__all__ = ["TransactionalCheckpointIO", "SaveOnPreemption", "ExactResume"]
