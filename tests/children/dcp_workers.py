"""Rank targets for tests/test_dcp.py: FSDP2 (``fully_shard``) models saved and loaded through
torch.distributed.checkpoint with txckpt's TransactionalWriter / TransactionalReader, on real
gloo ranks started by tests/harness/launcher.py."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

HIDDEN = 64


def model(seed: int) -> nn.Module:
    """The test model, initialised from ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 8))


def sharded(seed: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def trained(seed: int, world: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded model and its Adam state after one step (each rank its own batch)."""
    m = sharded(seed, world) if world > 1 or dist.is_initialized() else model(seed)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    m(torch.randn(4, 16, generator=g)).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def state(m: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if opt is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(m)}
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd}


def full(m: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Every tensor of model (and optimizer) state, unsharded, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    if opt is None:
        return {"model": get_model_state_dict(m, options=options)}
    msd, osd = get_state_dict(m, opt, options=options)
    return {"model": msd, "optim": osd}


def _flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}{i}/"))
    elif isinstance(tree, torch.Tensor):
        t = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        out[prefix.rstrip("/")] = t.detach().cpu()
    return out


def compare(got: dict[str, Any], ref_file: str) -> dict[str, Any]:
    ref = torch.load(ref_file, weights_only=True)
    a, b = _flat(got), ref
    diff = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))
    return {"tensors": len(b), "different": diff[:10]}


def save(
    rank: int,
    world: int,
    *,
    root: str,
    step: int,
    seed: int | None = None,
    ref_file: str | None = None,
    mode: str = "sync",
    storage_options: dict | None = None,
    resume_step: int | None = None,
    optim: bool = True,
    planner: str | None = None,
    **kw: Any,
) -> Any:
    """One dcp.save through TransactionalWriter of an FSDP2 model (+ Adam); rank 0 writes the
    full state to ``ref_file`` (outside the root) to compare loads with. ``planner``:
    ``"drops-storage-data"`` for a planner that does not pass the local plans' storage_data on."""
    import logging

    import txckpt
    from txckpt.integrations.dcp import TransactionalWriter

    if resume_step is not None:
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]  # collect, print nothing
        logging.getLogger("txckpt").addHandler(handler)
        try:
            txckpt.resume(root, step=resume_step, storage_options=storage_options)
        finally:
            logging.getLogger("txckpt").removeHandler(handler)
        kw["warned"] = [r.getMessage()[:200] for r in records if r.levelno >= logging.WARNING]
    m, opt = trained(step if seed is None else seed, world, rank)
    if not optim:
        opt = None
    sd = state(m, opt)
    if ref_file is not None:
        f = _flat(full(m, opt))
        if rank == 0:
            torch.save(f, ref_file)
    writer = TransactionalWriter(root, step, storage_options=storage_options, metadata={"by": "dcp"})
    if planner == "drops-storage-data":
        kw["planner"] = _DropsStorageData()
    if mode == "async":
        md = dcp.async_save(sd, storage_writer=writer).result()
    elif mode == "async-process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        md = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        return {
            "path": md.storage_meta.checkpoint_id if md is not None and md.storage_meta else None,
            "returned": md.storage_meta.checkpoint_id if md is not None and md.storage_meta else None,
            "warned": kw.get("warned"),
        }
    else:
        md = dcp.save(sd, storage_writer=writer, planner=kw.get("planner"))
    return {"path": writer.path, "returned": md.storage_meta.checkpoint_id, "warned": kw.get("warned")}


class _DropsStorageData(dcp.DefaultSavePlanner):
    """A planner whose global plan drops what the storage writer put in the local plans (DCP's
    contract does not say a planner keeps it)."""

    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        import dataclasses

        plans, metadata = super().create_global_plan(all_plans)
        return [dataclasses.replace(p, storage_data=None) for p in plans], metadata


def expect_error(rank: int, world: int, **kw: Any) -> Any:
    """:func:`save`, returning the txckpt error each rank got inside DCP's CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        save(rank, world, **kw)
    except CheckpointException as e:
        return {rank_: [type(exc).__name__, str(exc)[:300]] for rank_, (exc, _tb) in e.failures.items()}
    return None


def expect_error_per_rank(
    rank: int, world: int, *, roots: list[str], steps: list[int], new_lineages: tuple[int, ...] = (), **kw: Any
) -> Any:
    """:func:`expect_error` with this rank's own root and step (``roots[rank]``, ``steps[rank]``):
    ranks that disagree on what they save. ``new_lineages``: ranks that first, one after the
    other in that order, start a new lineage on their own (``collective=False``): the last one's
    is the root's, each earlier rank holds a stale one."""
    import txckpt

    for r in new_lineages:
        if rank == r:
            txckpt.new_lineage(roots[rank], collective=False)
        dist.barrier()
    return expect_error(rank, world, root=roots[rank], step=steps[rank], **kw)


