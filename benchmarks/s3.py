"""txckpt on S3 (moto on 127.0.0.1): bytes uploaded per save, save throughput against s3fs
``pipe_file`` of the same bytes, a multipart part size x concurrency sweep, and the number of
requests of a lookup on roots of 10 and of 10,000 commits.

Everything talks to a real moto server over HTTP (``emulators/s3.py``: ``S3Server``, whose WSGI
middleware counts every request and uploaded byte on the server side). Nothing is mocked.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from . import harness as h
from .state import files_of, make_state

TITLE = "S3"
BUCKET = "txckpt-bench"
#: txckpt's save must reach at least this fraction of pipe_file's throughput: time ratio <= 1/0.9.
THROUGHPUT_GOAL = 0.9
#: Lookup on S3 (docs/protocol.md §6): 4 requests whatever the size of the root.
LOOKUP_GOAL = 4

TX = "txckpt.save_checkpoint"
PIPE = "s3fs pipe_file"
PIPE_MP = "s3fs pipe_file, txckpt's part size and concurrency"
LIMIT = "parallel UploadParts, the sweep's best (the limit)"

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _server_module():
    if _HERE not in sys.path:  # emulators/ lives next to benchmarks/
        sys.path.insert(0, _HERE)
    from emulators import s3

    return s3


def _sizes() -> list[int]:
    s = h.settings()
    if s.tiny:
        return [4 * h.MiB]
    if s.quick:
        return [64 * h.MiB]
    return [64 * h.MiB, 256 * h.MiB]


def _reps(size: int) -> int:
    s = h.settings()
    if s.tiny:
        return 2
    if s.quick:
        return 4
    return 7 if size <= 64 * h.MiB else 5


def _defaults() -> tuple[int, int]:
    """txckpt's S3 part size and parts in flight, as ``S3Storage`` applies them."""
    from txckpt._storage.s3 import store as fst

    return max(fst.S3_PART_SIZE, 5 * h.MiB), fst.S3_MAX_IN_FLIGHT


# ----- what reached the server ---------------------------------------------------------------


class _Recorder:
    """A WSGI wrapper inside the test server's counting middleware, around the moto app: one event
    per request (start, end, CPU time moto spent on it in its handler thread, operation, key,
    body bytes). ``RequestCounter`` gives totals; this gives the per-key bytes and the timeline."""

    def __init__(self, app, classify: Callable[[dict], str]):
        self.app = app
        self.classify = classify
        self.lock = threading.Lock()
        self.events: list[tuple[float, float, float, str, str, int]] = []

    @staticmethod
    def _length(environ) -> int:
        for name in ("HTTP_X_AMZ_DECODED_CONTENT_LENGTH", "CONTENT_LENGTH"):
            try:
                return int(environ.get(name) or "")
            except ValueError:
                continue
        return 0

    def __call__(self, environ, start_response):
        op = self.classify(environ)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.app(environ, start_response)  # moto builds the whole response in the call
        finally:
            ev = (
                t0,
                time.perf_counter(),
                time.thread_time() - c0,
                op,
                environ.get("PATH_INFO", ""),
                self._length(environ) if op in ("PutObject", "UploadPart") else 0,
            )
            with self.lock:
                self.events.append(ev)

    def mark(self) -> int:
        with self.lock:
            return len(self.events)

    def since(self, mark: int) -> list[tuple[float, float, float, str, str, int]]:
        with self.lock:
            return list(self.events[mark:])

    def clear(self) -> None:
        with self.lock:
            self.events.clear()


def _delete_prefix(client, prefix: str) -> None:
    token = None
    while True:
        kw: dict[str, Any] = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        page = client.list_objects_v2(**kw)
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
        if not page.get("IsTruncated"):
            break
        token = page["NextContinuationToken"]
    for up in client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []):
        client.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])


