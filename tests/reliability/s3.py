"""The moto S3 server for the campaign, in a process of its own.

The server is emulators/s3.py's :class:`~emulators.s3.S3Server` (moto's ThreadedMotoServer on
127.0.0.1 behind the middleware that makes conditional writes atomic, as S3 does). It runs in a
separate process so that the campaign's processes, which fork for every crash point, never fork
while moto's server threads hold a lock. ``python -m tests.reliability.s3`` is that process: it
prints the endpoint URL and serves until its stdin closes.

Both the library the campaign imports (``ServerProcess``) and that process's entry point; it stays with
the campaign, its main role (tests/test_architecture.py lists it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from .core import REPO


def fake_env() -> dict[str, str]:
    from emulators.s3 import FAKE_ENV

    return dict(FAKE_ENV)


def apply_fake_env() -> None:
    os.environ.update(fake_env())
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)


class ServerProcess:
    def __init__(self) -> None:
        env = dict(os.environ, **fake_env())
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.s3"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http://127.0.0.1:"):
            self.stop()
            raise RuntimeError(f"the moto server did not start: {line!r}")
        self.endpoint = line

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def storage_options(endpoint: str) -> dict[str, Any]:
    env = fake_env()
    return {
        "key": env["AWS_ACCESS_KEY_ID"],
        "secret": env["AWS_SECRET_ACCESS_KEY"],
        "token": env["AWS_SESSION_TOKEN"],
        "client_kwargs": {"endpoint_url": endpoint, "region_name": env["AWS_DEFAULT_REGION"]},
        # s3fs caches one filesystem per process for these options (fsspec drops its instance
        # cache in a forked child): creating a client parses botocore's S3 model, ~0.1 s each.
    }


def client(endpoint: str):
    import boto3

    env = fake_env()
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        aws_session_token=env["AWS_SESSION_TOKEN"],
    )


def keys(c: Any, bucket: str, prefix: str) -> list[str]:
    out = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = c.list_objects_v2(**kwargs)
        out += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return out
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


def copy_prefix(c: Any, bucket: str, src: str, dst: str) -> int:
    """Server-side copy of every object under ``src/`` to ``dst/`` (a fresh root per crash point)."""
    n = 0
    for k in keys(c, bucket, src.rstrip("/") + "/"):
        c.copy_object(
            Bucket=bucket,
            Key=dst.rstrip("/") + "/" + k[len(src.rstrip("/")) + 1 :],
            CopySource={"Bucket": bucket, "Key": k},
        )
        n += 1
    return n


def incomplete_uploads(c: Any, bucket: str, prefix: str) -> list[dict]:
    return c.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) or []


def main() -> None:
    from emulators.s3 import running_s3_server

    with running_s3_server() as server:
        print(server.endpoint_url, flush=True)
        sys.stdin.read()  # until the campaign closes our stdin


if __name__ == "__main__":
    main()
