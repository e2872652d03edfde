"""Rank targets for tests/test_claims.py (launched by tests/harness/launcher.launch): each rank
writes files straight into ``tx.directory``, as DeepSpeed or DCP do, and claims its own."""

from __future__ import annotations

import os
from typing import Any

from tests.children.dist_workers import spying_reads


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def claim_own_files(
    rank: int, world: int, *, root: str, step: int, claims: str = "own", missing: int | None = None
) -> Any:
    """Each rank writes ``global_step{step}/zero_pp_rank_{r}_mp_rank_00_model_states.pt`` and
    ``model/__{r}_0.distcp`` into tx.directory; rank 0 also writes ``config.json``, claimed by no
    one. ``claims``: "own" (each rank claims its files, the second by glob), "both" (every rank
    also claims rank 0's shard), "none". ``missing``: that rank also claims a name it never wrote.
    Returns the committed path and the staging files this rank opened for reading."""
    import txckpt

    with spying_reads() as opened:
        with txckpt.transaction(root, step) as tx:
            shard = f"global_step{step}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            _write(os.path.join(tx.directory, shard), bytes([rank]) * (4096 + rank))
            _write(os.path.join(tx.directory, "model", f"__{rank}_0.distcp"), bytes([10 + rank]) * 1000)
            if rank == 0:
                _write(os.path.join(tx.directory, "config.json"), b"{}")
            if claims in ("own", "both"):
                tx.claim_files([shard, f"__{rank}_*.distcp"])
            if claims == "both":
                import torch.distributed as dist

                dist.barrier()  # rank 0's shard exists before rank 1 looks for what it claims
                tx.claim_files("*zero_pp_rank_0_mp_rank_*")
            if missing == rank:
                tx.claim_files("never-written.bin")
        path = tx.path
        files = set(txckpt.read_manifest(path).files)
    # Staging paths are <root>/.txckpt/tx/<txid>/checkpoint-<step>/<name>: keep <name>.
    marker = f"/checkpoint-{step}/"
    # Directories opened to fsync them and the manifest rank 0 writes (and links) are no data.
    read = sorted(
        {
            n
            for n in (p.split(marker, 1)[1] for p in opened if "/.txckpt/tx/" in p and marker in p)
            if n in files and n != txckpt.MANIFEST_NAME
        }
    )
    return {"path": path, "read": read}
