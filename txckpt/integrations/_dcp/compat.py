"""The names of torch.distributed.checkpoint (DCP) that txckpt's DCP integration needs and torch
does not publish, imported here and nowhere else.

``txckpt.integrations.dcp`` writes DCP's own file format item by item (so ``FileSystemReader``
still reads a committed checkpoint) with DCP's own item writer, and loads items as
``FileSystemReader`` does. The functions and classes that do that are private to torch (a
leading underscore, a private module, or absent from the module's ``__all__``): any torch
release may rename or drop one. They are all imported below, when the integration is imported,
so a torch without one of them, or whose private functions take other parameters than the
integration passes (:data:`PARAMETERS`), fails at once, with an ImportError naming the torch
version and every missing name (:data:`PRIVATE_NAMES`), never later in the middle of a save. A test checks
that every name of the list resolves on the installed torch and that the integration imports
torch's DCP names from no other place.
"""

from __future__ import annotations

import importlib
import inspect

import torch

#: (module, name) of every torch name the integration uses that torch does not publish.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.distributed._shard._utils", "narrow_tensor_by_index"),
    ("torch.distributed.checkpoint.filesystem", "CURRENT_DCP_VERSION"),
    ("torch.distributed.checkpoint.filesystem", "DEFAULT_SUFFIX"),
    ("torch.distributed.checkpoint.filesystem", "_split_by_size_and_type"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StorageWriterTransforms"),
    ("torch.distributed.checkpoint.filesystem", "_write_files_from_queue"),
)


#: The parameters the integration passes, in order, to the private functions it calls.
PARAMETERS: dict[str, tuple[str, ...]] = {
    "_split_by_size_and_type": ("bins", "items"),
    "_write_files_from_queue": (
        "create_stream",
        "file_queue",
        "result_queue",
        "planner",
        "transforms",
        "inflight_threshhold",
        "use_fsync",
        "thread_count",
        "serialization_format",
    ),
}


def missing_names(names: tuple[tuple[str, str], ...] = PRIVATE_NAMES) -> list[str]:
    """``module.name`` of each of ``names`` that the installed torch does not have, or has with
    other parameters than :data:`PARAMETERS` says (``module.name(parameters)``)."""
    out = []
    for module, name in names:
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            out.append(f"{module}.{name}")
            continue
        if name in PARAMETERS:
            try:
                have = tuple(inspect.signature(obj).parameters)
            except (TypeError, ValueError):
                have = ()
            if have != PARAMETERS[name]:
                out.append(f"{module}.{name}({', '.join(PARAMETERS[name])}) (this torch's takes ({', '.join(have)}))")
    return out


def incompatible_torch(missing: list[str]) -> ImportError:
    """The error of a torch that lacks ``missing``: its version, each name, what to do."""
    return ImportError(
        f"txckpt.integrations.dcp cannot run on torch {torch.__version__}: it lacks "
        f"{', '.join(missing)} (private to torch.distributed.checkpoint, which txckpt uses to write "
        "DCP's own file format). Install a torch release this txckpt supports (its tests pin "
        "torch 2.13.0: see its Makefile), or a txckpt release made for this torch; txckpt's other "
        "APIs do not need these names"
    )


try:
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.filesystem import (
        CURRENT_DCP_VERSION,
        DEFAULT_SUFFIX,
        _split_by_size_and_type,
        _StorageInfo,
        _StorageWriterTransforms,
        _write_files_from_queue,
    )
except ImportError as e:
    raise incompatible_torch(missing_names() or [str(e)]) from e
_resigned = missing_names()  # present, but some take other parameters than the integration passes
if _resigned:
    raise incompatible_torch(_resigned)


__all__ = [
    "PRIVATE_NAMES",
    "PARAMETERS",
    "missing_names",
    "incompatible_torch",
    "narrow_tensor_by_index",
    "CURRENT_DCP_VERSION",
    "DEFAULT_SUFFIX",
    "_split_by_size_and_type",
    "_StorageInfo",
    "_StorageWriterTransforms",
    "_write_files_from_queue",
]
