"""The commit at many ranks, simulated (issue 33): the real commit code of rank 0 for W ranks,
W = 8 ... 10,240, on one local root; before (one file table gathered as objects, format /1) and
after (per-rank manifest parts, format /2, protocol §3a).

Each simulated rank has written one file into the shared staging directory (``__{r}_0.distcp``,
one byte: the commit's cost does not depend on the data). Rank 0's part is timed as it runs in
a real save, in process CPU seconds, after ``Transaction.begin_external(W)`` (plan, intent,
staging) and the ranks' writes, untimed:

* *before*: every rank's report as it travelled to rank 0 until issue 33 (``{"rank", "files":
  {name: {size, xxh3_128, kind, rank}}}``, a pickled object), fed to ``commit_reports``: agree
  on names, list and check the staging, write the one manifest, append the commit entry, publish.
* *after, first save*: each rank wrote its part (``txckpt-parts/<rank>.json``, through
  ``rankparts.write_part``, untimed, as the ranks do in parallel) and sends its 56-byte record;
  ``commit_reports([], records)`` reads every part, checks it against its record, checks the
  staging, builds the Merkle tree, writes the tree and the /2 manifest, appends, publishes.
* *after, unchanged structure*: the next save of the same ranks and names: the fast path (no
  part read, no staging listed).

Also per W: the bytes rank 0 receives per rank, and the bytes a loading rank reads to know its
own files, checked: the manifest, its own part and its proof path in the tree file (the last
rank's, the longest path), against the whole /1 manifest before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from . import harness as h

TITLE = "Commit at many ranks (simulated): per-rank manifest parts"


def _staged(r: Any, step: int, w: int, parts: bool) -> tuple[Any, Any, list[Any], list[bytes]]:
    """A transaction of ``w`` simulated ranks with their files (and parts) in its staging."""
    from txckpt.checksum import digest_bytes
    from txckpt.rankparts import write_part

    tx = r.transaction(step)
    plan = tx.begin_external(w)
    staging = r.storage.local_path(plan.key)
    assert staging is not None
    digest = digest_bytes(b"x")
    reports, records = [], []
    for rank in range(w):
        name = f"__{rank}_0.distcp"
        with open(os.path.join(staging, name), "wb") as f:
            f.write(b"x")
        files = {name: {"size": 1, "xxh3_128": digest, "kind": "bytes", "rank": rank}}
        if parts:
            records.append(write_part(r.storage, plan.key, rank, plan.txid, files, durable=False,
                                      directory=False).encode())
        else:
            reports.append({"rank": rank, "files": files})
    return tx, plan, reports, records


def _one(w: int) -> dict[str, Any]:
    import txckpt
    from txckpt import parts as P
    from txckpt.manifest import MANIFEST_NAME, Manifest, read_rank_files

    root = h.fresh_dir(f"commit-{w}")
    out: dict[str, Any] = {}
    try:
        txckpt.save_checkpoint(root, 1, {"a.json": {"w": w}})  # the log and the lineage exist
        r = txckpt.CheckpointRoot(root)
        tx, _, reports, _ = _staged(r, 2, w, parts=False)
        received = sum(len(json.dumps(rep)) for rep in reports)
        t0 = time.process_time()
        path = tx.commit_reports(reports)
        out["before"] = time.process_time() - t0
        out["before_rx"] = received / w
        out["before_read"] = os.path.getsize(os.path.join(path, MANIFEST_NAME))
        for step, label in ((3, "first"), (4, "fast")):
            tx, _, _, records = _staged(r, step, w, parts=True)
            t0 = time.process_time()
            path = tx.commit_reports([], records)
            out[label] = time.process_time() - t0
            out["rx"] = len(records[0])
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            data = f.read()
        manifest = Manifest.decode(data)
        assert manifest.parts is not None and manifest.parts.count == w
        rank = w - 1
        files = read_rank_files(r.storage, r.storage.key_of(path) or "", manifest, rank, path)
        assert list(files) == [f"__{rank}_0.distcp"]
        out["read"] = (len(data) + os.path.getsize(os.path.join(path, P.part_name(rank)))
                       + P.NODE_SIZE * len(P.proof_nodes(w, rank)))
    finally:
        h.remove(root)
    return out


def widths() -> list[int]:
    s = h.settings()
    return [8, 64] if s.tiny else [8, 64, 512, 2048] if s.quick else [8, 64, 512, 2048, 10240]


def run(quick: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    measured = {}
    for w in widths():
        h.log(f"commit_scale: W={w}")
        measured[w] = _one(w)
    w0, wn = min(measured), max(measured)
    at_scale = wn >= 10240  # issue 33's goals are stated at W = 10,240 (quick/tiny runs: report only)
    for w, m in measured.items():
        rows.append({"case": f"rank 0's commit CPU, first save ÷ before (/1), W={w}", "size": f"W={w}",
                     "txckpt": m["first"], "other": m["before"], "ratio": m["first"] / m["before"],
                     "goal": None, "reps": 1,
                     "note": f"before: {m['before_rx']:.0f} B received per rank, {m['before_read']} B read by a "
                             f"loading rank; after: {m['rx']} B per rank, {m['read']} B read"})
    for w, m in measured.items():
        rows.append({"case": f"unchanged structure (fast path) ÷ first save, W={w}", "size": f"W={w}",
                     "txckpt": m["fast"], "other": m["first"], "ratio": m["fast"] / m["first"],
                     "goal": 0.1 if w == wn and at_scale else None, "reps": 1})
    last, first = measured[wn], measured[w0]
    rows.append({"case": f"rank 0's commit CPU, first save, W={wn} ÷ the 1 s goal", "size": f"W={wn}",
                 "txckpt": last["first"], "other": 1.0, "ratio": last["first"], "goal": 1.0 if at_scale else None, "reps": 1})
    rows.append({"case": f"bytes received by rank 0 per rank, W={wn} ÷ 64 B", "size": f"W={wn}", "unit": "bytes",
                 "txckpt": last["rx"], "other": 64, "ratio": last["rx"] / 64, "goal": 1.0 if at_scale else None, "reps": 1})
    rows.append({"case": f"a loading rank's metadata read, W={wn} ÷ W={w0}", "size": f"W={wn}", "unit": "bytes",
                 "txckpt": last["read"], "other": first["read"], "ratio": last["read"] / first["read"],
                 "goal": 1.2 if at_scale else None, "reps": 1,
                 "note": f"before (/1, the whole manifest): {last['before_read']} B at W={wn}, "
                         f"{first['before_read']} B at W={w0}"})
    return {"id": "commit-scale", "title": TITLE, "rows": rows, "measured": {str(k): v for k, v in measured.items()},
            "notes": [curve_table(measured)],
            "about": (__doc__ or "").split("\n\n", 1)[1].strip()}


def curve_table(measured: dict[int, dict[str, Any]]) -> str:
    """Cost against W, as a markdown table (the figure's numbers)."""
    lines = ["| W | before: commit CPU | after: first save | after: fast path | received per rank (before → after) "
             "| a loading rank reads (before → after) |", "|---|---|---|---|---|---|"]
    for w, m in sorted(measured.items()):
        lines.append(f"| {w} | {_ms(m['before'])} | {_ms(m['first'])} | {_ms(m['fast'])} | "
                     f"{m['before_rx']:.0f} B → {m['rx']} B | {m['before_read']} B → {m['read']} B |")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def plot(measured: dict[int, dict[str, Any]], path: str) -> None:
    """Rank 0's commit CPU and a loading rank's read against W (log-log), before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = sorted(measured)
    fig, (cpu, read) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    for key, label in (("before", "before: one table (/1)"), ("first", "parts (/2): first save"),
                       ("fast", "parts (/2): unchanged structure")):
        cpu.plot(ws, [measured[w][key] for w in ws], marker="o", label=label)
    cpu.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="goal at W=10,240: 1 s")
    cpu.set(xscale="log", yscale="log", xlabel="world size W (simulated ranks)", ylabel="rank 0's commit CPU (s)",
            title="Commit cost against W")
    read.plot(ws, [measured[w]["before_read"] for w in ws], marker="o", label="before: the whole manifest")
    read.plot(ws, [measured[w]["read"] for w in ws], marker="o", label="parts: manifest + own part + proof")
    read.set(xscale="log", yscale="log", xlabel="world size W (simulated ranks)", ylabel="bytes",
             title="A loading rank's metadata read against W")
    for ax in (cpu, read):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":  # python -m benchmarks.commit_scale [PNG]: the case alone, and its figure
    h.configure(quick=False)
    table = run(False)
    for row in table["rows"]:
        print(f"{row['case']}: {row['txckpt']:.6g} vs {row['other']:.6g} ratio {row['ratio']:.4f} goal {row['goal']}")
    print(table["notes"][0])
    if len(sys.argv) > 1:
        plot({int(k): v for k, v in table["measured"].items()}, sys.argv[1])
