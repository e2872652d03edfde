"""Asynchronous saves of the Trainer integration (``TransactionalTrainer(..., txckpt_async_save=True)``).

True takes the lazy snapshot (below) unless the optimizer changes parameters outside its step
(:func:`snapshot_mode`); ``"lazy"`` and ``"copy"`` (copy-first) choose one.

Upstream's ``_save_checkpoint`` writes the checkpoint through files (``save_pretrained``'s
safetensors shards, ``torch.save`` of the optimizer, scheduler, RNG state and arguments, JSON
files). A save is split in two:

* **Capture, in the training thread.** Upstream's ``_save_checkpoint`` runs with a
  :class:`_Capture` standing in for the transaction: its output directory is a private scratch
  directory, and every ``torch.save`` and safetensors ``save_file`` into it is *recorded*, not
  written (the object and the writer's arguments). Small files written by other code (JSON,
  tokenizer files) land in the scratch directory and are read into memory. The recorded objects
  are then snapshotted (txckpt/_async/snapshot.py: one copy into buffers reused from save to save) and
  the training loop goes on: it was blocked for upstream's bookkeeping and the copy only.
* **Write and commit, in the background** (``txckpt._async.asyncsave.submit``: the root's worker
  thread, the async saves' own process group). A transaction is opened and each recorded write
  is replayed with the same writer on the snapshot, at the same name: the optimizer and
  scheduler through the transaction as the synchronous path streams them, the others as files
  in ``tx.directory``. So an async checkpoint holds the same files with the same bytes as a
  synchronous one. With ``txckpt_incremental=True`` the model's one ``model.safetensors`` is
  recorded as a GROUPED write and replayed as the synchronous save writes it
  (``patches.grouped_weights_through``): its frozen tensors in a stock shard of their own, shared
  by later saves (txckpt._save.grouped).

What needs the committed checkpoint (``best_model_checkpoint``'s published path, the Hub push,
retention, ``on_save`` callbacks) runs in the training thread after the commit, in step order,
at points where every rank is (the next save, which waits for the previous one first, and the
end of ``train()``): some of it takes collectives. The error of a background save is raised
there too, never lost.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator

import safetensors.torch
import torch
import transformers.modeling_utils as mu

from txckpt import errors as _errors
from txckpt._async import asyncsave
from txckpt._root.root import open_root
from txckpt._save.grouped import grouping_of, is_shard_name, save_grouped

from .patches import torch_save_into
from .preempt import note_committed
from .rank_files import rank_patterns
from .paths import STAGING_DIR_NAME, STAGING_ENV, TRAINER_NAMING, TRAINER_STATE_NAME, is_remote, is_within, public_name

log = logging.getLogger("txckpt.transformers")

#: How a recorded write is replayed: through the transaction with torch.save (what the sync path
#: streams), torch.save to a path, safetensors' save_file to a path, and grouped through the
#: transaction (txckpt._save.grouped.save_grouped: an incremental save's one model file).
STREAM, TORCH, SAFETENSORS, GROUPED = "stream", "torch", "safetensors", "grouped"


class _Sink:
    """What ``_Capture.open`` returns to patches.torch_save_through: the torch.save it
    then makes into it is recorded as a STREAM write of ``name``."""

    def __init__(self, capture: "_Capture", name: str):
        self.capture, self.name, self.kind = capture, name, None

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self.capture.writes.pop(self.name, None)


class _Capture:
    """Stands in for the transaction while upstream's ``_save_checkpoint`` runs in the training
    thread (the mixin's ``_txckpt_tx``): ``output_root``/``directory`` for ``_get_output_dir``,
    ``open`` for the optimizer's streamed writes, ``check_not_rewritten`` for the mixin's check."""

    def __init__(self, base: str, step: int):
        self.output_root = base
        self.directory = os.path.join(base, TRAINER_NAMING.public(step))  # where upstream writes
        os.makedirs(self.directory, exist_ok=True)
        #: name -> (how, object, writer keywords, the real writer), in the order upstream wrote them.
        self.writes: dict[str, tuple[str, Any, dict[str, Any], Callable[..., Any]]] = {}
        self.rewritten: list[str] = []
        self.thread = threading.get_ident()

    def open(self, name: str, mode: str = "wb") -> _Sink:
        return _Sink(self, name)

    def check_not_rewritten(self) -> None:
        if self.rewritten:
            raise _errors.InvalidArgumentError(
                f"{self.rewritten[0]!r} was written through the transaction and then written again"
            )

    def name_of(self, f: Any) -> str | None:
        """The file's name inside the checkpoint if ``f`` is a path in it written by this thread."""
        if threading.get_ident() != self.thread or not isinstance(f, (str, os.PathLike)):
            return None
        path, top = os.path.realpath(os.fspath(f)), os.path.realpath(self.directory)
        return os.path.relpath(path, top).replace(os.sep, "/") if path.startswith(top + os.sep) else None

    def record(self, name: str, how: str, obj: Any, kwargs: dict[str, Any], writer: Callable[..., Any]) -> None:
        if name in self.writes and self.writes[name][0] == STREAM:
            self.rewritten.append(name)  # the sync path's check_not_rewritten refuses this too
        self.writes[name] = (how, obj, kwargs, writer)

    def small_files(self) -> dict[str, bytes]:
        """The files other code wrote into the scratch directory (JSON, tokenizer files)."""
        out = {}
        for d, _, names in os.walk(self.directory):
            for n in names:
                full = os.path.join(d, n)
                name = os.path.relpath(full, self.directory).replace(os.sep, "/")
                if name in self.writes:
                    self.rewritten.append(name)  # recorded, then written by other code: refuse
                with open(full, "rb") as f:
                    out[name] = f.read()
        return out


@contextlib.contextmanager
def _recording(capture: _Capture, grouping: dict[str, Any] | None = None) -> Iterator[None]:
    """torch.save and safetensors' save_file (the module attribute and the name transformers'
    modeling_utils imported) record writes into the capture's directory made by this thread,
    with the real writer the background replays them with; every other call goes through.
    ``grouping`` (an incremental save: :func:`grouping_of`): the one unsharded file that
    ``save_pretrained`` writes at the top of the directory through modeling_utils' name is
    recorded as a GROUPED write instead, as the synchronous save groups exactly that file."""
    real_save = torch.save
    real_st = safetensors.torch.save_file
    real_mu = getattr(mu, "safe_save_file", None)

    @functools.wraps(real_save)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, _Sink) and not args and not kwargs:
            return capture.record(f.name, STREAM, obj, {}, real_save)
        name = capture.name_of(f) if not args and not kwargs else None
        if name is None:
            return real_save(obj, f, *args, **kwargs)
        capture.record(name, TORCH, obj, {}, real_save)

    def st_saver(real: Callable[..., Any], group: dict[str, Any] | None = None) -> Callable[..., Any]:
        @functools.wraps(real)
        def save_file(tensors: Any, filename: Any, metadata: Any = None, **kwargs: Any) -> Any:
            name = capture.name_of(filename)
            if name is None:
                return real(tensors, filename, metadata=metadata, **kwargs)
            if group is not None and not kwargs and "/" not in name and not is_shard_name(name):
                capture.record(name, GROUPED, tensors, dict(group, metadata=metadata), real)
                return None
            capture.record(name, SAFETENSORS, tensors, dict(kwargs, metadata=metadata), real)

        return save_file

    torch.save = save
    setattr(safetensors.torch, "save_file", st_saver(real_st))
    if real_mu is not None:
        setattr(mu, "safe_save_file", st_saver(real_mu, grouping))
    try:
        yield
    finally:
        torch.save = real_save
        setattr(safetensors.torch, "save_file", real_st)
        if real_mu is not None:
            setattr(mu, "safe_save_file", real_mu)


