"""Rank targets of tests/test_dcp_incremental_crash.py: an incremental DCP save on 2 real gloo
ranks that shares tensor files with committed checkpoints (of its own lineage, or of the lineage a
rollback abandoned), one rank SIGKILLed at one of its file operations (local files, or S3 requests);
then, in fresh ranks, the checks of the root it left and a retry of the save.

The state is dcp_workers' frozen base + adapter + Adam moments, except that an adapter's bytes
(and its moments') may be those of another step (``seeds``: {adapter name: step}): an adapter
equal to the previous step's is one that stopped changing, written in a file of its own (its
first MiB matches what the previous save packed) and shared by the saves after; so a fork
re-saving step 2 can share the adapter files of the abandoned lineage's step 3 while writing the
other adapter anew (packed). ``seeds`` is kept in each checkpoint's metadata: a check rebuilds the state
any committed checkpoint must hold from its manifest alone."""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.children import dcp_workers as cw

SHAPES = cw.frozen_layout(12, 4)  # per rank: 4 base tensors of 1.5 MiB, 2 adapter tensors of 1 MiB
ADAPTERS = sorted(n for n in SHAPES if n.startswith("adapter."))


def lineage_state(step: int, seeds: dict[str, int], world: int, rank: int) -> dict[str, Any]:
    """``cw.frozen_state(step)``, with adapter ``name`` (and its moments) taken from step
    ``seeds[name]``."""
    out = cw.frozen_state(step, SHAPES, world, rank)
    for seed in sorted(set(seeds.values())):
        other = cw.frozen_state(seed, SHAPES, world, rank)
        for name in (n for n, s in seeds.items() if s == seed):
            for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
                out[key] = other[key]
    return out


def _save(root: str, step: int, seeds: dict[str, int], world: int, rank: int, so: dict | None) -> str:
    """The checkpoint's path, on every rank (the writer knows it on the coordinator)."""
    from txckpt.integrations.dcp import TransactionalWriter

    w = TransactionalWriter(root, step, storage_options=so, incremental=True, metadata={"seeds": seeds})
    dcp.save(lineage_state(step, seeds, world, rank), storage_writer=w)
    path = [w.path]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def saves(
    rank: int,
    world: int,
    *,
    root: str,
    steps: list[int],
    storage_options: dict | None = None,
    full_first: bool = False,
    seeds: dict[str, dict[str, int]] | None = None,
) -> list[str]:
    """The sweep's template: ``steps`` saved one after the other (incrementally, except the first
    when ``full_first``), every adapter of its own step but those ``seeds[str(step)]`` names."""
    from txckpt.integrations.dcp import TransactionalWriter

    paths = []
    for i, step in enumerate(steps):
        if full_first and i == 0:
            w = TransactionalWriter(root, step, storage_options=storage_options, metadata={"seeds": {}})
            dcp.save(lineage_state(step, {}, world, rank), storage_writer=w)
            paths.append(w.path)  # None but on the coordinator
        else:
            paths.append(_save(root, step, (seeds or {}).get(str(step), {}), world, rank, storage_options))
    return paths


def retire_all_but_newest(root: str, so: dict | None) -> int:
    """Retention keep_last=1, abandoned checkpoints retired at once: deletes every checkpoint but
    the newest, among them the ones that first held the bytes it shares. How many it retired."""
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention
    from txckpt._root.root import open_root

    return len(apply_retention(open_root(root, so), RetentionPolicy(keep_last=1, abandoned=0)))


def _tracer(backend: str, kill_at: Any, when: str, label_file: str | None, root: str, prefix: str) -> Any:
    if backend == "s3":
        from tests.reliability.injectors import S3Injector

        # Every request this rank sends: "before" it never left, "after" the server applied it.
        return S3Injector(kill_at, when, by_occurrence=True, label_file=label_file, root_prefix=prefix)
    from tests.children import dist_workers as dw

    return dw.tracer(kill_at, when, label_file, root)


def killed_save(
    rank: int,
    world: int,
    *,
    root: str,
    step: int,
    seeds: dict[str, int],
    victim: int,
    kill_at: Any,
    when: str,
    backend: str = "local",
    prefix: str = "",
    resume_step: int | None = None,
    retention: bool = False,
    storage_options: dict | None = None,
    ops_file: str | None = None,
    label_file: str | None = None,
) -> Any:
    """A restarted job resumes (``resume_step``: a rollback, forking a new lineage) and saves
    ``step`` incrementally; with ``retention``, rank 0 then retires every checkpoint but the new
    one. Rank ``victim`` traces its operations and SIGKILLs itself at ``kill_at``
    ((name, occurrence); None: only count them, into ``ops_file`` with whether each mutates)."""
    import txckpt

    txckpt.resume(root, step=resume_step, storage_options=storage_options)
    traced = _tracer(backend, kill_at, when, label_file, root, prefix).install() if rank == victim else None
    try:
        path = _save(root, step, seeds, world, rank, storage_options)
        if retention and rank == 0:
            retire_all_but_newest(root, storage_options)
    finally:
        if traced is not None:
            traced.uninstall()
            if ops_file:
                with open(ops_file, "w") as f:
                    json.dump([[r["name"], r["mut"]] for r in traced.records], f)
    return path


# ---------------------------------------------------------------------------------------------
# After a kill: what a fresh job finds, and a retry