def load(
    rank: int,
    world: int,
    *,
    path: str,
    ref_file: str,
    seed: int = 99,
    verify: str = "full",
    storage_options: dict | None = None,
    optim: bool = True,
) -> Any:
    """dcp.load through TransactionalReader into a fresh model of ``world`` ranks (1: plain,
    unsharded), then every tensor compared with the saved full state."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from txckpt.integrations.dcp import TransactionalReader

    from txckpt.errors import TxckptError

    m = sharded(seed, world) if world > 1 else model(seed)
    opt = torch.optim.Adam(m.parameters(), lr=0.01) if optim else None
    sd = state(m, opt)

    def described(exc: BaseException) -> list:
        return [type(exc).__name__, str(exc)[:400], getattr(exc, "path", None)]

    try:
        reader = TransactionalReader(path, storage_options=storage_options, verify=verify)
    except TxckptError as e:  # raised by the reader itself, before any collective of DCP's
        return {"errors": {"opening": described(e)}}
    try:
        dcp.load(sd, storage_reader=reader)
    except CheckpointException as e:  # raised inside DCP's read: every rank gets every failure
        return {"errors": {r: described(exc) for r, (exc, _tb) in e.failures.items()}}
    if opt is not None:
        set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        m.load_state_dict(sd["model"]) if world == 1 else set_state_dict(m, (), model_state_dict=sd["model"])
    return compare(full(m, opt), ref_file)


# ---------------------------------------------------------------------------------------------
# Crash sweep: rank ``victim`` traces its file operations and SIGKILLs itself at one


def crash_save(
    rank: int,
    world: int,
    *,
    root: str,
    step: int,
    victim: int,
    kill_at: Any,
    when: str,
    ops_file: str | None = None,
    label_file: str | None = None,
) -> Any:
    """A restarted job (resume on every rank, rank 0 appends the claim) saves ``step`` through
    DCP; the model (no optimizer: the sweep is about the commit) is the one seeded by ``step``."""
    import txckpt
    from tests.children import dist_workers as dw
    from txckpt.integrations.dcp import TransactionalWriter

    txckpt.resume(root)
    m = sharded(step, world)
    sd = state(m, None)
    traced = dw.tracer(kill_at, when, label_file, root).install() if rank == victim else None
    try:
        writer = TransactionalWriter(root, step)
        dcp.save(sd, storage_writer=writer)
    finally:
        if traced is not None:
            traced.uninstall()
            if ops_file:
                with open(ops_file, "w") as f:
                    json.dump(traced.ops, f)
    return writer.path


def check_after_crash(root: str, prev_step: int, new_step: int) -> dict[str, Any]:
    """Fresh process: the newest checkpoint is the previous one or the new one (new only if its
    commit entry exists), loads through TransactionalReader with exactly its step's weights, no
    staging is visible, and a restarted job saves the next step."""
    import txckpt
    from txckpt.integrations.dcp import TransactionalReader
    from txckpt._root.root import CheckpointRoot

    violations: list[str] = []
    committed = any(c.step == new_step for c in CheckpointRoot(root).history().checkpoints.values())
    last = txckpt.get_last_checkpoint(root)
    if last is None:
        return {"violations": ["get_last_checkpoint found nothing"], "committed": committed}
    manifest = txckpt.read_manifest(last)
    expect = new_step if committed else prev_step
    if manifest.step != expect:
        violations.append(f"lookup gave step {manifest.step}, expected {expect} (committed: {committed})")
    if "/.txckpt/tx/" in last and manifest.txid not in CheckpointRoot(root).history().checkpoints:
        # A committed checkpoint may stay at its home when its publication was cut short.
        violations.append(f"lookup returned uncommitted staging {last}")
    shards = sorted(n for n in manifest.files if n.endswith(".distcp"))
    if shards != ["__0_0.distcp", "__1_0.distcp"] or any(manifest.files[n].rank != int(n[2]) for n in shards):
        violations.append(f"shards {[(n, manifest.files[n].rank) for n in shards]}")
    m = model(0)
    sd = {"model": m.state_dict()}
    try:
        dcp.load(sd, storage_reader=TransactionalReader(last), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - a violation, reported
        violations.append(f"load of {last} failed: {type(e).__name__}: {str(e)[:300]}")
    else:
        want = model(manifest.step).state_dict()
        if any(not torch.equal(sd["model"][k], want[k]) for k in want):
            violations.append(f"{last} does not hold the weights of step {manifest.step}")
    try:
        nxt = txckpt.save_checkpoint(root, new_step + 1, {"after.bin": b"restart"})
        if txckpt.get_last_checkpoint(root) != nxt:
            violations.append("the save after the restart is not the newest checkpoint")
    except Exception as e:  # noqa: BLE001
        violations.append(f"saving after the restart failed: {type(e).__name__}: {e}")
    return {"violations": violations, "committed": committed, "step": manifest.step}


def baseline(rank: int, world: int, *, root: str, step: int) -> Any:
    """The sweep's starting root: a DCP checkpoint of ``step`` from ``world`` ranks."""
    from txckpt.integrations.dcp import TransactionalWriter

    w = TransactionalWriter(root, step)
    dcp.save(state(sharded(step, world), None), storage_writer=w)
    return w.path


