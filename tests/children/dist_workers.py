"""Rank targets of tests/test_distributed.py (and the helpers they share with the other rank
targets): top-level functions ``target(rank, world, **kwargs)`` that tests/harness/launcher.py's
``launch`` runs on real gloo ranks, each its own process forked from the launcher's forkserver.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import signal
from typing import Any, Iterator

from tests.harness import tracer as _tracer
from tests.harness.tracer import Tracer


# ---------------------------------------------------------------------------------------------
# Targets


def payload(rank: int, step: int, n: int = 64) -> dict[str, Any]:
    """The files rank ``rank`` saves at ``step`` (distinct per rank and step)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"rank{rank}.pt": {"w": torch.randn(n, generator=g), "rank": rank, "step": step},
        f"rank{rank}.bin": bytes([rank, step % 256]) * n,
    }


def save_files(
    rank: int,
    world: int,
    *,
    root: str,
    step: int,
    api: str = "save_checkpoint",
    names: str | None = None,
    raise_on: int | None = None,
    timeout: float | None = None,
    saves: int = 1,
) -> Any:
    """One (or ``saves``) coordinated save(s) of this rank's files; returns the path(s) and the
    number of collectives each save used."""
    import torch

    import txckpt
    from txckpt._base import coordination

    calls = {"n": 0}
    orig = {m: getattr(coordination.TorchDistributed, m) for m in ("broadcast", "gather", "barrier", "gather_records")}

    def counted(m):
        def wrapper(self, *a, **kw):
            calls["n"] += 1
            return orig[m](self, *a, **kw)

        return wrapper

    for m in orig:
        setattr(coordination.TorchDistributed, m, counted(m))
    paths, per_save = [], []
    for i in range(saves):
        s = step + i
        files = payload(rank, s)
        if names == "collide":
            files = {"same.pt": files[f"rank{rank}.pt"]}
        before = calls["n"]
        if api == "save_checkpoint":
            paths.append(txckpt.save_checkpoint(root, s, files))
        else:
            with txckpt.transaction(root, s, timeout=timeout) as tx:
                name_pt, name_bin = list(files)[:2] if len(files) > 1 else (list(files)[0], None)
                tx.save(name_pt, files[name_pt])
                if name_bin:
                    with tx.open(name_bin, "wb") as f:
                        f.write(files[name_bin])
                # Other code writing into the shared directory (save_pretrained-style).
                with open(os.path.join(tx.directory, f"dir-rank{rank}.json"), "w") as f:
                    json.dump({"rank": rank, "step": s}, f)
                os.makedirs(os.path.join(tx.directory, f"sub{rank}"), exist_ok=True)
                torch.save({"rank": rank}, os.path.join(tx.directory, f"sub{rank}", "state.pt"))
                if raise_on == rank:
                    raise ValueError(f"rank {rank} failed on purpose inside the transaction")
            paths.append(tx.path)
        per_save.append(calls["n"] - before)
    return {"paths": paths, "collectives": per_save}


def slow_rank(
    rank: int,
    world: int,
    *,
    root: str,
    step: int,
    slow: int,
    release: Any,
    timeout: float | None = None,
    hold: float = 60.0,
) -> Any:
    """A quick save of ``step`` (which creates txckpt's group with the default timeout), then a
    save of ``step + 1`` with ``timeout`` in which rank ``slow`` blocks until ``release`` is set
    (by the test, after the other ranks gave up): the others must time out, not hang."""
    import txckpt

    txckpt.save_checkpoint(root, step, {f"rank{rank}.bin": b"quick"})
    with txckpt.transaction(root, step + 1, timeout=timeout) as tx:
        tx.save(f"rank{rank}.bin", b"x" * 100)
        if rank == slow:
            release.wait(hold)
    return tx.path


def die_after_gather(rank: int, world: int, *, root: str, step: int, victim: int) -> Any:
    """Rank ``victim`` SIGKILLs itself right after its report (the fixed-size record of its
    manifest part, protocol §3a) reached rank 0."""
    import txckpt
    from txckpt._base import coordination

    if rank == victim:
        real = coordination.TorchDistributed.gather_records

        def gather_then_die(self, record):
            real(self, record)
            os.kill(os.getpid(), signal.SIGKILL)

        coordination.TorchDistributed.gather_records = gather_then_die
    return txckpt.save_checkpoint(root, step, payload(rank, step))