class _Job:
    """One async save: what the training thread does after its commit."""

    def __init__(
        self, step: int, root: str, future: Future, capture_root: str, push: Any, state: Any, best_before: str | None
    ):
        self.step, self.root, self.future = step, root, future
        self.capture_root, self.push, self.state, self.best_before = capture_root, push, state, best_before
        self.on_save: list[Any] = []  # the deferred on_save event (args), at most one


LAZY, COPY = "lazy", "copy"


def check_mode(value: Any) -> bool | str:
    """``txckpt_async_save``: False (sync), True (lazy where the optimizer allows it, else
    copy-first: :func:`snapshot_mode`), "lazy" or "copy"."""
    if value is True or value is False or value in (LAZY, COPY):
        return value
    raise ValueError(f"txckpt_async_save takes True, False, {LAZY!r} or {COPY!r}, not {value!r}")


def steps_in_backward(trainer: Any) -> str | None:
    """Why the parameters of this Trainer change outside ``optimizer.step()`` (None: they do
    not): its layer-wise optimizers (``optim="*_layerwise"``: a dummy optimizer, each parameter
    stepped by a hook during backward) and LOMO/AdaLomo (updated in backward, through ``.data``,
    which no version counter sees). A lazy snapshot would copy half-updated parameters there."""
    optim = str(getattr(getattr(trainer.args, "optim", None), "value", getattr(trainer.args, "optim", "")))
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if type(inner).__name__ == "LayerWiseDummyOptimizer" or "layerwise" in optim:
        return f"optim={optim!r} steps each parameter during backward"
    if "lomo" in optim:
        return f"optim={optim!r} updates the parameters during backward"
    return None


