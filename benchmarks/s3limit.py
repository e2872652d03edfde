"""The limit of a save to S3 (moto on loopback) in the same run: the very bytes txckpt writes,
uploaded as parallel ``UploadPart``s with boto3, at the best part size and concurrency found by
a sweep (8, 16, 64 MiB parts x 4, 8, 16 in flight), one pool for the parts of every file.

Nothing serialises or hashes on this side, and every part goes out as soon as a thread is free:
it is what the server (and this machine's loopback, botocore's signing and HTTP) allows, not
what s3fs's ``pipe_file`` defaults happen to do."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from . import harness as h

PART_SIZES = (8, 16, 64)
CONCURRENCY = (4, 8, 16)


def client(server: Any, pool: int) -> Any:
    """A boto3 client of the test server with a connection pool for ``pool`` requests at once
    (botocore's default of 10 would cap the concurrency being measured)."""
    import boto3
    from botocore.config import Config

    from emulators.s3 import FAKE_ENV, REGION

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=REGION,
        aws_access_key_id=FAKE_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=FAKE_ENV["AWS_SESSION_TOKEN"],
        config=Config(max_pool_connections=pool, retries={"max_attempts": 1}),
    )


def upload_parts(c: Any, bucket: str, prefix: str, blobs: dict[str, bytes], part: int, in_flight: int) -> None:
    """Every blob as a multipart upload of ``part``-byte parts, all parts of all blobs through one
    pool of ``in_flight`` threads; each upload completed once its parts are in."""
    uploads = {name: c.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{name}")["UploadId"] for name in blobs}
    views = {name: memoryview(data) for name, data in blobs.items()}

    def put(name: str, number: int, off: int) -> tuple[str, dict[str, Any]]:
        body = views[name][off : off + part].tobytes()
        r = c.upload_part(Bucket=bucket, Key=f"{prefix}/{name}", UploadId=uploads[name], PartNumber=number, Body=body)
        return name, {"PartNumber": number, "ETag": r["ETag"]}

    jobs = [
        (name, i + 1, off) for name, data in blobs.items() for i, off in enumerate(range(0, max(len(data), 1), part))
    ]
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in blobs}
    with ThreadPoolExecutor(in_flight) as ex:
        for name, p in ex.map(lambda j: put(*j), jobs):
            parts[name].append(p)
    for name, ps in parts.items():
        c.complete_multipart_upload(
            Bucket=bucket,
            Key=f"{prefix}/{name}",
            UploadId=uploads[name],
            MultipartUpload={"Parts": sorted(ps, key=lambda p: p["PartNumber"])},
        )


def setting_name(part_mib: int, in_flight: int) -> str:
    return f"parallel UploadPart, {part_mib} MiB parts x {in_flight}"


def sweep(
    server: Any, bucket: str, blobs: dict[str, bytes], reps: int, delete_prefix: Callable[[Any, str], None]
) -> tuple[tuple[int, int], dict[str, float]]:
    """Every (part MiB, in flight) setting ``reps`` times, interleaved; returns the fastest
    setting and each one's median time."""
    c = client(server, max(CONCURRENCY))
    settings = [(p, n) for p in PART_SIZES for n in CONCURRENCY]

    def method(p: int, n: int) -> h.Method:
        def setup():
            return f"limit-{uuid.uuid4().hex[:10]}"

        return h.Method(
            setting_name(p, n),
            lambda prefix: upload_parts(c, bucket, prefix, blobs, p * h.MiB, n),
            setup,
            lambda prefix: delete_prefix(c, prefix + "/"),
            settle=False,
        )

    times = h.interleave([method(p, n) for p, n in settings], reps, warmup=0)
    medians = {k: h.median(v) for k, v in times.items()}
    best = min(settings, key=lambda s: medians[setting_name(*s)])
    return best, medians