def separate_roots(rank: int, world: int, *, roots: list[str], step: int) -> Any:
    """Each rank passes its own directory as the root, as ranks on different nodes with
    node-local disks mounted at the same path would."""
    import txckpt

    return txckpt.save_checkpoint(roots[rank], step, payload(rank, step))


def enter_mismatch(rank: int, world: int, *, root: str, step: int) -> Any:
    """Rank 1 asks for another step than rank 0: every rank must raise, none may hang."""
    import txckpt

    return txckpt.save_checkpoint(root, step + (rank == 1), payload(rank, step))


def nested_names(rank: int, world: int, *, root: str, step: int) -> Any:
    """Rank 0 writes 'a', then (after a barrier) rank 1 writes 'a/b' into the shared staging:
    rank 1 finds rank 0's file where its directory must go (protocol §3 refuses the pair)."""
    import torch.distributed as dist

    import txckpt

    with txckpt.transaction(root, step) as tx:
        if rank == 0:
            tx.save("a", b"rank 0")
        dist.barrier()
        if rank == 1:
            tx.save("a/b", b"rank 1")
    return tx.path


@contextlib.contextmanager
def spying_reads() -> Iterator[list[str]]:
    """Every path this process opens for reading (``open`` and ``os.open``) while inside."""
    opened: list[str] = []
    real_open = builtins.open
    real_os_open = os.open

    def spy_open(file, mode="r", *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)) and "r" in mode:
            opened.append(os.fsdecode(file))
        return real_open(file, mode, *a, **kw)

    def spy_os_open(path, flags, *a, **kw):
        if not flags & (os.O_WRONLY | os.O_RDWR):
            opened.append(os.fsdecode(path))
        return real_os_open(path, flags, *a, **kw)

    builtins.open, os.open = spy_open, spy_os_open  # type: ignore[assignment]
    try:
        yield opened
    finally:
        builtins.open, os.open = real_open, real_os_open


def reads_of_others(rank: int, world: int, *, root: str, step: int) -> Any:
    """Which staging files of other ranks this rank opened for reading during a save."""
    import txckpt

    with spying_reads() as opened:
        path = txckpt.save_checkpoint(root, step, payload(rank, step))
    others = [
        p
        for p in opened
        if "/.txckpt/tx/" in p and f"rank{rank}." not in os.path.basename(p) and os.path.basename(p).startswith("rank")
    ]
    return {"path": path, "others": others}


# ---------------------------------------------------------------------------------------------
# Crash injection


#: Txids and random temporary suffixes, replaced in op names so that ops can be named across runs.
_RANDOM = re.compile(r"[0-9]+-[0-9a-f]{8}-[0-9a-f]{10}|[0-9a-f]{10,}")


#: test_distributed names its crash points through this module (``dw.occurrences``).
occurrences = _tracer.occurrences


def _stable(name: str) -> str:
    return _RANDOM.sub("<id>", name)


def tracer(
    kill_at: tuple[str, int] | None = None, when: str = "before", label_file: str | None = None, root: str | None = None
) -> Tracer:
    """The suite's tracer (tests/harness/tracer.py) as a rank's crash sweep counts: ops named with
    paths relative to the root and random ids out, a crash point is (name, occurrence) (ranks race
    to create shared directories, so the index of an op can differ by one between runs while its
    name and occurrence do not), and a run of consecutive writes to one file is one op (they land
    in a userspace buffer: torch.save issues dozens of tiny ones; "after" a run means before the
    next operation). ``label_file`` records the op this process dies at."""
    return Tracer(
        kill_at,
        when,
        by_occurrence=True,
        coalesce_writes=True,
        root=root,
        write_sizes=False,
        rename=_stable,
        label_file=label_file,
    )


def crash_save(
    rank: int,
    world: int,
    *,
    root: str,
    step: int,
    victim: int,
    kill_at: tuple[str, int] | None,
    when: str,
    ops_file: str | None = None,
    label_file: str | None = None,
    timeout: float = 60.0,
) -> Any:
    """A coordinated save in which rank ``victim`` traces its file operations (and SIGKILLs
    itself at op ``kill_at``). With ``kill_at=None`` it only counts, writing the ops to
    ``ops_file``."""
    import txckpt

    # A restarted job resumes first (on every rank; rank 0 appends the claim entry), so the
    # traced save's only log entry is its commit.
    txckpt.resume(root)
    files = payload(rank, step)
    if rank != victim:
        with txckpt.transaction(root, step, timeout=timeout) as tx:
            for name, obj in files.items():
                tx.save(name, obj)
        return tx.path
    traced = tracer(kill_at, when, label_file, root).install()
    try:
        with txckpt.transaction(root, step, timeout=timeout) as tx:
            for name, obj in files.items():
                tx.save(name, obj)
    finally:
        traced.uninstall()
        if ops_file:
            with open(ops_file, "w") as f:
                json.dump(traced.ops, f)
    return tx.path