def snapshot_mode(trainer: Any) -> str:
    """LAZY or COPY for this save: ``"lazy"``/``"copy"`` as asked; True: lazy unless the
    optimizer changes parameters outside its step (:func:`steps_in_backward`), then copy-first."""
    asked = trainer.txckpt_async_save
    if asked in (LAZY, COPY):
        return asked
    why = steps_in_backward(trainer)
    if why is not None:
        if not getattr(trainer, "_txckpt_told_copy_first", False):  # once per Trainer
            trainer._txckpt_told_copy_first = True
            log.info("txckpt_async_save=True copies the state before _save_checkpoint returns (copy-first): %s", why)
        return COPY
    return LAZY


class AsyncSaves:
    """The async saves of one Trainer (``trainer``: the mixin instance)."""

    def __init__(self, trainer: Any):
        self._t = trainer
        self._job: _Job | None = None
        self._scratch: str | None = None
        self._defer_on_save = False

    # ----- the save, in the training thread --------------------------------------------------
    def save(self, upstream: Callable[..., Any], model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """The mixin's _save_checkpoint in async mode; ``upstream``: Trainer's, bound."""
        t = self._t
        self.settle()  # the previous save: committed (its follow-up done) or its error raised
        if t._txckpt_already_committed(trial):
            return
        step = int(t.state.global_step)
        root = t._txckpt_root(trial)
        so = t.txckpt_storage_options
        meta = t._txckpt_metadata(trial)
        t._txckpt_pending_push = None
        best_before = t.state.best_model_checkpoint
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="txckpt-async-")
        capture_root = os.path.join(self._scratch, str(step))
        capture = _Capture(capture_root, step)
        t._txckpt_tx = capture
        try:
            t._txckpt_streamed = set()
            t._txckpt_resolve_best(root, step)
            grouping = grouping_of(t.model) if t.txckpt_incremental else None
            with _recording(capture, grouping):
                upstream(model, trial, *args, **kwargs)
            small = capture.small_files()
            t._txckpt_check_streamed(capture)
        finally:
            t._txckpt_tx = None
            shutil.rmtree(capture_root, ignore_errors=True)
        state = copy.deepcopy(t.state)  # as trainer_state.json has it, for the deferred on_save
        push, t._txckpt_pending_push = t._txckpt_pending_push, None
        local_dir = None
        if is_remote(root) and not os.environ.get(STAGING_ENV):
            local_dir = os.path.join(t._txckpt_remote.directory, STAGING_DIR_NAME)

        objs = {name: w[1] for name, w in capture.writes.items()}
        lazy_mode = snapshot_mode(t) == LAZY

        def prepare(pool: Any, eager: Any) -> asyncsave.Job:
            lazy = snap = None
            if lazy_mode:
                # Everything but the parameters and the optimizer state is copied now (buffers,
                # RNG states, arguments: forward may change them); those two change only in the
                # next optimizer step, whose pre-hook waits until the background has copied them.
                lazy = asyncsave.LazySnapshot(
                    eager,
                    objs,
                    [self._optimizer()],
                    params=t.model.parameters(),
                    remedy='saves with txckpt_async_save="copy" (copy-first)',
                )
            else:
                snap = pool.snapshot(objs)
            plan = [(name, how, kw, writer) for name, (how, _, kw, writer) in capture.writes.items()]
            return asyncsave.Job(
                functools.partial(
                    _write_and_commit,
                    root,
                    so,
                    step,
                    meta,
                    plan,
                    snap,
                    small,
                    state,
                    capture_root,
                    local_dir,
                    (pool, lazy),
                    functools.partial(rank_patterns, t),
                    incremental=t.txckpt_incremental,
                ),
                lazy,
            )

        future = asyncsave.submit(root, so, prepare)
        self._job = _Job(step, root, future, capture_root, push, state, best_before)
        self._defer_on_save = True  # upstream calls on_save right after this returns

    def on_save(self, real: Callable[..., Any], args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """The callback handler's on_save: right after an async save, it resets should_save (as
        upstream's does) and defers the callbacks' event until the commit."""
        if not self._defer_on_save or self._job is None:
            return real(args, state, control, **kwargs)
        self._defer_on_save = False
        control.should_save = False
        self._job.on_save.append((args, kwargs))
        return control

    def _optimizer(self) -> Any:
        """The torch optimizer that steps (accelerate wraps it), whose step pre-hook waits for a
        lazy snapshot's copy."""
        return asyncsave.torch_optimizer(self._t.optimizer)

    @property
    def copy_waits(self) -> list[float]:
        """Lazy mode: the seconds each optimizer step that followed a save waited for the
        background copy (the latest 1024; the benchmarks read it)."""
        if not self._t.txckpt_async_save or self._t.optimizer is None or snapshot_mode(self._t) != LAZY:
            return []
        return list(asyncsave.step_gate(self._optimizer()).waits)

    # ----- after the commit, in the training thread --------------------------------------------
    def settle(self, raise_error: bool = True) -> None:
        """Wait for the save in flight; run what follows its commit, or raise its error (logged
        instead with ``raise_error=False``: train() is already raising its own)."""
        job, self._job = self._job, None
        self._defer_on_save = False
        if job is None:
            return
        t = self._t
        e = job.future.exception()  # waits
        asyncsave.mark_reported(job.future)  # raised or logged here: not again by wait_for_saves
        if e is not None:
            if t.state.best_model_checkpoint is not None and is_within(t.state.best_model_checkpoint, job.capture_root):
                t.state.best_model_checkpoint = job.best_before
            if raise_error:
                raise e
            log.error(
                "the async save of %s failed: %s: %s",
                public_name(job.root, t.txckpt_storage_options, job.step),
                type(e).__name__,
                e,
            )
            return
        committed, expected = job.future.result()
        t._txckpt_last_step = job.step
        note_committed(t, job.step, committed)  # a preemption's save: its exit says what committed
        for state in (t.state, job.state):
            if state.best_model_checkpoint is not None and is_within(state.best_model_checkpoint, job.capture_root):
                state.best_model_checkpoint = committed
        if committed != expected:
            log.warning(
                "%s was committed at %s, not at %s; trainer_state.json inside it names %s as best_model_checkpoint",
                public_name(job.root, t.txckpt_storage_options, job.step),
                committed,
                expected,
                expected,
            )
        if t._txckpt_prune_after_commit:
            t._txckpt_prune_after_commit = False
            t._txckpt_remote.drop_cached_copies()
        if job.push is not None:
            t._push_from_checkpoint(committed, *job.push[0], **job.push[1])
        if t.is_world_process_zero():
            t._txckpt_retention(job.root)
        handler = t.callback_handler
        for args, kwargs in job.on_save:
            t.control = handler.call_event("on_save", args, job.state, t.control, **kwargs)

    def finish(self, raise_error: bool = True) -> None:
        """The end of train(): the last save committed and followed up (or its error raised)."""
        try:
            self.settle(raise_error)
        finally:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None

    def install(self) -> None:
        """Route the callback handler's on_save through :meth:`on_save` (per instance)."""
        if self._t.txckpt_async_save:
            engine = (
                "DeepSpeed"
                if getattr(self._t, "is_deepspeed_enabled", False)
                else "FSDP"
                if getattr(self._t, "is_fsdp_enabled", False)
                else None
            )
            if engine is not None:
                # Their saves write sharded state through their own collectives and writers,
                # which the recorded-write snapshot does not capture: refuse, not half-save.
                raise _errors.InvalidArgumentError(
                    f"txckpt_async_save is not supported with {engine} yet: its sharded save is "
                    "written by the engine itself. Use txckpt_async_save=False (the save is still "
                    "transactional), or save through torch.distributed.checkpoint with "
                    "txckpt.integrations.dcp.TransactionalWriter and dcp.async_save (docs/distributed.md)"
                )
        handler = self._t.callback_handler
        real = handler.on_save
        handler.on_save = functools.partial(self.on_save, real)


def _write_and_commit(
    root: str,
    so: Any,
    step: int,
    meta: Any,
    plan: list,
    snap: dict | None,
    small: dict,
    state: Any,
    capture_root: str,
    local_dir: str | None,
    lazy: tuple,
    claims: Callable[[int], list[str]],
    coordinator: Any,
    *,
    incremental: bool = False,
) -> tuple[str, str]:
    """The background job: replay the recorded writes from the snapshot in one transaction. Lazy
    mode (``snap`` None): complete the snapshot first (``lazy``: the pool and the
    LazySnapshot), here, which lets the optimizer step go on.
    ``claims(rank)``: the globs of the files this rank writes itself (rank_files), claimed as
    the synchronous save claims them, so that the manifest says which rank wrote each."""
    if snap is None:
        pool, pending = lazy
        snap = pending.take(pool)

    with open_root(root, so).transaction(
        step, metadata=meta, coordinator=coordinator, local_dir=local_dir, incremental=incremental
    ) as tx:
        expected = tx.final_path
        directory = tx.directory
        for name, data in small.items():
            if (
                name == TRAINER_STATE_NAME
                and state.best_model_checkpoint is not None
                and is_within(state.best_model_checkpoint, capture_root)
            ):
                # The best is this step: the published path, as the sync path's _txckpt_publish_best.
                fixed = copy.deepcopy(state)
                fixed.best_model_checkpoint = expected
                fixed.save_to_json(os.path.join(directory, name))
                continue
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        for name, how, kw, writer in plan:
            obj = snap[name]
            if how == STREAM:  # as patches.torch_save_through writes it
                torch_save_into(tx, name, obj, writer)
                continue
            if how == GROUPED:  # as patches.grouped_weights_through saves it
                save_grouped(tx, name, obj, **kw)
                continue
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            writer(obj, path, **kw)
        if tx.world_size > 1:
            tx.claim_files(claims(tx.rank))
    assert tx.path is not None
    return tx.path, expected


__all__ = ["AsyncSaves", "check_mode", "snapshot_mode", "steps_in_backward", "LAZY", "COPY"]
