"""The global patches of the Trainer integration, each a context manager that restores what it
replaced on the way out: the Hub upload's ignore patterns, ``torch.save`` into a transaction,
``torch.load``'s CPU map location, and ``TrainerState.load_from_json`` keeping a remote best
checkpoint. They are global (module attributes of torch, huggingface_hub, transformers), so
each is held only for the one upstream call that needs it (txckpt.integrations.transformers)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable, Iterator

import huggingface_hub
import torch
import transformers.modeling_utils as hf_modeling
import transformers.trainer as hf_trainer
from transformers.trainer_callback import TrainerState

from txckpt._manifest.manifest import kind_for_name
from txckpt._save.grouped import grouping_of, is_shard_name, save_grouped
from txckpt._save.serialization import torch_save_config

from .paths import is_remote

#: Upstream uploads the whole output_dir to the Hub, ignoring only "_*" and "checkpoint-*":
#: without these, txckpt's log and the abandoned lineages' checkpoints under .txckpt/ would go too.
HUB_IGNORE_PATTERNS = [".txckpt", ".txckpt/*", "*/.txckpt/*", ".txckpt-cache", ".txckpt-cache/*"]


@contextlib.contextmanager
def hub_uploads_skip_txckpt(ignores: list[str] | None = None) -> Iterator[None]:
    """Add ``ignores`` (default HUB_IGNORE_PATTERNS) to every ``upload_folder`` the Trainer makes in
    the block: 5.x calls ``hf_api().upload_folder`` (an HfApi instance), 4.x the module-level
    ``upload_folder`` that ``transformers.trainer`` imported (a bound method of huggingface_hub's
    default HfApi)."""

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

    setattr(huggingface_hub.HfApi, "upload_folder", method)  # setattr: a method replaced on purpose
    if real_module_fn is not None:
        setattr(hf_trainer, "upload_folder", lambda *args, **kwargs: real_module_fn(*args, **with_ignores(kwargs)))
    try:
        yield
    finally:
        setattr(huggingface_hub.HfApi, "upload_folder", real_method)
        if real_module_fn is not None:
            setattr(hf_trainer, "upload_folder", real_module_fn)


def torch_save_into(tx: Any, name: str, obj: Any, save: Callable[[Any, Any], Any]) -> None:
    """Write ``obj`` as ``name`` of ``tx`` through ``tx.open`` with ``save`` (torch.save itself:
    the real one, not a patched one), with txckpt's torch.save settings; a failed write leaves
    nothing in the transaction."""
    out = tx.open(name, "wb")
    try:
        with torch_save_config():
            save(obj, out)
        out.kind = kind_for_name(name)
        out.close()
    except BaseException:
        out.abort()
        raise


@contextlib.contextmanager
def torch_save_through(tx: Any, streamed: set[str]) -> Iterator[None]:
    """While the block runs, a ``torch.save(obj, path)`` made by this thread with ``path`` inside
    ``tx.directory`` (and no other arguments) writes through ``tx.open`` instead, adding the
    file's name to ``streamed``; a second save of a name in ``streamed``, and anything else, goes
    to torch.save unchanged (``tx.check_not_rewritten`` then refuses the commit)."""
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
        torch_save_into(tx, name, obj, real)
        streamed.add(name)
        return None

    torch.save = save
    try:
        yield
    finally:
        torch.save = real


@contextlib.contextmanager
def grouped_weights_through(tx: Any, model: Any) -> Iterator[None]:
    """While the block runs, the one unsharded ``.safetensors`` file that ``save_pretrained``
    writes into ``tx.directory`` from this thread (``model.safetensors``: the model is below
    ``max_shard_size``) is saved grouped through ``tx`` instead (txckpt._save.grouped): the
    tensors unchanged since the last checkpoint in a stock shard of their own, which is shared.
    ``save_pretrained`` has already dropped tied weights (as it writes them) and passes its own
    header metadata, both kept. ``model``'s parameters with ``requires_grad=False`` form the
    frozen shard from the first save on; those it trains are assumed changed (never hashed).
    Shards ``save_pretrained`` makes itself, and anything else, are written as upstream does."""
    real = hf_modeling.safe_save_file
    me = threading.get_ident()
    directory = os.path.realpath(tx.directory)
    grouping = grouping_of(model)

    @functools.wraps(real)
    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> Any:
        path = os.path.realpath(os.fspath(filename)) if isinstance(filename, (str, os.PathLike)) else ""
        name = os.path.basename(path)
        if threading.get_ident() != me or os.path.dirname(path) != directory or is_shard_name(name):
            return real(tensors, filename, metadata=metadata)
        save_grouped(tx, name, tensors, metadata=metadata, **grouping)
        return None

    setattr(hf_modeling, "safe_save_file", save_file)
    try:
        yield
    finally:
        setattr(hf_modeling, "safe_save_file", real)


@contextlib.contextmanager
def plain_cpu_map_location() -> Iterator[None]:
    """``torch.load(..., map_location=<an indexed CPU device>)`` maps to plain "cpu" in the block."""
    real = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        loc = kwargs.get("map_location")
        if isinstance(loc, (str, torch.device)) and torch.device(loc).type == "cpu":
            kwargs["map_location"] = "cpu"
        return real(*args, **kwargs)

    setattr(torch, "load", load)
    try:
        yield
    finally:
        setattr(torch, "load", real)


@contextlib.contextmanager
def remote_best_checkpoints_kept() -> Iterator[list[str] | None]:
    """In the block ``TrainerState.load_from_json`` sets a remote ``best_model_checkpoint`` aside
    (to None) instead of letting transformers 5.x drop it as "not a local directory"; the block
    gets the list of those set aside, to put back once checked. None (nothing patched): a
    transformers whose ``load_from_json`` is not the classmethod this was written for."""
    descriptor = TrainerState.__dict__.get("load_from_json")
    if not isinstance(descriptor, classmethod):
        yield None
        return
    real = descriptor.__get__(None, TrainerState)
    remote: list[str] = []

    def load_from_json(json_path: str) -> Any:
        state = real(json_path)
        if state.best_model_checkpoint is not None and is_remote(state.best_model_checkpoint):
            remote.append(state.best_model_checkpoint)
            state.best_model_checkpoint = None
        return state

    setattr(TrainerState, "load_from_json", staticmethod(load_from_json))
    try:
        yield remote
    finally:
        setattr(TrainerState, "load_from_json", descriptor)
