"""A frozen base inside a prepared model, never rewritten: ``TransactionalAccelerator(incremental=True)``
saves each model's ``model{_i}.safetensors`` grouped (txckpt._save.grouped; docs/incremental.md,
"Accelerate"), and its ``load_state`` reads that layout back.

Save: accelerate's ``save_accelerator_state`` writes model i's state dict through
``accelerate.utils.other.save``, which calls the module's ``safe_save_file`` (safetensors'
``save_file``) with ``model{_i}.safetensors`` in the output directory. While
:func:`grouped_models_through` holds, that call, from this thread into ``tx.directory``, goes to
:func:`txckpt._save.grouped.save_grouped` instead: the tensors unchanged since the last commit
(by their xxh3-128 against the committed tensor index, never by serializing twice), and the
parameters with ``requires_grad=False`` from the first save on, in a stock shard of their own
that is shared (a hard link, a server-side copy), the trained ones in another. A model whose
tensors are all trained or all frozen keeps the one file ``model{_i}.safetensors``.

Load: stock ``load_accelerator_state`` (accelerate 1.15.0) reads model i only from
``model{_i}.safetensors`` or ``pytorch_model{_i}.bin``, never an index and its shards. While
:func:`grouped_models_loaded` holds, ``accelerate.accelerator.load_accelerator_state`` (the name
``Accelerator.load_state`` calls) loads every model itself where a model was saved grouped
(``model{_i}.safetensors.index.json`` with ``metadata.txckpt_grouped``), the others as stock
does, then lets the stock function restore everything else. A directory without a grouped
model goes to the stock function untouched.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import accelerate.accelerator as accelerate_accelerator
import accelerate.checkpointing as accelerate_checkpointing
import accelerate.utils.other as accelerate_other
from accelerate.state import PartialState
from safetensors.torch import load_file

from txckpt._save.grouped import GROUPED_KEY, grouping_of, index_name, is_shard_name, save_grouped

#: accelerate's names for model i's weights: ``model.safetensors``, ``model_1.safetensors``, ...
SAFE_MODEL_STEM = "model"


def model_file(i: int) -> str:
    """The file accelerate saves the i-th prepared model as (``safe_serialization=True``)."""
    return f"{SAFE_MODEL_STEM}{'_' + str(i) if i > 0 else ''}.safetensors"


def _model_number(name: str) -> int | None:
    """i if ``name`` is ``model_file(i)``, else None."""
    if name == model_file(0):
        return 0
    stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else ""
    digits = stem[len(SAFE_MODEL_STEM) + 1 :] if stem.startswith(SAFE_MODEL_STEM + "_") else ""
    return int(digits) if digits.isdigit() and model_file(int(digits)) == name else None


@contextlib.contextmanager
def grouped_models_through(tx: Any, models: list[Any]) -> Iterator[None]:
    """While the block runs, ``model{_i}.safetensors`` that accelerate writes into
    ``tx.directory`` from this thread is saved grouped through ``tx`` (module doc). ``models``:
    the prepared models in accelerate's order; model i's parameters with ``requires_grad=False``
    form the frozen shard from the first save on, those it trains are assumed changed (never
    hashed). The names are those of ``get_state_dict(model, unwrap=False)``, the state dict
    accelerate saves (``module.`` first for a wrapped model), as ``named_parameters`` of the
    prepared model gives them; a name they miss (a save pre-hook renamed it) is hashed, so the
    hints only ever cost a write, never a wrong share. Anything else is written as accelerate does."""
    real = accelerate_other.safe_save_file
    me = threading.get_ident()
    directory = os.path.realpath(tx.directory)

    @functools.wraps(real)
    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> Any:
        path = os.path.realpath(os.fspath(filename)) if isinstance(filename, (str, os.PathLike)) else ""
        name = os.path.basename(path)
        i = _model_number(name)
        if threading.get_ident() != me or os.path.dirname(path) != directory or i is None or is_shard_name(name):
            return real(tensors, filename, metadata=metadata)
        model = models[i] if i < len(models) else None
        save_grouped(tx, name, tensors, metadata=metadata, **grouping_of(model))
        return None

    setattr(accelerate_other, "safe_save_file", save_file)  # a module attribute replaced on purpose
    try:
        yield
    finally:
        setattr(accelerate_other, "safe_save_file", real)


def grouped_shards(directory: str, i: int) -> list[str] | None:
    """The shard files model i was saved as, grouped, in ``directory`` (from its index's
    ``weight_map``), or None: saved as one file (or not at all)."""
    name = model_file(i)
    index_path = os.path.join(directory, index_name(name))
    if os.path.exists(os.path.join(directory, name)) or not os.path.exists(index_path):
        return None
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    meta = index.get("metadata") if isinstance(index, dict) else None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(meta, dict) or meta.get(GROUPED_KEY) != name or not isinstance(weight_map, dict):
        return None
    return sorted({os.path.join(directory, str(f)) for f in weight_map.values()})


def load_grouped_model(model: Any, shards: list[str], device: str, strict: bool = True) -> None:
    """Load ``model`` from its grouped ``shards``, as ``safetensors.torch.load_model`` loads one
    file: a key the file lacks because it shares its storage with one it holds (a tied weight,
    which accelerate's save drops) is not missing; any other missing or unexpected key raises
    where ``strict``."""
    state: dict[str, Any] = {}
    for shard in shards:
        state.update(load_file(shard, device=device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    held = {t.untyped_storage().data_ptr() for n, t in own.items() if n in state and t.numel()}
    missing = [n for n in missing if not (own[n].numel() and own[n].untyped_storage().data_ptr() in held)]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__} from {shards}: "
            f"missing keys {missing}, unexpected keys {list(unexpected)}"
        )


@contextlib.contextmanager
def grouped_models_loaded() -> Iterator[None]:
    """While the block runs, ``Accelerator.load_state``'s ``load_accelerator_state`` reads a
    model saved grouped (module doc)."""
    real = accelerate_accelerator.load_accelerator_state

    @functools.wraps(real)
    def load_state(input_dir: Any, models: list[Any], *args: Any, **kwargs: Any) -> Any:
        directory = os.fspath(input_dir)
        shards = [grouped_shards(directory, i) for i in range(len(models))]
        if all(s is None for s in shards):
            return real(input_dir, models, *args, **kwargs)
        # The positional order is stock's: optimizers, schedulers, dataloaders, process_index,
        # scaler, map_location, load_kwargs; then the model kwargs (load_state_dict's).
        location = args[5] if len(args) > 5 else kwargs.get("map_location")
        device = PartialState().device if location == "on_device" else "cpu" if location is None else location
        model_kwargs = {k: v for k, v in kwargs.items() if k not in ("scaler", "map_location", "load_kwargs")}
        for i, (model, grouped) in enumerate(zip(models, shards)):
            if grouped is not None:
                load_grouped_model(model, grouped, str(device), strict=bool(model_kwargs.get("strict", True)))
                continue
            # As stock (load_accelerator_state's model loop): the one file, else torch's .bin.
            one = Path(directory, model_file(i))
            if one.exists():
                accelerate_checkpointing.load_model(model, one, device=str(device), **model_kwargs)
            else:
                state = accelerate_checkpointing.load(
                    Path(directory, f"pytorch_model{'_' + str(i) if i else ''}.bin"), map_location=device
                )
                model.load_state_dict(state, **model_kwargs)
        return real(input_dir, [], *args, **kwargs)

    setattr(accelerate_accelerator, "load_accelerator_state", load_state)
    try:
        yield
    finally:
        setattr(accelerate_accelerator, "load_accelerator_state", real)


__all__ = [
    "grouped_models_loaded",
    "grouped_models_through",
    "grouped_shards",
    "load_grouped_model",
    "model_file",
]
