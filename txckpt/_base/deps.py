"""The modules txckpt imports on first use instead of at ``import txckpt``: one loader each,
whose docstring says why it waits. Every other import in txckpt's core is at the top of its
module (tests/test_architecture.py counts the rest).

Read one as an attribute of this module, at the moment it is needed::

    from . import deps

    def save(obj, out):
        deps.torch.save(obj, out)

``deps.torch`` runs the loader (PEP 562's module ``__getattr__``), so it imports torch the first
time and is a ``sys.modules`` look-up after that, as the ``import torch`` statement in a function
was. Nothing is kept here: a module made unimportable after it loaded (a test's
``sys.modules[name] = None``) reads as missing, an ImportError, as the statement would raise.
For mypy each name is the module itself (the ``TYPE_CHECKING`` block).

Why these wait:

* torch and safetensors: saving bytes or JSON, reading a root's log, and the CLI's ``log``,
  ``ls``, ``gc`` never need them, and torch costs a second or more of start-up; a process that
  saves only bytes never imports torch (docs/distributed.md; tests/test_distributed.py).
* torch.distributed: needed only when a process group is initialised, which needs torch
  imported first; without one txckpt is single-process (docs/distributed.md).
* fsspec and what backs a remote root (s3fs, botocore, aiobotocore): only a remote root needs
  them; s3fs, gcsfs and adlfs are optional extras, and importing them costs start-up a local
  run should not pay. A missing one is reported when a root needs it (MissingDependencyError).
* numpy: only ``txckpt.rng_state`` reads its global generator, and only where it imports: a
  save never needs it, and ``rng_state`` skips it cleanly in an environment without it.
* tqdm: optional (a dependency of transformers, not of txckpt); progress bars only.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # what mypy sees: each name is the module
    import aiobotocore.session as aiobotocore_session
    import botocore.exceptions as botocore_exceptions
    import fsspec
    import fsspec.asyn as fsspec_asyn
    import fsspec.implementations.memory as fsspec_memory
    import numpy
    import s3fs
    import safetensors.torch as safetensors_torch
    import torch
    import torch.distributed as torch_distributed
    import torch.utils.serialization.config as torch_serialization_config
    import tqdm


def _torch() -> ModuleType:
    """torch: only tensors need it (saving bytes does not import it), and it is slow to import."""
    import torch

    return torch


def _torch_distributed() -> ModuleType:
    """torch.distributed: only inside an initialised process group, when torch is imported."""
    import torch.distributed

    return torch.distributed


def _torch_serialization_config() -> ModuleType:
    """torch.save's settings (torch >= 2.5; ImportError before): only a ``torch.save`` needs them."""
    import torch.utils.serialization.config

    return torch.utils.serialization.config


def _safetensors_torch() -> ModuleType:
    """safetensors' reader: only for a .safetensors file txckpt's own decoder does not take."""
    import safetensors.torch

    return safetensors.torch


def _fsspec() -> ModuleType:
    """fsspec: only a remote (URL) root needs it."""
    import fsspec

    return fsspec


def _fsspec_memory() -> ModuleType:
    """fsspec's memory filesystem: only a ``memory://`` root needs it."""
    import fsspec.implementations.memory

    return fsspec.implementations.memory


def _fsspec_asyn() -> ModuleType:
    """fsspec's event-loop runner: only an S3 upload needs it."""
    import fsspec.asyn

    return fsspec.asyn


def _s3fs() -> ModuleType:
    """s3fs (with its ``core`` and ``errors``): optional, the ``s3`` extra; only an S3 root."""
    import s3fs

    return s3fs


def _botocore_exceptions() -> ModuleType:
    """botocore's exceptions: installed with s3fs; only an S3 root's conditional write."""
    import botocore.exceptions

    return botocore.exceptions


def _aiobotocore_session() -> ModuleType:
    """aiobotocore's session: installed with s3fs; only to log an S3 root's retries."""
    import aiobotocore.session

    return aiobotocore.session


def _numpy() -> ModuleType:
    """numpy: only to capture or restore its global generator (``txckpt.rng_state``), if installed."""
    import numpy

    return numpy


def _tqdm() -> ModuleType:
    """tqdm: optional (transformers installs it, txckpt does not need it); progress bars only."""
    import tqdm

    return tqdm


_LOADERS: dict[str, Callable[[], ModuleType]] = {
    "torch": _torch,
    "torch_distributed": _torch_distributed,
    "torch_serialization_config": _torch_serialization_config,
    "safetensors_torch": _safetensors_torch,
    "fsspec": _fsspec,
    "fsspec_memory": _fsspec_memory,
    "fsspec_asyn": _fsspec_asyn,
    "s3fs": _s3fs,
    "botocore_exceptions": _botocore_exceptions,
    "aiobotocore_session": _aiobotocore_session,
    "numpy": _numpy,
    "tqdm": _tqdm,
}

if not TYPE_CHECKING:

    def __getattr__(name: str) -> ModuleType:
        """``deps.<name>``: the module, imported now if it is not yet (PEP 562)."""
        load = _LOADERS.get(name)
        if load is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return load()