def shard_file(path: str, rank: int) -> str:
    return os.path.join(path, f"__{rank}_0.distcp")


# ---------------------------------------------------------------------------------------------
# Incremental saves (tests/test_dcp_incremental.py, benchmarks/dcp_incremental.py): a frozen base
# and a changing adapter with its Adam state, as DTensors sharded by rows over the ranks. Every
# rank makes only its own rows (seeded by name and rank), so any world size can rebuild the
# full tensors to compare with.

MiB = 1 << 20


def frozen_layout(frozen_mib: float, adapter_mib: float, tensors: int = 4) -> dict[str, Any]:
    """Names -> (rows per rank at 2 ranks, columns) of the state: ``tensors`` frozen base tensors
    of ``frozen_mib`` in all, an adapter of ``adapter_mib`` in 2 tensors, Adam's two moments of
    the adapter, and small items (a frozen norm, the optimizer's step, a learning rate)."""
    cols = 1024
    per = max(1, int(frozen_mib * MiB / tensors / 4 / cols / 2))
    ad = max(1, int(adapter_mib * MiB / 2 / 4 / cols / 2))
    shapes = {f"base.{i}": (per, cols) for i in range(tensors)}
    shapes.update({f"adapter.{i}": (ad, cols) for i in range(2)})
    return shapes


def _rows(name: str, step: int, rank: int, shape: tuple[int, int]) -> torch.Tensor:
    import zlib

    frozen = name.startswith("base.")
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{0 if frozen else step}/{rank}".encode()))
    return torch.randn(shape, generator=g)


def frozen_state(step: int, shapes: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """The state at ``step`` as ``dcp.save`` gets it: at 2 ranks, DTensors sharded by rows (each
    rank makes only its own rows); at 1 rank, the plain full tensors (both ranks' rows); the
    small items replicated."""

    def rows(name: str, shape: tuple[int, int]) -> torch.Tensor:
        if world == 2:
            return _rows(name, step, rank, shape)
        assert world == 1, "the state is sharded over 2 ranks; loads compare at 1 or 2"
        return torch.cat([_rows(name, step, r, shape) for r in range(2)])

    out: dict[str, Any] = {"lr": 1e-4, "model.norm": torch.ones(1024), "optim.step": torch.tensor(float(step))}
    for name, shape in shapes.items():
        t = rows(name, shape)
        out[f"model.{name}"] = t
        if name.startswith("adapter."):
            out[f"optim.{name}.exp_avg"] = t * 0.1
            out[f"optim.{name}.exp_avg_sq"] = t * t * 0.01
    if world == 1:
        return out
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    return {
        k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
        if isinstance(v, torch.Tensor) and v.dim() == 2
        else v
        for k, v in out.items()
    }


def frozen_saves(
    rank: int,
    world: int,
    *,
    root: str,
    steps: list[int],
    frozen_mib: float = 12,
    adapter_mib: float = 4,
    incremental: bool = True,
    storage_options: dict | None = None,
) -> Any:
    """dcp.save of steps ``steps`` one after the other (each a checkpoint): their paths."""
    from txckpt.integrations.dcp import TransactionalWriter

    shapes = frozen_layout(frozen_mib, adapter_mib)
    paths = []
    for step in steps:
        w = TransactionalWriter(root, step, storage_options=storage_options, incremental=incremental)
        dcp.save(frozen_state(step, shapes, world, rank), storage_writer=w)
        paths.append(w.path)
    return paths


def frozen_load(
    rank: int,
    world: int,
    *,
    paths: list[str],
    frozen_mib: float = 12,
    adapter_mib: float = 4,
    verify: str = "full",
    storage_options: dict | None = None,
) -> Any:
    """dcp.load of each of ``paths`` through TransactionalReader into zeroed targets sharded
    over ``world`` ranks; per path, the names whose loaded rows differ from its step's, or the
    error of each rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    import txckpt
    from txckpt.integrations.dcp import TransactionalReader

    shapes = frozen_layout(frozen_mib, adapter_mib)
    out = {}
    for path in paths:
        step = txckpt.read_manifest(path, storage_options=storage_options).step
        want = frozen_state(step, shapes, world, rank)
        got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0) for k, v in want.items()}
        try:
            dcp.load(
                got,
                storage_reader=TransactionalReader(path, storage_options=storage_options, verify=verify),
                no_dist=world == 1,
            )
        except CheckpointException as e:
            out[path] = {"errors": {r: [type(x).__name__, str(x)[:300]] for r, (x, _tb) in e.failures.items()}}
            continue

        def local(t: Any) -> Any:
            return t.to_local() if hasattr(t, "to_local") else t

        out[path] = {
            "different": sorted(
                k
                for k in want
                if not (
                    torch.equal(local(got[k]), local(want[k]))
                    if isinstance(want[k], torch.Tensor)
                    else got[k] == want[k]
                )
            )
        }
    return out
