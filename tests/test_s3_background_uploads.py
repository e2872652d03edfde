"""S3: a save's files finish uploading in the background while the next file is written
(``Storage.write_batch``, ``S3WriteBatch``). What must hold: a failed background upload makes
the save raise a typed error and commit nothing; an aborted save waits for the uploads still in
flight before it deletes its staging, so nothing lands after the delete; memory stays bounded by
``max_pending``; and a save sends the same requests as before."""

from __future__ import annotations

import os
import time

import pytest

import txckpt
from txckpt.errors import StorageError, TransactionAbortedError
from txckpt._root.root import CheckpointRoot
from txckpt._storage import open_storage
from txckpt._storage.s3 import store as fst
from txckpt._storage.s3 import upload as s3_upload

pytestmark = pytest.mark.s3


def _blob(n: int, seed: int = 0) -> bytes:
    return (bytes([seed % 251]) + os.urandom(255)) * (n // 256) + b"z" * (n % 256)


def _objects(s3_server, prefix: str = "root/") -> list[str]:
    client = s3_server.boto3_client()
    page = client.list_objects_v2(Bucket="txckpt-test", Prefix=prefix)
    return sorted(o["Key"] for o in page.get("Contents", []))


def _staged(s3_server) -> list[str]:
    return [k for k in _objects(s3_server) if "/.txckpt/tx/" in k or "/.txckpt/intents/" in k]


@pytest.fixture
def s3(s3_root):
    st = open_storage(*s3_root)
    assert isinstance(st, fst.S3Storage)
    return st


# ----- the storage seam -----------------------------------------------------------------------


def test_close_returns_before_the_upload_lands_and_wait_waits(s3, s3_server):
    s3_server.inject_delay("PutObject", "slow.bin", 1.0)
    batch = s3.write_batch()
    t0 = time.perf_counter()
    with batch.open_write("tx/slow.bin", durable=True) as f:
        f.write(b"a" * 1000)
    closed = time.perf_counter() - t0
    assert closed < 0.7, f"close() waited {closed:.2f} s for the upload"
    batch.wait()
    assert time.perf_counter() - t0 >= 1.0
    assert s3.read_bytes("tx/slow.bin") == b"a" * 1000


def test_wait_raises_a_failed_upload_naming_the_file_and_leaves_nothing(s3, s3_server):
    s3_server.inject_denial("PutObject", "denied.bin")
    batch = s3.write_batch()
    with batch.open_write("tx/denied.bin", durable=True) as f:
        f.write(b"a" * 1000)  # close() hands the PutObject over: no error yet
    with pytest.raises(PermissionError, match="tx/denied.bin"):
        batch.wait()
    assert not s3.exists("tx/denied.bin")
    batch.cancel()  # nothing left to wait for


def test_an_earlier_failure_surfaces_at_the_next_close(s3, s3_server):
    s3_server.inject_denial("PutObject", "first.bin")
    batch = s3.write_batch()
    batch.max_pending = 1  # the second close() must wait for the first upload
    with batch.open_write("tx/first.bin", durable=True) as f:
        f.write(b"1" * 1000)
    f2 = batch.open_write("tx/second.bin", durable=True)
    f2.write(b"2" * 1000)
    with pytest.raises(PermissionError, match="tx/first.bin"):
        f2.close()
    assert f2.closed
    batch.cancel()
    assert not s3.exists("tx/first.bin") and not s3.exists("tx/second.bin")


def test_a_failed_multipart_completion_aborts_the_upload(s3, s3_server):
    s3.part_size = 5 << 20
    s3.multipart_threshold = s3.part_size
    s3_server.inject_denial("CompleteMultipartUpload", "big.bin")
    batch = s3.write_batch()
    with batch.open_write("tx/big.bin", durable=True) as f:
        f.write(_blob(11 << 20))
    with pytest.raises(PermissionError, match="tx/big.bin"):
        batch.wait()
    assert s3_server.multipart_uploads() == []
    assert not s3.exists("tx/big.bin")


def test_at_most_max_pending_uploads_at_once(s3, s3_server, monkeypatch):
    """A close() beyond max_pending waits for the oldest upload: memory stays bounded."""
    batch = s3.write_batch()
    assert batch.max_pending == fst.S3_PENDING_FILES
    batch.max_pending = 2
    seen = []
    real = batch.submit

    def submit(key, future):
        real(key, future)
        seen.append(len(batch._pending))

    monkeypatch.setattr(batch, "submit", submit)
    for i in range(5):
        s3_server.inject_delay("PutObject", f"f{i}.bin", 0.2)
        with batch.open_write(f"tx/f{i}.bin", durable=True) as f:
            f.write(b"x" * 100)
    batch.wait()
    assert max(seen) == 2
    assert all(s3.read_bytes(f"tx/f{i}.bin") == b"x" * 100 for i in range(5))


def test_max_pending_zero_uploads_at_close(s3, s3_server):
    s3_server.inject_delay("PutObject", "sync.bin", 0.5)
    batch = s3.write_batch()
    batch.max_pending = 0
    t0 = time.perf_counter()
    with batch.open_write("tx/sync.bin", durable=True) as f:
        f.write(b"s" * 10)
    assert time.perf_counter() - t0 >= 0.5
    assert s3.read_bytes("tx/sync.bin") == b"s" * 10


def test_the_default_batch_writes_synchronously(tmp_path):
    st = open_storage(str(tmp_path))
    batch = st.write_batch()
    with batch.open_write("a/b.bin", durable=False) as f:
        f.write(b"abc")
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"abc"  # complete at close()
    batch.wait()
    batch.cancel()


# ----- the transaction --------------------------------------------------------------------------


def _root(s3_root) -> CheckpointRoot:
    url, opts = s3_root
    txckpt.forget_roots()
    return CheckpointRoot(url, opts)


def test_a_failed_background_upload_fails_the_save_and_commits_nothing(s3_root, s3_server):
    root = _root(s3_root)
    first = root.save(1, {"a.bin": b"one", "b.bin": b"one"})
    # a.bin's upload runs while b.bin is written; it is refused (not retried)
    s3_server.inject_denial("PutObject", "checkpoint-2/a.bin")
    with pytest.raises(StorageError, match="a.bin") as info:
        root.save(2, {"a.bin": _blob(1 << 20), "b.bin": _blob(1 << 20, 1)})
    assert "Nothing was committed" in str(info.value)
    assert txckpt.get_last_checkpoint(s3_root[0], storage_options=s3_root[1]) == first
    assert [k for k in _staged(s3_server) if "checkpoint-2" in k or "/intents/" in k] == []
    assert s3_server.multipart_uploads() == []


def test_a_failed_last_upload_fails_the_save_and_commits_nothing(s3_root, s3_server):
    """The last file's upload is only waited for at the end of the block: its failure still
    reaches the save as a typed error, before any manifest is written."""
    root = _root(s3_root)
    s3_server.inject_failure("PutObject", "checkpoint-1/b.bin", after_apply=False)
    for _ in range(20):  # more failures than s3fs and botocore retry
        s3_server.inject_failure("PutObject", "checkpoint-1/b.bin", after_apply=False)
    with pytest.raises(TransactionAbortedError, match=r"upload of .*checkpoint-1/b.bin failed"):
        root.save(1, {"a.bin": b"a", "b.bin": b"b"})
    s3_server.clear_failures()
    assert txckpt.get_last_checkpoint(s3_root[0], storage_options=s3_root[1]) is None
    assert not [k for k in _objects(s3_server) if k.endswith("txckpt-manifest.json")]
    assert _staged(s3_server) == []


def test_an_aborted_save_waits_for_uploads_in_flight(s3_root, s3_server):
    """The block raises while a file's upload is still on the wire: the abort waits for it, so
    the staging is deleted after the upload landed and nothing is left behind."""
    root = _root(s3_root)
    s3_server.inject_delay("PutObject", "checkpoint-1/slow.bin", 1.0)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="boom"):
        with root.transaction(1) as tx:
            tx.save("slow.bin", b"s" * 1000)
            raise RuntimeError("boom")
    assert time.perf_counter() - t0 >= 1.0
    assert _staged(s3_server) == []
    assert txckpt.get_last_checkpoint(s3_root[0], storage_options=s3_root[1]) is None


