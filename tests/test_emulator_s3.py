"""The S3 emulator's third fidelity fix (emulators/s3.py): a plain ranged GET is answered from the
range alone, with exactly what moto itself answers (status, headers, bytes), and everything else
still goes to moto. The benchmarks' moto rows and every ranged read in the tests stand on it."""

from __future__ import annotations

import os

import botocore.exceptions
import pytest

from emulators.s3 import BUCKET

pytestmark = pytest.mark.s3
#: Per-request headers that differ between any two answers.
VOLATILE = {"date", "server", "x-amz-request-id", "x-amzn-requestid", "x-amz-id-2"}


def _get(client, key, **kwargs):
    try:
        r = client.get_object(Bucket=BUCKET, Key=key, **kwargs)
    except botocore.exceptions.ClientError as e:
        return e.response["ResponseMetadata"]["HTTPStatusCode"], e.response["Error"]["Code"], b""
    headers = {k: v for k, v in r["ResponseMetadata"]["HTTPHeaders"].items() if k not in VOLATILE}
    return r["ResponseMetadata"]["HTTPStatusCode"], headers, r["Body"].read()


def _both(server, client, key, **kwargs):
    """(the range reader's answer, moto's answer, whether the range reader answered it itself)."""
    ranges = server.ranges
    ranges.enabled, before = True, ranges.answered
    ours = _get(client, key, **kwargs)
    answered = ranges.answered - before
    ranges.enabled = False
    try:
        theirs = _get(client, key, **kwargs)
    finally:
        ranges.enabled = True
    return ours, theirs, answered


def test_ranged_get_equals_moto(s3_server, s3_root):
    client = s3_server.boto3_client()
    data = os.urandom(3 * 2**20 + 5)
    client.put_object(
        Bucket=BUCKET, Key="dir/a b+c.bin", Body=data, ContentType="application/x-test", Metadata={"m": "1"}
    )
    size = len(data)
    etag = client.head_object(Bucket=BUCKET, Key="dir/a b+c.bin")["ETag"]
    for rng, (first, last) in {
        "bytes=0-99": (0, 99),
        "bytes=100-": (100, size - 1),
        "bytes=5-5": (5, 5),
        f"bytes={size - 10}-{size + 999}": (size - 10, size - 1),
    }.items():
        # If-Match of the object's own ETag: what boto3's transfer manager sends with each part.
        extra = {"IfMatch": etag} if first == 5 else {}
        ours, theirs, answered = _both(s3_server, client, "dir/a b+c.bin", Range=rng, **extra)
        assert answered == 1, rng
        assert ours == theirs, rng
        assert ours[0] == 206 and ours[2] == data[first : last + 1], rng
        assert ours[1]["content-range"] == f"bytes {first}-{last}/{size}", rng


@pytest.mark.parametrize(
    "case", ["past the end", "suffix", "two ranges", "conditional", "if-match another etag", "missing key", "version"]
)
def test_other_reads_go_to_moto(s3_server, s3_root, case):
    client = s3_server.boto3_client()
    body = os.urandom(1000)
    etag = client.put_object(Bucket=BUCKET, Key="k", Body=body)["ETag"]
    kwargs = {
        "past the end": {"Range": "bytes=5000-"},
        "suffix": {"Range": "bytes=-10"},
        "two ranges": {"Range": "bytes=0-1,5-6"},
        "conditional": {"Range": "bytes=0-9", "IfNoneMatch": etag},
        "if-match another etag": {"Range": "bytes=0-9", "IfMatch": '"0123456789abcdef0123456789abcdef"'},
        "missing key": {"Range": "bytes=0-9"},
        "version": {"Range": "bytes=0-9", "VersionId": "null"},
    }[case]
    key = "no-such-key" if case == "missing key" else "k"
    ours, theirs, answered = _both(s3_server, client, key, **kwargs)
    assert answered == 0
    assert ours == theirs
    if case == "past the end":
        assert ours[:2] == (416, "InvalidRange")
    if case == "if-match another etag":
        assert ours[:2] == (412, "PreconditionFailed")
    if case == "suffix":
        assert ours[2] == body[-10:]