def _fmt_ops(ops: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


def _mibs(nbytes: int, seconds: float) -> str:
    return f"{nbytes / h.MiB / seconds:.1f} MiB/s" if seconds and seconds == seconds else "–"


class _Tuning:
    """txckpt's part size and parts in flight for roots opened inside the block (``S3Storage``
    reads the module constants when a root opens its storage; the env variables
    ``TXCKPT_S3_PART_SIZE`` / ``TXCKPT_S3_MAX_IN_FLIGHT`` set the same constants at import)."""

    def __init__(self, part_size: int | None, in_flight: int | None):
        self.part_size, self.in_flight = part_size, in_flight

    def __enter__(self):
        from txckpt._storage.s3 import store as fst

        self.saved = fst.S3_PART_SIZE, fst.S3_MAX_IN_FLIGHT
        if self.part_size:
            fst.S3_PART_SIZE = self.part_size
        if self.in_flight:
            fst.S3_MAX_IN_FLIGHT = self.in_flight
        return self

    def __exit__(self, *exc):
        from txckpt._storage.s3 import store as fst

        fst.S3_PART_SIZE, fst.S3_MAX_IN_FLIGHT = self.saved


# ----- the save ------------------------------------------------------------------------------------


class _SaveBench:
    """Methods for harness.interleave; each timed call leaves a record of what the server saw."""

    def __init__(self, server, rec: _Recorder):
        import s3fs

        self.server = server
        self.rec = rec
        self.client = server.boto3_client()
        self.opts = server.storage_options()
        self.fs = s3fs.S3FileSystem(**self.opts)  # the pipe_file side: one client for every round
        self.fs.ls(BUCKET)  # its session and connection pool exist before the first timed round
        self.log: list[dict[str, Any]] = []

    def _measure(self, name: str, fn: Callable[[], Any], ctx: dict[str, Any]) -> None:
        counter = self.server.counter()
        mark = self.rec.mark()
        cpu0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        ctx["record"] = {
            "method": name,
            "t0": t0,
            "wall": wall,
            "cpu": cpu,
            "ops": counter.ops,
            "uploaded": counter.uploaded_bytes,
            "events": self.rec.since(mark),
            "prefix": ctx["prefix"],
        }

    def txckpt_method(
        self, name: str, files: dict[str, Any], part_size: int | None = None, in_flight: int | None = None
    ) -> h.Method:
        import txckpt

        def setup():
            prefix = f"save-{uuid.uuid4().hex[:10]}"
            url = f"s3://{BUCKET}/{prefix}"
            txckpt.forget_roots()
            with _Tuning(part_size, in_flight):
                root = txckpt.open_root(url, self.opts)  # the storage (and its tuning) is made here
            root.new_lineage()  # what a run's first save does; a steady-state save finds the lineage
            return {"prefix": prefix, "url": url}

        def run(ctx):
            def save():
                ctx["path"] = txckpt.save_checkpoint(ctx["url"], 1, files, storage_options=self.opts)

            self._measure(name, save, ctx)

        return h.Method(name, run, setup, self._cleanup, settle=False)

    def pipe_method(
        self, name: str, blobs: dict[str, bytes], chunksize: int | None = None, concurrency: int | None = None
    ) -> h.Method:
        kwargs: dict[str, Any] = {}
        if chunksize:
            kwargs["chunksize"] = chunksize
        if concurrency:
            kwargs["max_concurrency"] = concurrency

        def setup():
            return {"prefix": f"raw-{uuid.uuid4().hex[:10]}"}

        def run(ctx):
            def put():
                for fname, data in blobs.items():
                    self.fs.pipe_file(f"{BUCKET}/{ctx['prefix']}/{fname}", data, **kwargs)

            self._measure(name, put, ctx)

        return h.Method(name, run, setup, self._cleanup, settle=False)

    def limit_method(self, name: str, blobs: dict[str, bytes], part: int, in_flight: int) -> h.Method:
        from . import s3limit

        c = s3limit.client(self.server, in_flight)

        def run(ctx):
            self._measure(name, lambda: s3limit.upload_parts(c, BUCKET, ctx["prefix"], blobs, part, in_flight), ctx)

        return h.Method(name, run, lambda: {"prefix": f"limit-{uuid.uuid4().hex[:10]}"}, self._cleanup, settle=False)

    def _cleanup(self, ctx: dict[str, Any]) -> None:
        import txckpt

        if "record" in ctx:
            self.log.append(ctx["record"])
        _delete_prefix(self.client, ctx["prefix"] + "/")
        txckpt.forget_roots()
        self.rec.clear()

    def records(self, name: str, last: int) -> list[dict[str, Any]]:
        return [r for r in self.log if r["method"] == name][-last:]


def _reference_files(files: dict[str, Any]) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The bytes txckpt writes for ``files`` (one local save, durable=False), and its manifest."""
    import txckpt
    from txckpt import CheckpointRoot

    d = h.fresh_dir("s3-ref")
    try:
        path = CheckpointRoot(d, durable=False).save(1, files)
        manifest = txckpt.read_manifest(path)
        blobs = {}
        for name in manifest.files:
            with open(os.path.join(path, name), "rb") as f:
                blobs[name] = f.read()
        return blobs, dict(manifest.files)
    finally:
        h.remove(d)


def _kind(path: str, prefix: str, data_names: set[str]) -> str:
    """What an object of a save is, from its request path ``/bucket/prefix/...``."""
    key = path.split(f"/{BUCKET}/", 1)[-1]
    rel = key[len(prefix) + 1 :] if key.startswith(prefix + "/") else key
    name = rel.rsplit("/", 1)[-1]
    if name in data_names and (rel.startswith(".txckpt/tx/") or rel == name):
        return "data"
    if name == "txckpt-manifest.json":
        return "manifest"
    if rel.startswith(".txckpt/log/"):
        return "log entry"
    if rel == ".txckpt/latest":
        return "latest hint"
    if rel.startswith(".txckpt/intents/"):
        return "intent"
    return "other"


def _uploaded_by_kind(record: dict[str, Any], names: set[str]) -> Counter:
    out: Counter = Counter()
    for _t0, _t1, _cpu, _op, path, nbytes in record["events"]:
        if nbytes:
            out[_kind(path, record["prefix"], names)] += nbytes
    return out


def _bytes_rows(size: int, recs: list[dict[str, Any]], manifest_files: dict[str, Any]) -> list[dict[str, Any]]:
    ckpt = sum(e.size for e in manifest_files.values())
    names = set(manifest_files)
    kinds = [_uploaded_by_kind(r, names) for r in recs]
    datas = sorted({k["data"] for k in kinds})
    totals = sorted({r["uploaded"] for r in recs})
    copies = sum(r["ops"].get("CopyObject", 0) + r["ops"].get("UploadPartCopy", 0) for r in recs)
    ops = recs[0]["ops"]
    data_ops = Counter(
        {
            k: v
            for k, v in ops.items()
            if k in ("PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload")
        }
    )
    files_desc = ", ".join(f"`{n}` {e.size:,}" for n, e in sorted(manifest_files.items()))
    same = "the same in every save" if len(datas) == 1 else f"varied between saves: {datas}"
    added = kinds[0]
    return [
        {
            "case": "data files: bytes uploaded ÷ checkpoint bytes",
            "size": size,
            "uploaded": f"{datas[-1]:,}",
            "expected": f"{ckpt:,}",
            "ratio": datas[-1] / ckpt,
            "goal": 1.0,
            "reps": len(recs),
            "ops": _fmt_ops(data_ops) + " (all requests, data and small files)",
            "note": f"checkpoint bytes: the manifest's file sizes ({files_desc}); {same}",
        },
        {
            "case": "server-side copies (CopyObject + UploadPartCopy), all saves",
            "size": size,
            "uploaded": "–",
            "expected": "–",
            "ratio": copies,
            "goal": 0.0,
            "reps": len(recs),
            "ops": _fmt_ops(ops),
            "note": "every request of one save, by operation: nothing is renamed or copied",
        },
        {
            "case": "whole save: bytes uploaded ÷ checkpoint bytes (report)",
            "size": size,
            "uploaded": f"{totals[-1]:,}",
            "expected": f"{ckpt:,}",
            "ratio": totals[-1] / ckpt,
            "goal": None,
            "reps": len(recs),
            "note": "txckpt's small files on top: "
            + ", ".join(
                f"{k} {added[k]:,} B"
                for k in ("manifest", "log entry", "latest hint", "intent", "other")
                if k != "other" or added.get(k)
            )
            + " (the intent is deleted at the commit; ids and clock "
            "digits make these vary by a few bytes between saves)",
        },
    ]


def _breakdown(recs: list[dict[str, Any]], names: set[str], nbytes: int) -> dict[str, float]:
    """Medians over rounds: wall, process CPU, moto's CPU on data requests, on
    CompleteMultipartUpload and on the small-file (protocol) requests, all per MiB of data; and
    the wall time before the first data request reached the server and after the last one."""
    mib = nbytes / h.MiB
    rows = []
    for r in recs:
        data = complete = proto = 0.0
        proto_wall = 0.0
        n_proto = 0
        first, last = float("inf"), 0.0  # the data files' first request in, last answer out
        for t0, t1, cpu, op, path, _n in r["events"]:
            kind = _kind(path, r["prefix"], names)
            if kind == "data":
                first, last = min(first, t0), max(last, t1)
            if op == "CompleteMultipartUpload":
                complete += cpu
            elif kind == "data":
                data += cpu
            else:
                proto += cpu
                proto_wall += t1 - t0
                n_proto += 1
        moto = data + complete + proto
        rows.append(
            {
                "wall": r["wall"],
                "cpu": r["cpu"] * 1e3 / mib,
                "data": data * 1e3 / mib,
                "complete": complete * 1e3 / mib,
                "proto": proto * 1e3 / mib,
                "client": (r["cpu"] - moto) * 1e3 / mib,
                "n_proto": n_proto,
                "proto_wall": proto_wall,
                "before": first - r["t0"],
                "after": r["t0"] + r["wall"] - last,
            }
        )
    return {k: h.median([x[k] for x in rows]) for k in rows[0]}


def _timeline(label: str, rec: dict[str, Any], names: set[str]) -> str:
    lines = [
        f"Request timeline: {label}, {rec['wall']:.3f} s (server side: when moto's app got the "
        "request and when it returned, ms from the start of the call, and moto's CPU time in it)",
        "",
        "| start | end | moto CPU | request | object |",
        "|---:|---:|---:|---|---|",
    ]
    for t0, t1, cpu, op, path, nbytes in sorted(rec["events"]):
        key = path.split(f"/{BUCKET}/", 1)[-1]
        key = key[len(rec["prefix"]) + 1 :] if key.startswith(rec["prefix"] + "/") else key
        if "/.txckpt/tx/" in "/" + key:
            key = ".txckpt/tx/<txid>/" + key.split("/", 3)[-1]
        size = f" ({h.fmt_size(nbytes)})" if nbytes else ""
        lines.append(
            f"| {1e3 * (t0 - rec['t0']):.0f} | {1e3 * (t1 - rec['t0']):.0f} | {1e3 * cpu:.0f} ms | "
            f"{op}{size} | `{key}` |"
        )
    return "\n".join(lines)


def _save_tables(server, rec: _Recorder) -> tuple[dict[str, Any], dict[str, Any]]:
    bench = _SaveBench(server, rec)
    part, in_flight = _defaults()
    bytes_rows: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    cpu_lines: list[str] = []
    profiles: list[str] = []
    findings: list[str] = []
    limit_sweeps: list[str] = []
    sizes = _sizes()
    for i, size in enumerate(sizes):
        reps = _reps(size)
        h.log(f"s3: save {h.fmt_size(size)}, {reps} rounds (txckpt, pipe_file, pipe_file in parts)")
        weights, optim = make_state(size)
        files = files_of(weights, optim)
        blobs, mfiles = _reference_files(files)
        names = set(mfiles)
        nbytes = sum(len(b) for b in blobs.values())
        from . import s3limit

        h.log(f"s3: {h.fmt_size(size)}, sweeping the parallel-UploadPart limit")
        sweep_reps = 1 if h.settings().quick else 2
        (best_part, best_n), sweep_medians = s3limit.sweep(server, BUCKET, blobs, sweep_reps, _delete_prefix)
        limit_sweeps.append(
            f"{h.fmt_size(size)}: "
            + "; ".join(
                f"{k.split(', ', 1)[1]} {_mibs(nbytes, v)}"
                for k, v in sorted(sweep_medians.items(), key=lambda kv: kv[1])
            )
        )
        methods = [
            bench.txckpt_method(TX, files),
            bench.pipe_method(PIPE, blobs),
            bench.pipe_method(PIPE_MP, blobs, part, in_flight),
            bench.limit_method(LIMIT, blobs, best_part * h.MiB, best_n),
        ]
        # Both sides' clients are warm before their timed call (txckpt's: from the untimed
        # new_lineage; pipe_file's: above); full mode still discards one whole round first.
        times = h.interleave(methods, reps, warmup=1 if i == 0 and not h.settings().quick else 0)
        recs = {m.name: bench.records(m.name, reps) for m in methods}
        bytes_rows += _bytes_rows(size, recs[TX], mfiles)
        for other, goal, label in (
            (PIPE, round(1 / THROUGHPUT_GOAL, 4), "txckpt.save_checkpoint ÷ s3fs pipe_file (time)"),
            (
                PIPE_MP,
                None,
                f"txckpt.save_checkpoint ÷ pipe_file in {part // h.MiB} MiB parts × {in_flight} (time, report)",
            ),
            (
                LIMIT,
                None,
                f"txckpt.save_checkpoint ÷ parallel UploadParts, {best_part} MiB parts × {best_n} "
                "(the limit; time, report)",
            ),
        ):
            row = h.compare(label, size, times, TX, other, goal)
            row.update(
                {
                    "tx_tput": _mibs(nbytes, h.median(times[TX])),
                    "other_tput": _mibs(nbytes, h.median(times[other])),
                    "tput_ratio": f"{1 / row['ratio']:.2f}" if row["ratio"] == row["ratio"] else "n/a",
                    "note": f"requests per save: txckpt {sum(recs[TX][0]['ops'].values())}, "
                    f"the other {sum(recs[other][0]['ops'].values())} ({_fmt_ops(recs[other][0]['ops'])})",
                }
            )
            if other == LIMIT:
                row["note"] = (
                    "the same bytes as multipart uploads, all parts of both files through one "
                    "pool of boto3 threads, at the fastest setting of the sweep below the "
                    "table (nothing serialised or hashed); " + row["note"]
                )
            if other == PIPE_MP:
                row["note"] = (
                    f"the same part size and concurrency on both sides (s3fs still sends a file "
                    f"below two parts, {2 * part // h.MiB} MiB, as one `PutObject`): what is "
                    "left is mostly txckpt's own cost (serialising, hashing, its small "
                    "files); " + row["note"]
                )
            rows.append(row)
        bd = {name: _breakdown(recs[name], names, nbytes) for name in (TX, PIPE, PIPE_MP)}
        tx_b, pipe_b = bd[TX], bd[PIPE]
        findings.append(
            f"{h.fmt_size(size)}: txckpt {tx_b['wall']:.2f} s, pipe_file {pipe_b['wall']:.2f} s (medians); "
            f"txckpt spends {1e3 * (tx_b['before'] + tx_b['after']):.0f} ms outside the data upload "
            f"(pipe_file {1e3 * (pipe_b['before'] + pipe_b['after']):.0f} ms), and moto's "
            f"`CompleteMultipartUpload` costs {tx_b['complete'] * nbytes / h.MiB:.0f} ms of CPU on "
            f"txckpt's side (pipe_file's {pipe_b['complete'] * nbytes / h.MiB:.0f} ms); the client's CPU is "
            f"{tx_b['client']:.1f} against {pipe_b['client']:.1f} ms per MiB (serialising and hashing on "
            "txckpt's side)."
        )
        for name, b in bd.items():
            cpu_lines.append(
                f"| {h.fmt_size(size)} | {name} | {b['wall']:.2f} s | {b['cpu']:.1f} | {b['data']:.1f} | "
                f"{b['complete']:.1f} | {b['proto']:.1f} ({b['n_proto']:.0f} requests, "
                f"{1e3 * b['proto_wall']:.0f} ms in moto) | {b['client']:.1f} | "
                f"{1e3 * b['before']:.0f} ms + {1e3 * b['after']:.0f} ms |"
            )
        if i == len(sizes) - 1:
            for name in (TX, PIPE):
                mid = sorted(recs[name], key=lambda r: r["wall"])[len(recs[name]) // 2]
                profiles.append(_timeline(f"the median `{name}` round at {h.fmt_size(size)}", mid, names))
        del weights, optim, files, blobs
    notes = [
        "The limit (`benchmarks/s3limit.py`): before each size's rounds, every setting of 8, 16 or 64 "
        "MiB parts × 4, 8 or 16 in flight uploads the very bytes txckpt writes as parallel "
        "`UploadPart`s with boto3 (one pool for the parts of both files, a connection pool as large "
        "as the concurrency), interleaved; the fastest setting then runs in every timed round. "
        "Sweep medians: " + " — ".join(limit_sweeps),
        "Where the time goes (medians over the timed rounds, milliseconds of CPU per MiB of data files; "
        'the process runs both the client and moto, so "CPU" is both; the moto columns are CPU '
        "time inside moto's app, split into data requests (`PutObject`/`UploadPart` of the data "
        'files), `CompleteMultipartUpload`, and every other request; "client" is the rest: '
        "serialising, hashing, botocore's payload signing over plain HTTP, HTTP on both sides; the "
        "last column is wall time outside the data upload: before the first request of a data file "
        "reached the server (txckpt: reading the log, the intent, serialising the first parts; both: "
        "signing the first body), and after the last one returned (txckpt: the commit)):\n\n"
        "| size | method | wall | CPU | moto: data | moto: complete | moto: other requests | client "
        "| before + after the data |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(cpu_lines),
        "What the numbers say: moto's `CompleteMultipartUpload` re-reads every part and concatenates "
        "them into a new object (`FakeMultipart.complete` in moto/s3/models.py), so on moto an "
        "object uploaded in parts costs the server its bytes twice, while below 100 MiB "
        "`pipe_file` sends each file as one `PutObject`. Real S3 assembles the parts on its own "
        "machines, where it does not compete with the client for CPU. The report row with "
        "`pipe_file` in txckpt's part size and concurrency compares (nearly) equal request shapes. "
        "txckpt's own additions per save are its small-file requests (the intent before the "
        "data; after it the listing that checks the staged files, the manifest, the log entry, "
        "then at once the hint and the intent's delete; a session "
        "that holds its lineage reads no log before the commit, docs/protocol.md §8) and "
        "serialising the state (hashing it, and copying it once into the request body), which "
        "`pipe_file` gets done beforehand. A "
        "file's upload runs in the background while the next file is serialised "
        "(`S3Storage.write_batch`, at most `TXCKPT_S3_PENDING_FILES`, 2, files pending; the save "
        "waits for all of them before it checks the staging and writes the manifest), so the "
        "first file's serialisation and the last file's upload are what it does not overlap. "
        "In this run: " + " ".join(findings),
    ]
    common = (
        "moto's `ThreadedMotoServer` on 127.0.0.1 in the benchmark's own process "
        "(`emulators/s3.py`), plain HTTP, answering with TCP_NODELAY as real S3 endpoints do "
        "(werkzeug's default Nagle made every small PUT wait ~10 ms, docs/remote.md); every "
        "request and uploaded byte is counted on the server side. State: the synthetic training "
        "state of the save benchmarks "
        f"({', '.join(h.fmt_size(x) for x in sizes)}: `model.safetensors` + `optimizer.pt`). "
        "txckpt: `txckpt.save_checkpoint(url, 1, files)` into a fresh root per round whose "
        "lineage exists (created untimed by the same process, as after a run's first save, so "
        "the save plans against that state: docs/protocol.md §8), default tuning "
        f"({part // h.MiB} MiB parts, {in_flight} in flight: `TXCKPT_S3_PART_SIZE`, "
        "`TXCKPT_S3_MAX_IN_FLIGHT`). The other side: s3fs `pipe_file` of the very bytes txckpt "
        "writes for the same files (serialised beforehand, untimed), one file after the other, "
        "to fresh keys, with s3fs's defaults (one `PutObject` below 100 MiB, else 50 MiB parts, "
        "up to 10 at a time); a third method, report only, runs `pipe_file` with txckpt's part size "
        "and concurrency. Methods interleaved, the order rotated every round; every object "
        "deleted (untimed) after each round."
    )
    bytes_table = {
        "id": "s3-bytes",
        "title": "S3: bytes uploaded per save",
        "rows": bytes_rows,
        "about": common + " Bytes are the bodies of `PutObject` and `UploadPart` requests as the "
        "server received them, attributed per key (data files, manifest, log "
        "entry, hint, intent).",
        "columns": [
            ["case", "comparison"],
            ["size", "state"],
            ["uploaded", "bytes uploaded"],
            ["expected", "checkpoint bytes"],
            ["ratio", "ratio"],
            ["goal", "goal"],
            ["verdict", "met?"],
            ["ops", "requests of one save"],
            ["reps", "saves"],
            ["note", "note"],
        ],
    }
    save_table = {
        "id": "s3-save",
        "title": "S3: save throughput against pipe_file",
        "rows": rows,
        "columns": _TPUT_COLUMNS,
        "about": common + f" Goal: txckpt's throughput at least {THROUGHPUT_GOAL} × pipe_file's, i.e. "
        "the time ratio (txckpt ÷ pipe_file, the `ratio` of every table here) "
        f"≤ 1/{THROUGHPUT_GOAL} ≈ {1 / THROUGHPUT_GOAL:.2f}; the throughput ratio "
        "column is its inverse. txckpt's side includes serialising and hashing "
        "the state; pipe_file's starts from the finished bytes.",
        "notes": notes,
        "profiles": profiles,
    }
    return bytes_table, save_table


_TPUT_COLUMNS = [
    ["case", "comparison"],
    ["size", "state"],
    ["txckpt", "txckpt (median)"],
    ["other", "other (median)"],
    ["tx_tput", "txckpt throughput"],
    ["other_tput", "other throughput"],
    ["tput_ratio", "throughput ratio"],
    ["ratio", "time ratio"],
    ["ratio_of_medians", "median ÷ median"],
    ["paired", "per-round range"],
    ["goal", "goal (time ratio)"],
    ["verdict", "met?"],
    ["reps", "rounds"],
    ["note", "note"],
]


def _sweep_table(server, rec: _Recorder) -> dict[str, Any]:
    title = "S3: multipart part size × parts in flight"
    s = h.settings()
    if s.quick:
        return {
            "id": "s3-sweep",
            "title": title,
            "status": "skipped",
            "rows": [],
            "reason": "full mode only (the quick run measures the defaults, in the table above)",
        }
    bench = _SaveBench(server, rec)
    default = _defaults()
    points = [(8, 4), (16, 2), (16, 4), (16, 8), (32, 4), (64, 2)]
    reps = 3
    rows: list[dict[str, Any]] = []
    best_notes = []
    for size in _sizes():
        h.log(f"s3: sweep at {h.fmt_size(size)}: {len(points)} settings + pipe_file, {reps} rounds")
        weights, optim = make_state(size)
        files = files_of(weights, optim)
        blobs, _ = _reference_files(files)
        nbytes = sum(len(b) for b in blobs.values())
        names = {
            p: f"{p[0]} MiB parts × {p[1]}" + (" (default)" if (p[0] * h.MiB, p[1]) == default else "") for p in points
        }
        methods = [bench.txckpt_method(names[p], files, p[0] * h.MiB, p[1]) for p in points]
        methods.append(bench.pipe_method(PIPE, blobs))
        times = h.interleave(methods, reps, warmup=0)
        for p in points:
            row = h.compare(f"txckpt, {names[p]} ÷ pipe_file (time)", size, times, names[p], PIPE, None)
            recs = bench.records(names[p], reps)
            row.update(
                {
                    "tx_tput": _mibs(nbytes, h.median(times[names[p]])),
                    "other_tput": _mibs(nbytes, h.median(times[PIPE])),
                    "tput_ratio": f"{1 / row['ratio']:.2f}",
                    "note": f"{sum(recs[0]['ops'].values())} requests per save; at most "
                    f"{h.fmt_size(p[0] * h.MiB * (p[1] + 1))} buffered per file",
                }
            )
            rows.append(row)
        best = min(points, key=lambda p: h.median(times[names[p]]))
        best_notes.append(f"{h.fmt_size(size)}: {names[best]} ({_mibs(nbytes, h.median(times[names[best]]))})")
        del weights, optim, files, blobs
    return {
        "id": "s3-sweep",
        "title": title,
        "rows": rows,
        "columns": _TPUT_COLUMNS,
        "about": (
            "`txckpt.save_checkpoint` of each state with `S3Storage`'s part size "
            "(`TXCKPT_S3_PART_SIZE`) and parts in flight (`TXCKPT_S3_MAX_IN_FLIGHT`, capped by "
            "s3fs's `max_concurrency`, 10) set per root, against `pipe_file` (s3fs defaults) "
            f"as the reference; all {len(points) + 1} methods interleaved, {reps} rounds each, "
            "same setup as the throughput table. Report only: a writer buffers at most "
            "part size × (in flight + 1) per file, and what is fastest against moto (CPU-bound, "
            "in-process, where a multipart object costs the server its bytes twice) need not "
            "be fastest against S3."
        ),
        "notes": [
            "Fastest in this run: " + "; ".join(best_notes) + ". Differences within the per-round "
            "ranges are noise on this machine."
        ],
    }


# ----- lookup ----------------------------------------------------------------------------------


def _local_root(commits: int, lineages: int) -> tuple[str, dict[str, Any]]:
    """The lookup case's cached root (built through the real API, durable=False), rebuilt if the
    cached copy no longer reads (written by an older version of the log format, say)."""
    import txckpt

    from . import lookup

    try:
        base, stamp = lookup._cached_root(commits, lineages)
        txckpt.forget_roots()
        if txckpt.get_last_checkpoint(base):
            return base, stamp
        reason = "no checkpoint"
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"
    h.log(f"s3: the cached {commits:,}-commit root does not read ({reason}); rebuilding it")
    base = os.path.join(h.settings().cache, f"lookup-root-{commits}x{lineages}")
    shutil.rmtree(base, ignore_errors=True)
    try:
        os.remove(base + ".json")
    except FileNotFoundError:
        pass
    return lookup._cached_root(commits, lineages)


def _upload_plan(local: str, prefix: str) -> list[tuple[str, str]]:
    """Every file of a local root, keyed where an object-store root keeps it: a published
    ``checkpoint-N/`` goes to its home ``.txckpt/tx/<txid>/checkpoint-N/`` (on object stores a
    checkpoint's path is its home, docs/protocol.md §2, §7); everything else as it is."""
    plan = []
    for dirpath, _dirs, names in os.walk(local):
        for name in names:
            path = os.path.join(dirpath, name)
            parts = os.path.relpath(path, local).split(os.sep)
            if parts[0].startswith("checkpoint-"):
                with open(os.path.join(local, parts[0], "txckpt-manifest.json")) as f:
                    txid = json.load(f)["txid"]
                parts = [".txckpt", "tx", txid] + parts
            plan.append((path, f"{prefix}/" + "/".join(parts)))
    return plan


def _upload(server, plan: list[tuple[str, str]], threads: int = 8) -> float:
    """Concurrent ``PutObject``s with the test server's boto3 client (it pools 10 connections)."""
    client = server.boto3_client()

    def put(item: tuple[str, str]) -> None:
        path, key = item
        with open(path, "rb") as f:
            client.put_object(Bucket=BUCKET, Key=key, Body=f.read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        for _ in ex.map(put, plan):
            pass
    return time.perf_counter() - t0


def _build_on_s3(server, prefix: str, commits: int) -> float:
    """A small root built directly on S3, commit by commit, through the real API."""
    import txckpt

    t0 = time.perf_counter()
    root = txckpt.CheckpointRoot(f"s3://{BUCKET}/{prefix}", server.storage_options())
    for step in range(1, commits + 1):
        root.save(step, {"trainer_state.json": {"global_step": step}})
    return time.perf_counter() - t0


def _count_lookups(server, url: str, n: int) -> tuple[list[int], Counter, list[float], str]:
    import txckpt

    totals, times = [], []
    ops: Counter = Counter()
    got = None
    for _ in range(n):
        txckpt.forget_roots()  # no cached root object or state, as a restarted process
        opts = server.storage_options()  # skip_instance_cache: a new s3fs client, empty listing cache
        c = server.counter()
        t0 = time.perf_counter()
        path = txckpt.get_last_checkpoint(url, storage_options=opts)
        times.append(time.perf_counter() - t0)
        totals.append(c.total)
        ops = c.ops
        if got is not None and path != got:
            raise AssertionError(f"lookups of {url} disagree: {path} then {got}")
        got = path
    assert got is not None, f"no checkpoint found at {url}"
    return totals, ops, times, got


def _lookup_row(case: str, totals: list[int], ops: Counter, times: list[float], note: str) -> dict[str, Any]:
    if len(set(totals)) > 1:
        note += f"; counts varied between lookups: {totals}"
    return {
        "case": case,
        "ratio": max(totals),
        "goal": float(LOOKUP_GOAL),
        "reps": len(totals),
        "ops": _fmt_ops(ops),
        "txckpt": h.median(times),
        "note": note,
    }


def _lookup_table(server) -> dict[str, Any]:
    import txckpt

    from . import lookup

    s = h.settings()
    n = 3 if s.quick else 7
    big_commits, big_lineages = lookup._shape()
    small = 10
    rows = []

    h.log(f"s3: lookup, building a {small}-commit root on S3 through the API")
    build_s = _build_on_s3(server, "lookup-native", small)
    totals, ops, times, path = _count_lookups(server, f"s3://{BUCKET}/lookup-native", n)
    if not path.endswith(f"/checkpoint-{small}"):
        raise AssertionError(f"lookup returned {path}, not checkpoint-{small}")
    rows.append(
        _lookup_row(
            f"{small} commits, 1 lineage, built on S3",
            totals,
            ops,
            times,
            f"built commit by commit on S3 in {build_s:.1f} s; returns step {small}",
        )
    )
    _delete_prefix(server.boto3_client(), "lookup-native/")

    for commits, lineages in ((small, 1), (big_commits, big_lineages)):
        if commits == small:
            local = h.fresh_dir("s3-lookup-small")
            stamp = {**lookup.build_root(local, commits, lineages), "cached": False}
        else:
            local, stamp = _local_root(commits, lineages)
        txckpt.forget_roots()
        local_manifest = txckpt.read_manifest(txckpt.get_last_checkpoint(local))
        prefix = f"lookup-{commits}x{lineages}"
        plan = _upload_plan(local, prefix)
        h.log(f"s3: lookup, uploading a {commits:,}-commit root ({len(plan):,} objects)")
        up_s = _upload(server, plan)
        totals, ops, times, path = _count_lookups(server, f"s3://{BUCKET}/{prefix}", n)
        remote = txckpt.verify_checkpoint(path, storage_options=server.storage_options())
        if (remote.step, remote.txid) != (local_manifest.step, local_manifest.txid):
            raise AssertionError(
                f"S3 lookup found step {remote.step} ({remote.txid}), the local root "
                f"step {local_manifest.step} ({local_manifest.txid})"
            )
        built = "reused from the cache" if stamp.get("cached") else f"built in {stamp.get('build_s', 0):.0f} s"
        rows.append(
            _lookup_row(
                f"{commits:,} commits, {lineages} lineage{'s' if lineages > 1 else ''}, built locally, uploaded",
                totals,
                ops,
                times,
                f"local root {built}; {len(plan):,} objects uploaded in {up_s:.0f} s; returns step "
                f"{remote.step} (the same txid as on the local root); `verify_checkpoint` of it on S3 passes",
            )
        )
        if commits == small:
            h.remove(local)
        _delete_prefix(server.boto3_client(), prefix + "/")
    rows.append(
        {
            "case": f"requests with {big_commits:,} commits ÷ with {small} commits",
            "ratio": rows[-1]["ratio"] / rows[0]["ratio"],
            "goal": 1.0,
            "reps": n,
            "note": "the same count: a lookup does not depend on how many commits or lineages the root holds",
        }
    )
    about = (
        "`txckpt.get_last_checkpoint(url)` on an S3 root, requests counted on the server "
        "(`RequestCounter` of `emulators/s3.py`). Before each lookup `txckpt.forget_roots()` and "
        "new `storage_options` with `skip_instance_cache=True`: every lookup runs on a new s3fs "
        f"client with an empty listing cache, as a restarted process would ({n} lookups per root; "
        "the table shows the largest count; every lookup of a root returned the same path). "
        f"How the roots were built: the first, commit by commit on S3 through `CheckpointRoot.save`. "
        "The others through the real API on a local directory (`benchmarks/lookup.py` "
        "`build_root`: `CheckpointRoot.save` of one tiny file per step, durable=False, and "
        "`resume(step=...)` rolling back half a lineage between lineages; the "
        f"{big_commits:,}-commit root is the lookup case's cached one), then every file uploaded "
        "with boto3 (8 concurrent `PutObject`s), keyed as an object-store root keeps it: a published "
        "`checkpoint-N/` goes to its home `.txckpt/tx/<txid>/checkpoint-N/` (on object stores a "
        "checkpoint's path is its home, docs/protocol.md §2 and §7); the log, the `latest` hint and "
        "unpublished homes keep their keys. (Building 10,000 commits request by request through "
        "moto would take far longer.) The 10-commit root built both ways shows that uploading does "
        "not change the count. On S3, `verify_checkpoint` of the checkpoint found passes, and it "
        "is the one (step and txid) that lookup finds on the local root."
    )
    return {
        "id": "s3-lookup",
        "title": "S3: get_last_checkpoint requests",
        "rows": rows,
        "about": about,
        "columns": [
            ["case", "root"],
            ["ratio", "requests"],
            ["goal", "goal"],
            ["verdict", "met?"],
            ["ops", "by operation"],
            ["txckpt", "time (median)"],
            ["reps", "lookups"],
            ["note", "note"],
        ],
    }


# ----- the case --------------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        return {"title": TITLE, "status": "skipped", "reason": f"needs s3fs and moto[server] ({e})", "rows": []}
    s3mod = _server_module()
    logger = logging.getLogger("txckpt")
    level = logger.level
    logger.setLevel(logging.ERROR)  # forks of the lookup roots warn about what they abandon
    try:
        with s3mod.running_s3_server() as server:
            server.create_bucket(BUCKET)
            with server.wrapped(lambda moto_app: _Recorder(moto_app, s3mod.classify)) as rec:
                bytes_table, save_table = _save_tables(server, rec)
                sweep = _sweep_table(server, rec)
                lookup_table = _lookup_table(server)
    finally:
        logger.setLevel(level)
    return {"tables": [bytes_table, save_table, sweep, lookup_table]}
