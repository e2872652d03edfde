"""Fault rows on a real distributed object store (issue 31): SeaweedFS on loopback.

The cluster (emulators/seaweedfs.py) is a master, three volume servers holding every chunk twice
(replication 001), a filer and the S3 gateway, each a process of its own. A fault is injected at
one S3 request of a save or a load, from inside the request path (aiobotocore's
``AioEndpoint._send``, below s3fs's and txckpt's retries), so it lands exactly between two
requests, not after a sleep:

* **volume killed during a save**: before request k of a save, one volume server is SIGKILLed;
  it is started again (same data directory) after the save returned or raised;
* **volume killed during a load**: the same, before request k of a verified load;
* **gateway restarted mid-commit**: before request k of a save, the S3 gateway is SIGKILLed and
  started again on its port (the client's pooled connections die with it); and the gateway
  down for the rest of the save, started only after the save raised.

Every row sweeps k over every request of the operation. What must hold at every point: the
operation either succeeds (a save's checkpoint is then the newest of the lineage, a load returns
exactly the bytes saved) or raises a typed txckpt error; afterwards, with the cluster whole
again, the newest checkpoint of the lineage verifies and holds the bytes of one save, and every
checkpoint committed before still verifies. The count of faults injected goes to the summary.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import pytest

import txckpt
from tests import conftest
from tests.reliability.injectors import classify_request
from txckpt.errors import TxckptError

pytestmark = [pytest.mark.seaweedfs, pytest.mark.slow]

BIG = 1 << 20  # one PUT per file below txckpt's multipart threshold: the sweep covers every request
FAULTS: dict[str, int] = {}


def _files(step: int) -> dict[str, bytes]:
    """A checkpoint whose bytes say which save wrote them."""
    tag = step.to_bytes(4, "little")
    return {"model.bin": tag * (BIG // 4), "optimizer.bin": tag * 4096, "state.json": b'{"step": %d}' % step}


@contextlib.contextmanager
def fault_before_request(k: int, action: Callable[[], None]) -> Iterator[list[str]]:
    """Run ``action`` once, just before the k-th (0-based) S3 request of this process is sent;
    yields the names of the requests seen (for the sweep's length and the failure message)."""
    from aiobotocore.endpoint import AioEndpoint

    real = AioEndpoint._send
    seen: list[str] = []
    lock = threading.Lock()

    async def send(self_: Any, request: Any) -> Any:
        with lock:
            n = len(seen)
            seen.append(classify_request(request)[0])
        if n == k:
            action()
        return await real(self_, request)

    AioEndpoint._send = send  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        AioEndpoint._send = real  # type: ignore[method-assign]


def _count(row: str) -> None:
    FAULTS[row] = FAULTS.get(row, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    if FAULTS:
        conftest.SUMMARY_LINES.append(
            "SeaweedFS fault rows: "
            + ", ".join(f"{row} {n}" for row, n in sorted(FAULTS.items()))
            + f" faults injected ({sum(FAULTS.values())} in all), 0 violations"
        )


def _check_root(url: str, opts: dict[str, Any], committed: dict[int, str], allowed: set[int]) -> int:
    """The invariants after a fault, with the cluster whole again: the newest checkpoint is one of
    ``allowed`` steps, verifies, holds exactly that save's bytes; every earlier commit verifies."""
    newest = txckpt.get_last_checkpoint(url, storage_options=opts)
    assert newest is not None
    step = int(newest.rstrip("/").rsplit("-", 1)[1])
    assert step in allowed, (newest, allowed)
    loaded = txckpt.load_checkpoint(newest, storage_options=opts)
    assert {k: bytes(v) for k, v in loaded.items()} == _files(step)
    for path in committed.values():
        txckpt.verify_checkpoint(path, storage_options=opts)
    return step


def _requests_of(operation: Callable[[], Any]) -> int:
    with fault_before_request(-1, lambda: None) as seen:
        operation()
    return len(seen)


def _save_sweep(
    url: str, opts: dict[str, Any], row: str, inject: Callable[[], None], repair: Callable[[], None]
) -> None:
    committed = {1: txckpt.save_checkpoint(url, 1, _files(1), storage_options=opts)}
    step = 2
    n = _requests_of(lambda: txckpt.save_checkpoint(url, step, _files(step), storage_options=opts))
    committed[step] = txckpt.get_last_checkpoint(url, storage_options=opts)
    assert n >= 5, n
    for k in range(n):
        step += 1
        outcome = "saved"
        with fault_before_request(k, inject) as seen:
            try:
                committed[step] = txckpt.save_checkpoint(url, step, _files(step), storage_options=opts)
            except TxckptError as e:
                outcome = f"{type(e).__name__}: {e}"
            finally:
                repair()
        _count(row)
        where = f"{row} before request {k} ({seen[k] if k < len(seen) else '?'}): {outcome}"
        got = _check_root(
            url,
            opts,
            {s: p for s, p in committed.items() if s < step},
            {step} if outcome == "saved" else {step - 1, step},
        )
        if got == step:
            committed[step] = txckpt.get_last_checkpoint(url, storage_options=opts)
        else:
            step -= 1  # the next save reuses the step that did not commit
        print(where, "-> newest", got)


def test_a_volume_server_killed_during_a_save(seaweedfs_cluster, seaweedfs_root):
    url, opts = seaweedfs_root
    victim = {"i": 0}

    def kill() -> None:
        seaweedfs_cluster.kill_volume(victim["i"])

    def restart() -> None:
        seaweedfs_cluster.start_volume(victim["i"])
        victim["i"] = (victim["i"] + 1) % seaweedfs_cluster.VOLUMES

    _save_sweep(url, opts, "volume killed during a save", kill, restart)


def test_the_gateway_restarted_mid_commit(seaweedfs_cluster, seaweedfs_root):
    url, opts = seaweedfs_root
    _save_sweep(url, opts, "gateway restarted mid-save", seaweedfs_cluster.restart_gateway, lambda: None)


def test_the_gateway_down_for_the_rest_of_a_save(seaweedfs_cluster, seaweedfs_root, monkeypatch):
    """The gateway SIGKILLed before request k and back only after the save gave up: the save
    raises a typed error (or had already committed), and the root is whole afterwards."""
    url, opts = seaweedfs_root
    # Two attempts per request rather than five: each point waits out the retries of a gateway
    # that is not there, and the outcome (a typed error) is the same.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    _save_sweep(
        url,
        opts,
        "gateway down for the rest of a save",
        seaweedfs_cluster.kill_gateway,
        seaweedfs_cluster.start_gateway,
    )


def test_a_volume_server_killed_during_a_load(seaweedfs_cluster, seaweedfs_root):
    url, opts = seaweedfs_root
    path = txckpt.save_checkpoint(url, 1, _files(1), storage_options=opts)
    n = _requests_of(lambda: txckpt.load_checkpoint(path, storage_options=opts))
    assert n >= 2, n
    for k in range(n):
        i = k % seaweedfs_cluster.VOLUMES
        with fault_before_request(k, lambda: seaweedfs_cluster.kill_volume(i)):
            try:
                loaded = txckpt.load_checkpoint(path, storage_options=opts)
            except TxckptError:
                loaded = None  # typed: allowed while a replica is down
            finally:
                seaweedfs_cluster.start_volume(i)
        _count("volume killed during a load")
        if loaded is not None:  # what a load returns is always the bytes saved, verified
            assert {k_: bytes(v) for k_, v in loaded.items()} == _files(1)
        _check_root(url, opts, {1: path}, {1})


def _volume_ids(spec: str) -> list[int]:
    """SeaweedFS's ``" 1 3 5-6"`` as [1, 3, 5, 6]."""
    out: list[int] = []
    for part in spec.split():
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def test_the_cluster_is_replicated_and_signs_requests(seaweedfs_cluster, seaweedfs_root):
    """The fault rows mean what they say: three volume servers, every volume (so every chunk of
    every object) on exactly two of them, and a gateway that refuses a request signed with
    another key."""
    import collections
    import json
    import urllib.request

    import boto3
    import botocore.exceptions

    url, opts = seaweedfs_root
    txckpt.save_checkpoint(url, 1, _files(1), storage_options=opts)
    status = seaweedfs_cluster.master.probe.replace("/cluster/status", "/dir/status")
    with urllib.request.urlopen(status) as r:
        topology = json.load(r)["Topology"]
    nodes = [n for dc in topology["DataCenters"] for rack in dc["Racks"] for n in rack["DataNodes"]]
    assert len(nodes) == seaweedfs_cluster.VOLUMES
    holders = collections.Counter(v for n in nodes for v in _volume_ids(n["VolumeIds"]))
    assert holders and set(holders.values()) == {2}, holders
    assert {layout["replication"] for layout in topology["Layouts"]} == {"001"}
    bad = boto3.client(
        "s3",
        endpoint_url=seaweedfs_cluster.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="not-the-key",
        aws_secret_access_key="nope",
    )
    with pytest.raises(botocore.exceptions.ClientError):
        bad.list_buckets()
