"""The commit at many ranks, simulated (issue 33): the real commit code of rank 0 for W ranks,
W = 8 ... 10,240, on one local root; before (one file table gathered as objects, format /1) and
after (per-rank manifest parts, format /2, protocol §3a).

Each simulated rank has written what a rank of a real 2-rank DCP save writes (its shard
``__{r}_0.distcp``, sparse: the commit checks sizes, not data, and the digest of each of its
items' byte ranges, shaped as that save's: :data:`RANGE_LENGTHS`), and rank 0 its own
``.metadata`` (sized per rank as that save's). Rank 0's part is timed as it runs in a real save,
in process CPU seconds, after ``Transaction.begin_external(W)`` (plan, intent, staging) and the
ranks' writes, untimed:

* *before*: every rank's report as it travelled to rank 0 until issue 33 (``{"rank", "files":
  {name: {size, xxh3_128, kind, rank}}, "ranges": {name: {offset: [length, xxh3_128]}}}``, a
  pickled object), fed to ``commit_reports``: agree on names, list and check the staging, write
  the one manifest, append the commit entry, publish; rank 0 wrote every rank's range digests
  into ``txckpt-dcp-ranges.json`` (its own file, as a one-rank save still does).
* *after, first save*: each rank wrote its part (``txckpt-parts/<rank>.json``: its files and
  their range digests, through ``rankparts.write_part``, untimed, as the ranks do in parallel)
  and sends its 56-byte record; ``commit_reports([own], records)`` reads every part, checks it
  against its record, checks the staging, builds the Merkle tree, writes the tree and the /2
  manifest, appends, publishes.
* *after, unchanged structure*: the next save of the same ranks and names: the fast path (no
  part read, no staging listed).

Also per W: the bytes rank 0 receives per rank, and the bytes a DCP loading rank reads to know
its own files and their range digests (what ``TransactionalReader(verify="ranges")`` checks its
reads against), checked, as the storage calls returned them: the manifest, its own part (with
its ranges) and its proof path's nodes in the tree file (of the rank that reads most: the
highest of those with the longest path); before: the whole /1 manifest, and, not in that
figure, ``txckpt-dcp-ranges.json`` (``before_ranges``: every rank's digests), which a DCP load
read too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from . import harness as h

TITLE = "Commit at many ranks (simulated): per-rank manifest parts"


#: A rank's files as a real 2-rank DCP save (tests/test_dcp.py's FSDP2 model + Adam through
#: TransactionalWriter) wrote them: one shard per rank, ``__<rank>_0.distcp``, and the
#: committer's own ``.metadata`` (8,533 B), which grows with the ranks (per rank: half of it).
#: The bytes are sparse (the commit checks sizes, not data); the entries carry real xxh3-128
#: digests.
METADATA_BYTES_PER_RANK = 8_533 // 2
#: The byte length of each item's range in that save's shard of the rank that records more
#: ranges (rank 1's ``__1_0.distcp``: 28 ranges, 50,028 B; rank 0 records 12), in file order:
#: a simulated rank records as many ranges, of these lengths, each with its own xxh3-128 digest,
#: in its part (1,584 B there). They tile the shard.
RANGE_LENGTHS: tuple[int, ...] = (1261,) * 11 + (
    1325,
    3625,
    1705,
    2601,
    1577,
    1577,
    3625,
    3625,
    1577,
    1705,
    1705,
    1577,
    2601,
    2601,
    1577,
    1577,
    1577,
)
SHARD_BYTES = sum(RANGE_LENGTHS)
assert len(RANGE_LENGTHS) == 28 and SHARD_BYTES == 50_028


def _sparse(path: str, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def _staged(r: Any, step: int, w: int, parts: bool) -> tuple[Any, Any, list[Any], list[bytes]]:
    """A transaction of ``w`` simulated DCP ranks with their shards (and parts) in its staging,
    and the committer's own files; the reports (before: every rank's table and the committer's
    own; after: the committer's own) and the records (after)."""
    from txckpt._base.checksum import digest_bytes
    from txckpt._manifest.rankparts import write_part

    tx = r.transaction(step)
    plan = tx.begin_external(w)
    staging = r.storage.local_path(plan.key)
    assert staging is not None
    reports, records = [], []
    for rank in range(w):
        name = f"__{rank}_0.distcp"
        _sparse(os.path.join(staging, name), SHARD_BYTES)
        digest = digest_bytes(f"{step} {name}".encode())
        files = {name: {"size": SHARD_BYTES, "xxh3_128": digest, "kind": "bytes", "rank": rank}}
        ranges = {name: _ranges(step, name)}
        if parts:
            records.append(
                write_part(
                    r.storage, plan.key, rank, plan.txid, files, durable=False, directory=False, ranges=ranges
                ).encode()
            )
        else:
            reports.append({"rank": rank, "files": files, "ranges": ranges})
    own = {}
    size = METADATA_BYTES_PER_RANK * w
    _sparse(os.path.join(staging, ".metadata"), size)
    own[".metadata"] = {
        "size": size,
        "xxh3_128": digest_bytes(f"{step} .metadata".encode()),
        "kind": "bytes",
        "rank": 0,
    }
    if not parts:  # until the ranges moved into the parts: every rank's, in one file of rank 0's
        data = json.dumps({n: rg for rep in reports for n, rg in rep["ranges"].items()}, sort_keys=True).encode()
        with open(os.path.join(staging, "txckpt-dcp-ranges.json"), "wb") as f:
            f.write(data)
        own["txckpt-dcp-ranges.json"] = {"size": len(data), "xxh3_128": digest_bytes(data), "kind": "json", "rank": 0}
    reports.append({"rank": 0, "files": own})  # DCP's finish: the committer's own files, as a report
    return tx, plan, reports, records


