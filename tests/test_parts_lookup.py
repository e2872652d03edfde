"""Issue 33: ``get_last_checkpoint`` on S3 costs the same few requests whatever the world size of
the saves it looks over (protocol §6: it reads the hint and the log, never a manifest's parts)."""

import pytest

import txckpt
from benchmarks.s3 import _upload_plan
from txckpt._root.root import forget_roots
from txckpt._storage import open_storage
from tests.test_manifest_parts import _save

pytestmark = pytest.mark.s3


def _lookup_requests(tmp_path, s3_server, world: int) -> tuple[str, int]:
    """Two /2 saves of ``world`` simulated ranks, built locally and uploaded object by object to
    a fresh bucket prefix, each checkpoint at its home there (as benchmarks/s3.py uploads a
    root); then one cold lookup: (its answer's name, its request count)."""
    s3_server.create_bucket("parts")
    local = str(tmp_path / f"w{world}")
    root = txckpt.CheckpointRoot(local)
    for step in (1, 2):
        _save(root, step, world)
    url, opts = f"s3://parts/w{world}", s3_server.storage_options()
    storage = open_storage(url, opts)
    for path, key in _upload_plan(local, ""):
        with open(path, "rb") as f:
            storage.create_exclusive(key.lstrip("/"), f.read(), durable=True)
    forget_roots()  # a new process: nothing cached
    with s3_server.counter() as counter:
        path = txckpt.get_last_checkpoint(url, storage_options=opts)
    assert path is not None
    return path.rsplit("/", 1)[-1], counter.total


def test_get_last_checkpoint_on_s3_costs_the_same_requests_at_any_world_size(tmp_path, s3_server):
    small = _lookup_requests(tmp_path, s3_server, 8)
    large = _lookup_requests(tmp_path, s3_server, 256)
    assert small == large == ("checkpoint-2", small[1])
    assert small[1] <= 4, small  # protocol §6: the hint, the log entries after it
