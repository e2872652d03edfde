"""Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) through txckpt's DCP writer
and reader.

That strategy (like ``FSDPStrategy(state_dict_type="sharded")``, which this module does not
handle: docs/lightning.md says why) never calls ``CheckpointIO.save_checkpoint``: its
``save_checkpoint`` makes the path a directory, ``dcp.save``s the model and optimizer states there with DCP's default
``FileSystemWriter`` (every rank its shards) and ``torch.save``s the rest of the checkpoint dict
as ``meta.pt`` from rank 0; ``load_checkpoint`` reads it back with DCP's default reader. Here the
same state goes through :class:`~txckpt.integrations.dcp.TransactionalWriter` (one transaction
for every rank's shards, committed by DCP's coordinator once every rank reported its files
durable) with ``meta.pt`` written by the coordinator into the same staging, and is read back
through :class:`~txckpt.integrations.dcp.TransactionalReader` (every shard verified) and a
verified ``txckpt.load_checkpoint`` of ``meta.pt``. The plugin
(:mod:`txckpt.integrations.lightning`) decides when (docs/lightning.md, "Sharded strategies").
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp

from ..dcp import METADATA_NAME, TransactionalReader, TransactionalWriter

#: The file Lightning's sharded strategies write the non-tensor part of a checkpoint to
#: (lightning.fabric.strategies.fsdp._METADATA_FILENAME).
META_NAME = "meta.pt"


def is_sharded_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` (a ModelParallelStrategy) saves a checkpoint as a DCP directory: its
    default ``save_distributed_checkpoint=True``; False saves one full file through CheckpointIO."""
    return getattr(strategy, "_save_distributed_checkpoint", False) is True


def is_sharded_files(names: Any) -> bool:
    """Whether a checkpoint's files are a sharded strategy's: DCP's ``.metadata`` and ``meta.pt``."""
    return METADATA_NAME in names and META_NAME in names


class _ShardedWriter(TransactionalWriter):
    """TransactionalWriter that also commits ``meta.pt`` (the checkpoint dict without its model
    and optimizer states): the coordinator writes it into the staging beside DCP's
    ``.metadata``, after every rank's shards are durable, so it is in the same transaction."""

    def __init__(self, *args: Any, meta: bytes | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meta = meta

    def _write_own(self, tx: Any, blobs: dict[str, bytes]) -> dict[str, Any]:
        if self.meta is None:  # a rank other than 0 became DCP's coordinator: nothing to add
            return super()._write_own(tx, blobs)
        return super()._write_own(tx, {**blobs, META_NAME: self.meta})


def save(
    strategy: Any,
    checkpoint: dict[str, Any],
    root: str,
    step: int,
    *,
    storage_options: Mapping[str, Any] | None,
    metadata: Mapping[str, Any],
    incremental: bool,
    background: bool = False,
    group: Any = None,
) -> "str | Future[str]":
    """On every rank: commit ``checkpoint`` as checkpoint ``step`` of ``root``'s current lineage,
    the model and optimizer states as DCP shards (the strategy's own state-dict layout) and the
    rest as ``meta.pt`` from global rank 0. Returns the committed checkpoint's path (every rank).

    ``background``: save with ``dcp.async_save`` on ``group`` (a gloo group of every rank, not
    the one training's collectives use); the states are copied to host memory (DCP's stager)
    before this returns, and the result is the future of the path."""
    converted = {"state_dict": checkpoint.pop("state_dict")}  # the strategy's own keys: stock reads it
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    meta = None
    if strategy.global_rank == 0:  # DCP's coordinator: rank 0 of the default group
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        meta = buf.getvalue()
    writer = _ShardedWriter(
        root, step, storage_options=storage_options, metadata=metadata, incremental=incremental, meta=meta
    )
    if background:
        started = dcp.async_save(converted, storage_writer=writer, process_group=group)
        return _path_when_done(getattr(started, "upload_completion", started), writer)
    return _committed_path(dcp.save(converted, storage_writer=writer), writer)


def _committed_path(result: Any, writer: TransactionalWriter) -> str:
    """The committed checkpoint's path, from what ``dcp.save`` returned (DCP hands every rank
    the coordinator's Metadata, whose ``storage_meta`` names it) or the writer's commit."""
    committed = result.storage_meta.checkpoint_id if result.storage_meta is not None else writer.path
    assert committed is not None  # one of the two, on every rank
    return os.fspath(committed)


def _path_when_done(upload: Any, writer: TransactionalWriter) -> "Future[str]":
    """The future of the committed path of ``writer``'s background save ``upload`` (DCP's
    future of its Metadata), or of the save's exception."""
    out: Future[str] = Future()

    def done(f: Any) -> None:
        error = f.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(_committed_path(f.result(), writer))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            out.set_exception(e)

    upload.add_done_callback(done)
    return out


def load_states(strategy: Any, checkpoint: str, storage_options: Mapping[str, Any] | None) -> None:
    """On every rank: the model and optimizer states of committed checkpoint ``checkpoint`` into
    the strategy's model and optimizers, read through TransactionalReader (every byte used is
    verified), as the strategy's own ``load_checkpoint`` reads them with DCP's default reader."""
    reader = TransactionalReader(checkpoint, storage_options=storage_options)
    module = strategy.model
    strict = strategy.lightning_module.strict_loading
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # As ModelParallelStrategy.load_checkpoint (lightning.fabric's _load_checkpoint) reads them.
    module_state = {"state_dict": get_model_state_dict(module)}
    dcp.load(module_state, storage_reader=reader)
    module.load_state_dict(module_state["state_dict"], strict=strict)
    for i, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optim_state, storage_reader=reader)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
        )


__all__ = [
    "META_NAME",
    "is_sharded_strategy",
    "is_sharded_files",
    "save",
    "load_states",
]