def _committed(root: str, so: dict | None) -> list[Any]:
    from txckpt._root.root import open_root

    return [c for c in open_root(root, so).checkpoints("all") if c.state != "retired"]


def _verify_all(root: str, so: dict | None, when: str) -> list[str]:
    """Every committed (not retired) checkpoint of every lineage is present and verifies: no byte
    any committed manifest references was deleted or changed."""
    import txckpt

    out = []
    for c in _committed(root, so):
        if c.path is None:
            out.append(f"{when}: committed step {c.step} ({c.state}, txid {c.txid}) is gone")
            continue
        try:
            txckpt.verify_checkpoint(c.path, storage_options=so)
        except Exception as e:  # noqa: BLE001 - a violation, reported
            out.append(
                f"{when}: committed step {c.step} ({c.state}) fails verification: {type(e).__name__}: {str(e)[:200]}"
            )
    return out


def load_differences(path: str, world: int, rank: int, so: dict | None) -> Any:
    """dcp.load of ``path`` through TransactionalReader (full verification) into zeroed targets
    sharded over ``world`` ranks: the names whose loaded bytes differ from what the checkpoint's
    step and seeds say, or the error."""
    from torch.distributed.checkpoint.api import CheckpointException

    import txckpt
    from txckpt.integrations.dcp import TransactionalReader

    m = txckpt.read_manifest(path, storage_options=so)
    want = lineage_state(m.step, dict(m.metadata.get("seeds") or {}), world, rank)
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0) for k, v in want.items()}
    try:
        with warnings.catch_warnings():  # DCP warns that a no_dist load is one process: it is meant to be
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(got, storage_reader=TransactionalReader(path, storage_options=so), no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported (DCP's is a BaseException)
        return f"{type(e).__name__}: {str(e)[:300]}"

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    return sorted(
        k
        for k in want
        if not (torch.equal(local(got[k]), local(want[k])) if isinstance(want[k], torch.Tensor) else got[k] == want[k])
    )


def _first_check(root: str, so: dict | None, before: list[str], prev_step: int, new_step: int) -> dict[str, Any]:
    """Rank 0, before anything else touches the root: the committed checkpoints all verify, the
    newest is the previous step or (only if committed) the new one and loads bit-exact; gc then
    (dead staging, the killed save's leftovers) deletes nothing a committed manifest references."""
    import txckpt
    from txckpt._maintenance.gc import collect_garbage
    from txckpt._root.root import open_root

    v = _verify_all(root, so, "after the kill")
    new = [c for c in _committed(root, so) if c.txid not in before]
    committed = bool(new)
    if any(c.step != new_step for c in new) or len(new) > 1:
        v.append(f"unexpected new checkpoints {[(c.step, c.txid) for c in new]}")
    last = txckpt.get_last_checkpoint(root, storage_options=so)
    if last is None:
        v.append("get_last_checkpoint found nothing")
    else:
        step = txckpt.read_manifest(last, storage_options=so).step
        if step != (new_step if committed else prev_step):
            v.append(f"newest is step {step}, expected {new_step if committed else prev_step} (committed: {committed})")
        diff = load_differences(last, 1, 0, so)
        if diff:
            v.append(f"newest {last} does not load bit-exact: {diff}")
    txckpt.forget_roots()
    collect_garbage(open_root(root, so), grace_seconds=0)
    v += _verify_all(root, so, "after gc")
    return {"violations": v, "committed": committed}


def after_kill(
    rank: int,
    world: int,
    *,
    root: str,
    before: list[str],
    prev_step: int,
    new_step: int,
    seeds: dict[str, int],
    storage_options: dict | None = None,
) -> Any:
    """Fresh ranks after the kill: rank 0 checks the root (:func:`_first_check`); then both retry
    the save (a restart: resume, save the step the killed save was saving, or the next one if it
    committed), which must commit, be the newest, and load bit-exact at 2 ranks; then rank 0 retires
    every other checkpoint (the ones that first held the shared bytes among them), runs gc, and
    checks that what is left verifies and the retry still loads bit-exact at 1 rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    import txckpt

    so = storage_options
    first = [_first_check(root, so, before, prev_step, new_step) if rank == 0 else None]
    dist.broadcast_object_list(first, src=0)
    out: dict[str, Any] = dict(first[0])
    v: list[str] = out["violations"]
    txckpt.resume(root, storage_options=so)
    retry_step = new_step + 1 if out["committed"] else new_step
    try:
        path = _save(root, retry_step, seeds, world, rank, so)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a violation (DCP raises on every rank)
        v.append(f"rank {rank}: the retry's save failed: {type(e).__name__}: {str(e)[:300]}")
        return out
    if rank == 0 and txckpt.get_last_checkpoint(root, storage_options=so) != path:
        v.append("the retry's checkpoint is not the newest")
    diff = load_differences(path, world, rank, so)
    if diff:
        v.append(f"rank {rank}: the retry does not load bit-exact at 2 ranks: {diff}")
    dist.barrier()
    if rank == 0:
        from txckpt._maintenance.gc import collect_garbage
        from txckpt._root.root import open_root

        txckpt.forget_roots()
        out["retired"] = retire_all_but_newest(root, so)
        collect_garbage(open_root(root, so), grace_seconds=0)
        v += _verify_all(root, so, "after retention and gc")
        diff = load_differences(path, 1, 0, so)
        if diff:
            v.append(f"the retry does not load bit-exact after retention: {diff}")
    return out