# ---------------------------------------------------------------------------------------------
# Checks that run in a fresh process after a crash


def check_after_crash(root: str, prev_step: int, new_step: int, world: int) -> dict[str, Any]:
    """What a restarted job sees: the previous or the new checkpoint (new only if its commit
    entry exists), complete and verified; and it can save the next step."""
    import txckpt
    from txckpt._root.root import CheckpointRoot

    violations: list[str] = []
    history = CheckpointRoot(root).history()
    committed = [c for c in history.checkpoints.values() if c.step == new_step]
    last = txckpt.get_last_checkpoint(root)
    if last is None:
        return {"violations": ["get_last_checkpoint found nothing"], "committed": bool(committed)}
    manifest = txckpt.read_manifest(last)
    expect_step = new_step if committed else prev_step
    if manifest.step != expect_step:
        violations.append(
            f"get_last_checkpoint gave step {manifest.step}, expected {expect_step} "
            f"(commit entry for {new_step}: {bool(committed)})"
        )
    expected_files = (
        {n for r in range(world) for n in payload(r, new_step)}
        if manifest.step == new_step
        else set(payload(0, prev_step))
    )
    if set(manifest.files) != expected_files:
        violations.append(f"step {manifest.step} holds {sorted(manifest.files)}, expected {sorted(expected_files)}")
    if manifest.step == new_step:
        for name, entry in manifest.files.items():
            if entry.rank != int(name[4:].split(".")[0]):
                violations.append(f"{name} is attributed to rank {entry.rank}")
    try:
        loaded = txckpt.load_checkpoint(last)
    except Exception as e:  # noqa: BLE001
        violations.append(f"load_checkpoint({last}) failed: {type(e).__name__}: {e}")
    else:
        for r in range(world if manifest.step == new_step else 1):
            if loaded[f"rank{r}.pt"]["step"] != manifest.step:
                violations.append(f"rank{r}.pt of step {manifest.step} holds step {loaded[f'rank{r}.pt']['step']}")
    # The restarted job goes on saving.
    try:
        nxt = txckpt.save_checkpoint(root, new_step + 1, {"after.bin": b"restart"})
        if txckpt.get_last_checkpoint(root) != nxt:
            violations.append("the save after the restart is not the newest checkpoint")
        txckpt.verify_checkpoint(nxt)
    except Exception as e:  # noqa: BLE001
        violations.append(f"saving after the restart failed: {type(e).__name__}: {e}")
    return {"violations": violations, "committed": bool(committed), "step": manifest.step}


def make_baseline(root: str, step: int) -> str:
    """A root whose newest checkpoint (step ``step``) was saved by one process."""
    import txckpt

    return txckpt.save_checkpoint(root, step, payload(0, step))


def rollback_every_rank(rank: int, world: int, *, root: str, step: int) -> Any:
    """Every rank calls txckpt.resume(root, step=...) as a DDP script naturally would, then all
    ranks save the next step together."""
    import txckpt

    path = txckpt.resume(root, step=step)
    saved = txckpt.save_checkpoint(root, step + 1, payload(rank, step + 1))
    return {"resumed": path, "saved": saved}


def fallback_every_rank(rank: int, world: int, *, root: str) -> Any:
    """Every rank restarts with resume(root, on_damaged="fallback") (rank 0 verifies and decides),
    then all ranks save the step after the one resumed."""
    import txckpt

    path = txckpt.resume(root, on_damaged="fallback")
    step = txckpt.read_manifest(path).step
    saved = txckpt.save_checkpoint(root, step + 1, payload(rank, step + 1))
    return {"resumed": path, "saved": saved}


def tiered_save(rank: int, world: int, *, fast: str, durable: str, steps: list[int]) -> Any:
    """Saves of this rank's files through one TieredRoot per rank (tests/test_tiered_root.py):
    only rank 0 replicates, so every rank's files must reach the durable tier through it."""
    import txckpt

    tiered = txckpt.TieredRoot(fast, durable)
    paths = [txckpt.save_checkpoint(tiered, s, payload(rank, s)) for s in steps]
    tiered.wait_durable()
    return {"paths": paths, "pending": [c.step for c in tiered.pending()]}