def _ranges(step: int, name: str) -> dict[str, list[Any]]:
    """A simulated rank's range digests of its shard: RANGE_LENGTHS' ranges, each its own digest."""
    from txckpt._base.checksum import digest_bytes

    out, offset = {}, 0
    for length in RANGE_LENGTHS:
        out[str(offset)] = [length, digest_bytes(f"{step} {name} {offset}".encode())]
        offset += length
    return out


def _load_read(storage: Any, key: str, path: str, rank: int) -> dict[str, int]:
    """What a DCP loading rank reads to know its own files and their range digests (checked
    against the Merkle root), by what the storage calls returned: the manifest, its part (with
    its ranges), its proof's tree nodes: TransactionalReader's read (``read_rank_part``)."""
    from txckpt._base.layout import MANIFEST_NAME
    from txckpt._manifest.manifest import Manifest, read_rank_part

    got = {"manifest": 0, "part": 0, "proof": 0}
    real_bytes, real_ranges = storage.read_bytes, storage.read_ranges

    def read_bytes(k: str) -> bytes:
        data = real_bytes(k)
        got["manifest" if k.endswith(MANIFEST_NAME) else "part"] += len(data)
        return data

    def read_ranges(k: str, ranges: Any) -> list[bytes]:
        out = real_ranges(k, ranges)
        got["proof"] += sum(len(b) for b in out)
        return out

    storage.read_bytes, storage.read_ranges = read_bytes, read_ranges
    try:
        manifest = Manifest.decode(storage.read_bytes(f"{key}/{MANIFEST_NAME}"))
        part = read_rank_part(storage, key, manifest, rank, path)
    finally:
        del storage.read_bytes, storage.read_ranges
    name = f"__{rank}_0.distcp"
    assert manifest.parts is not None and list(part.files) == [name], part.files
    assert list(manifest.files) == [".metadata"] and list(part.ranges) == [name], part.ranges  # no ranges file
    assert len(part.ranges[name]) == len(RANGE_LENGTHS), part.ranges
    return got


