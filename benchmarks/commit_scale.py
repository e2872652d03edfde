"""The commit at many ranks, simulated (issue 33's baseline): the real commit code of rank 0 for W
ranks, W = 8 ... 10,240, on one local root.

Each simulated rank has written one file into the shared staging directory (``__{r}_0.distcp``,
one byte: the commit's cost does not depend on the data) and reports it the way a rank's report
travels to rank 0 (``{"rank", "files": {name: {size, xxh3_128, kind, rank}}}``; DCP's writer and
the gather send exactly this). Rank 0's part is then timed as it runs in a real save:
``Transaction.begin_external(W)`` (plan, intent, staging) untimed, the files created untimed,
then ``commit_reports`` (agree on names, list and check the staging, write the manifest, append
the commit entry, publish) in process CPU seconds. Reported per W: rank 0's commit CPU, the bytes
it receives per rank (the reports' JSON), and the manifest's size, which every loading rank
reads whole today. Report only (no goal): these are the figures the per-rank manifests of issue
33 are to flatten.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from . import harness as h

TITLE = "Commit at many ranks (simulated): today's cost"


def _one(w: int) -> dict[str, Any]:
    import txckpt
    from txckpt.checksum import digest_bytes
    from txckpt.manifest import MANIFEST_NAME

    root = h.fresh_dir(f"commit-{w}")
    try:
        txckpt.save_checkpoint(root, 1, {"a.json": {"w": w}})  # the log and the lineage exist
        r = txckpt.CheckpointRoot(root)
        tx = r.transaction(2)
        plan = tx.begin_external(w)
        staging = r.storage.local_path(plan.key)
        assert staging is not None
        digest = digest_bytes(b"x")
        reports = []
        for rank in range(w):
            name = f"__{rank}_0.distcp"
            with open(os.path.join(staging, name), "wb") as f:
                f.write(b"x")
            reports.append({"rank": rank, "files": {name: {"size": 1, "xxh3_128": digest, "kind": "bytes",
                                                            "rank": rank}}})
        received = sum(len(json.dumps(rep)) for rep in reports)
        t0 = time.process_time()
        path = tx.commit_reports(reports)
        cpu = time.process_time() - t0
        manifest = os.path.getsize(os.path.join(path, MANIFEST_NAME))
    finally:
        h.remove(root)
    return {"cpu": cpu, "per_rank": received / w, "manifest": manifest}


def run(quick: bool) -> dict[str, Any]:
    s = h.settings()
    widths = [8, 64] if s.tiny else [8, 64, 512, 2048] if s.quick else [8, 64, 512, 2048, 10240]
    rows: list[dict[str, Any]] = []
    base: dict[str, Any] | None = None
    for w in widths:
        h.log(f"commit_scale: W={w}")
        m = _one(w)
        base = base or m
        rows.append({"case": f"rank 0's commit CPU, W={w}", "size": f"W={w}", "txckpt": m["cpu"],
                     "other": base["cpu"], "ratio": m["cpu"] / base["cpu"] if base["cpu"] else float("nan"),
                     "goal": None, "reps": 1,
                     "note": f"receives {m['per_rank']:.0f} B per rank; manifest {m['manifest']} B "
                             f"({m['manifest'] / w:.0f} B per rank), read whole by every loading rank"})
    return {"id": "commit-scale", "title": TITLE, "rows": rows,
            "about": (__doc__ or "").split("\n\n", 1)[1].strip()
            + " *ratio*: W's commit CPU ÷ W=8's."}