def test_a_save_commits_after_its_uploads_and_sends_the_same_requests(s3_root, s3_server):
    root = _root(s3_root)
    root.save(1, {"x.bin": b"x"})
    s3_server.inject_delay("PutObject", "checkpoint-2/a.bin", 0.5)
    files = {"a.bin": _blob(3 << 20), "b.bin": _blob(2 << 20, 2)}
    with s3_server.counter() as c:
        path = root.save(2, files)
    # intent, 2 data PUTs, listing, manifest, commit entry, then at once: hint, intent delete.
    # No state reads: the session plans against its own last commit; and no manifest read-back:
    # the publication returns the key the commit wrote the checkpoint under (object stores
    # publish in place).
    assert dict(c.ops) == {"PutObject": 6, "ListObjectsV2": 1, "DeleteObject": 1}
    assert c.uploaded_bytes - sum(len(v) for v in files.values()) < 4096  # + small files only
    loaded = txckpt.load_checkpoint(path, storage_options=s3_root[1])
    assert {k: bytes(v) for k, v in loaded.items()} == files


def test_after_the_commit_point_hint_read_back_and_intent_delete_overlap(s3_root, s3_server):
    """Protocol §8 steps 9-11 on an object store: the hint, the publication (in place: the key
    the commit wrote) and the intent's delete are independent and go out at once. The hint's PUT waits (at most
    30 s) until the intent's delete has started: it returns at once only if they overlap."""
    import threading

    root = _root(s3_root)
    root.save(1, {"x.bin": b"x"})
    st = root.storage
    delete_started = threading.Event()
    hint_saw_delete: list[bool] = []
    real_replace, real_delete = st.replace, st.delete_file

    def replace(key, data, **kw):
        if key == ".txckpt/latest":
            hint_saw_delete.append(delete_started.wait(30))
        return real_replace(key, data, **kw)

    def delete_file(key):
        if key.startswith(".txckpt/intents/"):
            delete_started.set()
        return real_delete(key)

    st.replace, st.delete_file = replace, delete_file
    path = root.save(2, {"x.bin": b"y"})
    assert hint_saw_delete == [True]
    assert not st.list_dir(".txckpt/intents")
    assert st.read_bytes(".txckpt/latest") == str(root.state().seq).encode()
    assert bytes(txckpt.load_checkpoint(path, storage_options=s3_root[1])["x.bin"]) == b"y"