def _one(w: int) -> dict[str, Any]:
    import txckpt
    from txckpt._manifest import parts as P
    from txckpt._base.layout import MANIFEST_NAME

    root = h.fresh_dir(f"commit-{w}")
    out: dict[str, Any] = {}
    try:
        txckpt.save_checkpoint(root, 1, {"a.json": {"w": w}})  # the log and the lineage exist
        r = txckpt.CheckpointRoot(root)
        tx, _, reports, _ = _staged(r, 2, w, parts=False)
        received = sum(len(json.dumps(rep)) for rep in reports[:-1])
        t0 = time.process_time()
        path = tx.commit_reports([{"rank": rep["rank"], "files": rep["files"]} for rep in reports])
        out["before"] = time.process_time() - t0
        out["before_rx"] = received / w
        out["before_read"] = os.path.getsize(os.path.join(path, MANIFEST_NAME))
        out["before_ranges"] = os.path.getsize(os.path.join(path, "txckpt-dcp-ranges.json"))
        for step, label in ((3, "first"), (4, "fast")):
            tx, _, reports, records = _staged(r, step, w, parts=True)
            t0 = time.process_time()
            path = tx.commit_reports(reports, records)
            out[label] = time.process_time() - t0
            out["rx"] = len(records[0])
        # The rank that reads most: the longest proof path (a sibling at every level), and of
        # those the highest rank (the most digits in its part).
        rank = max(range(w), key=lambda i: (len(P.proof_nodes(w, i)), i))
        got = _load_read(r.storage, r.storage.key_of(path) or "", path, rank)
        out["read"] = sum(got.values())
        out["read_parts"] = got
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
        rows.append(
            {
                "case": f"rank 0's commit CPU, first save ÷ before (/1), W={w}",
                "size": f"W={w}",
                "txckpt": m["first"],
                "other": m["before"],
                "ratio": m["first"] / m["before"],
                "goal": None,
                "reps": 1,
                "note": f"before: {m['before_rx']:.0f} B received per rank, {m['before_read']} B read by a "
                f"loading rank (the /1 manifest; a DCP load also {m['before_ranges']} B of "
                f"txckpt-dcp-ranges.json); after: {m['rx']} B per rank, {m['read']} B read",
            }
        )
    for w, m in measured.items():
        rows.append(
            {
                "case": f"unchanged structure (fast path) ÷ first save, W={w}",
                "size": f"W={w}",
                "txckpt": m["fast"],
                "other": m["first"],
                "ratio": m["fast"] / m["first"],
                "goal": 0.1 if w == wn and at_scale else None,
                "reps": 1,
            }
        )
    last, first = measured[wn], measured[w0]
    rows.append(
        {
            "case": f"rank 0's commit CPU, first save, W={wn} ÷ the 1 s goal",
            "size": f"W={wn}",
            "txckpt": last["first"],
            "other": 1.0,
            "ratio": last["first"],
            "goal": 1.0 if at_scale else None,
            "reps": 1,
        }
    )
    rows.append(
        {
            "case": f"bytes received by rank 0 per rank, W={wn} ÷ 64 B",
            "size": f"W={wn}",
            "unit": "bytes",
            "txckpt": last["rx"],
            "other": 64,
            "ratio": last["rx"] / 64,
            "goal": 1.0 if at_scale else None,
            "reps": 1,
        }
    )
    rows.append(
        {
            "case": f"a loading rank's metadata read, W={wn} ÷ W={w0}",
            "size": f"W={wn}",
            "unit": "bytes",
            "txckpt": last["read"],
            "other": first["read"],
            "ratio": last["read"] / first["read"],
            "goal": 1.2 if at_scale else None,
            "reps": 1,
            "note": f"before (/1, the whole manifest): {last['before_read']} B at W={wn}, "
            f"{first['before_read']} B at W={w0}; a DCP load also read txckpt-dcp-ranges.json: "
            f"{last['before_ranges']} B at W={wn}, {first['before_ranges']} B at W={w0}",
        }
    )
    return {
        "id": "commit-scale",
        "title": TITLE,
        "rows": rows,
        "measured": {str(k): v for k, v in measured.items()},
        "notes": [curve_table(measured)],
        "about": (__doc__ or "").split("\n\n", 1)[1].strip(),
    }


def curve_table(measured: dict[int, dict[str, Any]]) -> str:
    """Cost against W, as a markdown table (the figure's numbers)."""
    lines = [
        "| W | before: commit CPU | after: first save | after: fast path | received per rank (before → after) "
        "| a DCP loading rank reads (before: the /1 manifest, + txckpt-dcp-ranges.json → after: manifest + "
        "part with its ranges + proof) |",
        "|---|---|---|---|---|---|",
    ]
    for w, m in sorted(measured.items()):
        got = m.get("read_parts") or {}
        split = f" ({got['manifest']} + {got['part']} + {got['proof']})" if got else ""
        lines.append(
            f"| {w} | {_ms(m['before'])} | {_ms(m['first'])} | {_ms(m['fast'])} | "
            f"{m['before_rx']:.0f} B → {m['rx']} B | {m['before_read']} B + {m['before_ranges']} B → "
            f"{m['read']} B{split} |"
        )
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
    for key, label in (
        ("before", "before: one table (/1)"),
        ("first", "parts (/2): first save"),
        ("fast", "parts (/2): unchanged structure"),
    ):
        cpu.plot(ws, [measured[w][key] for w in ws], marker="o", label=label)
    cpu.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="goal at W=10,240: 1 s")
    cpu.set(
        xscale="log",
        yscale="log",
        xlabel="world size W (simulated ranks)",
        ylabel="rank 0's commit CPU (s)",
        title="Commit cost against W",
    )
    read.plot(ws, [measured[w]["before_read"] for w in ws], marker="o", label="before: the whole manifest")
    read.plot(
        ws,
        [measured[w]["before_read"] + measured[w]["before_ranges"] for w in ws],
        marker="o",
        label="before, DCP: + txckpt-dcp-ranges.json",
    )
    read.plot(
        ws, [measured[w]["read"] for w in ws], marker="o", label="parts: manifest + own part (its ranges) + proof"
    )
    read.set(
        xscale="log",
        yscale="log",
        xlabel="world size W (simulated ranks)",
        ylabel="bytes",
        title="A loading rank's metadata read against W",
    )
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