def test_a_retried_put_sends_the_whole_body_again(s3, s3_server):
    """The body is a file-like buffer: a retry (botocore's or s3fs's) must rewind it, not send
    what is left after the first attempt."""
    data = _blob(3 << 20, 7)
    for after_apply in (False, True):
        key = f"retried-{after_apply}.bin"
        s3_server.inject_failure("PutObject", key, after_apply=after_apply)
        batch = s3.write_batch()
        with batch.open_write(f"tx/{key}", durable=True) as f:
            f.write(data)
        with s3_server.counter() as c:
            batch.wait()
        assert s3.read_bytes(f"tx/{key}") == data
    with s3_server.counter() as c:
        with s3.open_write("tx/sync.bin", durable=True) as f:
            s3_server.inject_failure("PutObject", "sync.bin", after_apply=False)
            f.write(data)
    assert c.ops["PutObject"] == 2 and c.uploaded_bytes == 2 * len(data)
    assert s3.read_bytes("tx/sync.bin") == data


def test_every_attempt_of_a_put_sends_the_body_from_its_start(s3, s3_server, monkeypatch):
    """s3fs retries a dropped connection by calling put_object again with the same (file-like)
    body; each attempt must send it from the start, never the rest of it."""
    import io

    from fsspec.asyn import sync
    from s3fs import core

    data = _blob(1 << 20, 3)
    body = io.BytesIO(data)
    calls = []
    real = core._error_wrapper

    async def flaky(func, *, args=(), kwargs=None, retries):
        async def first_fails(**kw):
            calls.append(1)
            if len(calls) == 1:
                kw["Body"].read()  # the first attempt got through the body, then the connection broke
                raise core.S3_RETRYABLE_ERRORS[0]("dropped")
            return await func(**kw)

        return await real(first_fails, args=args, kwargs=kwargs, retries=retries)

    monkeypatch.setattr(core, "_error_wrapper", flaky)
    sync(s3.fs.loop, s3_upload._put_object, s3.fs, s3.bucket, s3._obj("tx/rewound.bin"), body)
    assert len(calls) == 2
    assert s3.read_bytes("tx/rewound.bin") == data
