"""The Storage contract (txckpt/_storage/base.py), method by method, on every backend.

Runs over ``any_root`` (local, memory, s3 via moto, gcs, azure; see emulators/), and here also on
seaweedfs: a SeaweedFS cluster (three replicated volume servers behind its S3 gateway,
emulators/seaweedfs.py), so the S3 backend is held to the contract by a real distributed store
and not by moto alone. Nothing here mocks
s3fs or botocore: the S3 cases talk HTTP to a moto server on 127.0.0.1. Races use barriers, never
sleeps; cross-process cases use ``multiprocessing`` with the spawn start method.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from txckpt._base.checksum import digest_bytes
from txckpt._storage import open_storage
from txckpt._storage.fsspec.store import FsspecStorage
from txckpt._storage.s3.store import S3Storage

from tests.harness.backends import STORE_KINDS

OBJECT_STORES = ("memory", "s3", "gcs", "azure", "seaweedfs")


def _blob(n: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible-enough bytes (cheaper than os.urandom for big sizes)."""
    block = digest_bytes(seed.to_bytes(8, "little")).encode() * 2  # 64 bytes
    reps = n // len(block) + 1
    out = bytearray((block * reps)[:n])
    # make every 64 KiB block distinct so a misplaced part would be caught
    for i in range(0, n, 65536):
        out[i : i + 8] = i.to_bytes(8, "little")[: max(0, min(8, n - i))]
    return bytes(out)


def _open(root: tuple[str, dict[str, Any]]):
    """A new Storage instance (on S3: a new client with its own listing cache)."""
    url, options = root
    return open_storage(url, options)


@pytest.fixture(params=STORE_KINDS)
def any_root(request) -> tuple[str, dict[str, Any]]:
    """The plugin's any_root over every kind of store, SeaweedFS included."""
    return request.getfixturevalue(f"{request.param}_root")


@pytest.fixture
def storage(any_root):
    return _open(any_root)


def _kind(request) -> str:
    return request.node.callspec.params["any_root"]


@pytest.fixture
def fine_grained_threads():
    """Switch threads every microsecond so that check-then-act windows actually interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


# =================================================================================================
# Addresses
# =================================================================================================
def test_full_path_and_key_of_round_trip(storage, any_root):
    url, _ = any_root
    for key in ["a", "a/b", "checkpoint-4/model.safetensors", ".txckpt/log/00000000000000000003.json"]:
        full = storage.full_path(key)
        assert storage.key_of(full) == key
        assert storage.key_of(full + "/") == key
    assert storage.key_of(storage.full_path("")) == ""
    assert storage.key_of(url) == ""
    # Outside the root, including a sibling whose name merely starts with the root's name.
    assert storage.key_of(storage.full_path("").rstrip("/") + "-sibling/x") is None
    parent = storage.full_path("").rstrip("/").rsplit("/", 1)[0]
    assert storage.key_of(parent + "/other/x") is None


def test_full_path_is_readable_by_other_tools(storage, any_root):
    import fsspec

    storage.create_exclusive("dir/f.bin", b"payload", durable=True)
    _, options = any_root
    full = storage.full_path("dir/f.bin")
    if "://" not in full:
        with open(full, "rb") as f:
            assert f.read() == b"payload"
    else:
        with fsspec.open(full, "rb", **options) as f:
            assert f.read() == b"payload"


# =================================================================================================
# create_exclusive
# =================================================================================================
def test_create_exclusive_creates_once(storage, any_root):
    storage.create_exclusive("log/0001.json", b'{"id": "a"}', durable=True)
    assert storage.read_bytes("log/0001.json") == b'{"id": "a"}'
    with pytest.raises(FileExistsError):
        storage.create_exclusive("log/0001.json", b'{"id": "b"}', durable=True)
    assert storage.read_bytes("log/0001.json") == b'{"id": "a"}'
    # A separate instance (a separate client on S3) loses too.
    with pytest.raises(FileExistsError):
        _open(any_root).create_exclusive("log/0001.json", b'{"id": "c"}', durable=True)
    assert storage.read_bytes("log/0001.json") == b'{"id": "a"}'


def test_create_exclusive_empty_and_binary(storage):
    storage.create_exclusive("e", b"", durable=True)
    assert storage.read_bytes("e") == b""
    data = bytes(range(256)) * 3
    storage.create_exclusive("d/bin", data, durable=False)
    assert storage.read_bytes("d/bin") == data


@pytest.mark.parametrize("writers", [8])
def test_create_exclusive_one_winner_threads(any_root, writers, fine_grained_threads, request):
    """Several threads, each with its own Storage instance (own S3 client), race on 20 keys."""
    stores = [_open(any_root) for _ in range(writers)]
    # SeaweedFS's gateway serialises conditional writes to one key: the losers of a race learn
    # it about 1 s apart (measured: 1, 2, ... 6 s for 7 losers), so 20 rounds of 8 writers took
    # 110 s of the campaign there. Five rounds still race 8 writers on each key.
    rounds = 5 if _kind(request) == "seaweedfs" else 20
    barrier = threading.Barrier(writers)

    def race(i: int) -> list[bool]:
        won = []
        for r in range(rounds):
            barrier.wait()
            try:
                stores[i].create_exclusive(f"log/{r:04d}.json", f"writer-{i}-round-{r}".encode(), durable=True)
                won.append(True)
            except FileExistsError:
                won.append(False)
        return won

    with ThreadPoolExecutor(writers) as ex:
        results = list(ex.map(race, range(writers)))
    reader = _open(any_root)
    for r in range(rounds):
        winners = [i for i in range(writers) if results[i][r]]
        assert len(winners) == 1, f"round {r}: winners {winners}"
        assert reader.read_bytes(f"log/{r:04d}.json") == f"writer-{winners[0]}-round-{r}".encode()


def _race_worker(root, index, rounds, barrier, results):
    """Child process (spawn): race on ``rounds`` keys, report wins."""
    st = open_storage(*root)
    for r in range(rounds):
        barrier.wait()
        try:
            st.create_exclusive(f"log/{r:04d}.json", f"proc-{index}-round-{r}".encode(), durable=True)
            results.put((index, r, True))
        except FileExistsError:
            results.put((index, r, False))


def test_create_exclusive_one_winner_processes(any_root, request):
    kind = _kind(request)
    if kind == "memory":
        pytest.skip("memory:// lives in one process: no cross-process race to run")
    ctx = multiprocessing.get_context("spawn")
    procs_n, rounds = 3, 15
    barrier = ctx.Barrier(procs_n)
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(any_root, i, rounds, barrier, results)) for i in range(procs_n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(procs_n * rounds)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    reader = _open(any_root)
    for r in range(rounds):
        winners = [i for (i, rr, won) in outcomes if rr == r and won]
        assert len(winners) == 1, f"round {r}: winners {winners}"
        assert reader.read_bytes(f"log/{r:04d}.json") == f"proc-{winners[0]}-round-{r}".encode()


def test_create_exclusive_no_partial_visibility(any_root, request, fine_grained_threads):
    """A reader polling the key sees nothing or the whole content, never a prefix."""
    size = (12 << 20) if _kind(request) in ("s3", "seaweedfs") else (4 << 20)
    data = _blob(size, seed=7)
    writer, reader = _open(any_root), _open(any_root)
    done = threading.Event()
    seen: list[int] = []
    bad: list[int] = []

    def poll():
        # Keep polling until the writer is done *and* one more read has happened after that.
        while True:
            finished = done.is_set()
            try:
                got = reader.read_bytes("m/manifest.bin")
            except FileNotFoundError:
                seen.append(-1)
            else:
                seen.append(len(got))
                if got != data:
                    bad.append(len(got))
            if finished:
                return

    t = threading.Thread(target=poll)
    t.start()
    try:
        writer.create_exclusive("m/manifest.bin", data, durable=True)
    finally:
        done.set()
        t.join()
    assert not bad, f"partial reads of sizes {bad[:5]}"
    assert seen[-1] == len(data)


# =================================================================================================
# Freshness: the listing-cache trap
# =================================================================================================
def _prime_caches(st, key: str) -> None:
    """Do what a long-lived process does before another one writes: list and probe."""
    st.list_dir(key)
    list(st.walk_files(key))
    st.exists(f"{key}/new.bin")
    fs = getattr(st, "fs", None)
    if fs is not None:  # also fill fsspec's own listing cache, as other code in-process might
        try:
            fs.ls(st._p(key), detail=True)
            fs.ls(st._p(""), detail=True)
            fs.find(st._p(""), detail=True)
            fs.exists(st._p(f"{key}/new.bin"))
        except FileNotFoundError:
            pass


def test_reads_see_writes_of_another_instance(any_root):
    a, b = _open(any_root), _open(any_root)
    b.create_exclusive("d/old.bin", b"old", durable=True)
    _prime_caches(a, "d")
    assert a.list_dir("d") == ["old.bin"]

    b.create_exclusive("d/new.bin", b"new", durable=True)
    f = b.open_write("d/sub/streamed.bin", durable=True)
    f.write(b"streamed")
    f.close()
    assert a.exists("d/new.bin")
    assert a.read_bytes("d/new.bin") == b"new"
    with a.open_read("d/new.bin") as f:
        assert f.read() == b"new"
    assert a.list_dir("d") == ["new.bin", "old.bin", "sub"]
    assert a.list_dir("d/sub") == ["streamed.bin"]
    assert sorted(a.walk_files("d")) == [("new.bin", 3), ("old.bin", 3), ("sub/streamed.bin", 8)]
    assert a.modified_time("d/new.bin") is not None

    # Replacement and deletion by the other instance are just as visible.
    b.replace("d/old.bin", b"old, replaced")
    assert a.read_bytes("d/old.bin") == b"old, replaced"
    assert dict(a.walk_files("d"))["old.bin"] == len(b"old, replaced")
    b.delete_file("d/new.bin")
    assert not a.exists("d/new.bin")
    with pytest.raises(FileNotFoundError):
        a.read_bytes("d/new.bin")
    assert a.list_dir("d") == ["old.bin", "sub"]
    b.delete_tree("d")
    assert not a.exists("d")
    assert a.list_dir("d") == []
    assert list(a.walk_files("d")) == []


def _write_worker(root, key, data):
    open_storage(*root).create_exclusive(key, data, durable=True)


def test_reads_see_writes_of_another_process(any_root, request):
    if _kind(request) == "memory":
        pytest.skip("memory:// lives in one process")
    a = _open(any_root)
    a.create_exclusive("d/old.bin", b"old", durable=True)
    _prime_caches(a, "d")
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_write_worker, args=(any_root, "d/new.bin", b"from child"))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0
    assert a.exists("d/new.bin")
    assert a.read_bytes("d/new.bin") == b"from child"
    assert a.list_dir("d") == ["new.bin", "old.bin"]
    assert sorted(a.walk_files("")) == [("d/new.bin", 10), ("d/old.bin", 3)]


# =================================================================================================
# open_write / abort / upload_file
# =================================================================================================
def test_open_write_close(storage, request):
    data = _blob(3 << 20, seed=1)
    f = storage.open_write("tx/1/model.bin", durable=True)
    for i in range(0, len(data), 100_000):
        f.write(data[i : i + 100_000])
    if _kind(request) in OBJECT_STORES:
        assert not storage.exists("tx/1/model.bin"), "object visible before close()"
    f.close()
    assert storage.read_bytes("tx/1/model.bin") == data
    assert dict(storage.walk_files("tx")) == {"1/model.bin": len(data)}


def test_open_write_accepts_memoryview_and_bytearray(storage):
    buf = bytearray(b"abcdef")
    f = storage.open_write("k", durable=False)
    f.write(memoryview(buf)[:3])
    buf[:3] = b"XYZ"  # the writer must have copied what it kept
    f.write(bytes(buf[3:]))
    f.close()
    assert storage.read_bytes("k") == b"abcdef"


def test_open_write_replaces_private_key(storage):
    for content in (b"first", b"second, longer"):
        f = storage.open_write("tx/a", durable=True)
        f.write(content)
        f.close()
    assert storage.read_bytes("tx/a") == b"second, longer"


def test_open_write_abort_leaves_nothing(storage, request):
    f = storage.open_write("tx/2/partial.bin", durable=True)
    f.write(_blob(1 << 20))
    f.abort()
    assert not storage.exists("tx/2/partial.bin")
    assert list(storage.walk_files("tx")) == []


def test_open_write_exception_in_with_leaves_nothing(storage):
    with pytest.raises(RuntimeError):
        with storage.open_write("tx/3/partial.bin", durable=True) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert not storage.exists("tx/3/partial.bin")


def test_upload_file_size_and_digest(storage, tmp_path):
    for name, data in [("empty", b""), ("small", b"hello"), ("big", _blob((9 << 20) + 12345, 3))]:
        src = tmp_path / name
        src.write_bytes(data)
        size, digest = storage.upload_file(str(src), f"up/{name}", durable=True)
        assert size == len(data)
        assert digest == digest_bytes(data)
        assert storage.read_bytes(f"up/{name}") == data


def test_upload_file_missing_source_leaves_nothing(storage, tmp_path):
    with pytest.raises(FileNotFoundError):
        storage.upload_file(str(tmp_path / "absent"), "up/x", durable=True)
    assert not storage.exists("up/x")


# =================================================================================================
# Reading, listing, deleting
# =================================================================================================
def test_missing_keys(storage):
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("nope")
    with pytest.raises(FileNotFoundError):
        storage.open_read("nope")
    assert not storage.exists("nope")
    assert not storage.exists("no/such/dir")
    assert storage.list_dir("nope") == []
    assert list(storage.walk_files("nope")) == []
    assert storage.modified_time("nope") is None
    storage.delete_file("nope")
    storage.delete_tree("nope")


def _populate(st) -> dict[str, bytes]:
    files = {
        "t/x": b"x",
        "t/y/z": b"zz",
        "t/y/w/v": b"vvv",
        "t/y.txt": b"yyyy",  # sorts between "t/y" and "t/y/" on S3
        "t2/other": b"55555",  # a sibling whose name starts with "t"
        "t.bin": b"666666",
    }
    for key, data in files.items():
        st.create_exclusive(key, data, durable=True)
    return files


def test_exists_files_and_directories(storage):
    _populate(storage)
    assert storage.exists("t/x")
    assert storage.exists("t")  # a directory (implicit on object stores)
    assert storage.exists("t/y")
    assert storage.exists("t/y/w")
    assert not storage.exists("t/xx")
    assert not storage.exists("t/y/w/v/deeper")
    assert not storage.exists("t/y.t")


def test_list_dir(storage):
    _populate(storage)
    assert storage.list_dir("") == ["t", "t.bin", "t2"]
    assert storage.list_dir("t") == ["x", "y", "y.txt"]
    assert storage.list_dir("t/y") == ["w", "z"]
    assert storage.list_dir("t/y/w") == ["v"]


def test_walk_files_nested(storage):
    files = _populate(storage)
    assert sorted(storage.walk_files("t")) == sorted(
        (k[len("t/") :], len(v)) for k, v in files.items() if k.startswith("t/")
    )
    assert sorted(storage.walk_files("t/y")) == [("w/v", 3), ("z", 2)]
    assert sorted(storage.walk_files("")) == sorted((k, len(v)) for k, v in files.items())


def test_open_read_and_modified_time(storage):
    storage.create_exclusive("r/f", b"0123456789", durable=True)
    with storage.open_read("r/f") as f:
        assert f.read(4) == b"0123"
        assert f.read() == b"456789"
    mtime = storage.modified_time("r/f")
    assert isinstance(mtime, float) and mtime > 1_600_000_000


def test_read_ranges_reads_each_range_and_stops_at_the_end(storage):
    storage.create_exclusive("r/g", bytes(range(100)), durable=True)
    assert storage.read_ranges("r/g", [(10, 4), (0, 2), (96, 16)]) == [
        bytes(range(10, 14)),
        bytes([0, 1]),
        bytes(range(96, 100)),
    ]
    assert storage.read_ranges("r/g", []) == []
    # An empty range (a 0-element tensor of load_tensors) is b"" on every backend: Azure's client
    # refused the empty ranged read's answer.
    assert storage.read_ranges("r/g", [(7, 0), (3, 2)]) == [b"", bytes([3, 4])]
    with pytest.raises(FileNotFoundError):
        storage.read_ranges("r/none", [(0, 1)])


def test_delete_file(storage):
    _populate(storage)
    storage.delete_file("t/x")
    assert not storage.exists("t/x")
    storage.delete_file("t/x")  # already gone: fine
    assert storage.list_dir("t") == ["y", "y.txt"]


def test_delete_tree(storage):
    files = _populate(storage)
    storage.delete_tree("t")
    assert not storage.exists("t")
    assert not storage.exists("t/y/w/v")
    # Neighbours that share the name's prefix survive.
    assert sorted(storage.walk_files("")) == sorted((k, len(v)) for k, v in files.items() if not k.startswith("t/"))
    storage.delete_tree("t")  # already gone: fine
    storage.delete_tree("t.bin")  # a single file
    assert not storage.exists("t.bin")
    assert storage.read_bytes("t2/other") == b"55555"


def test_replace(storage):
    storage.replace("hint", b"1")
    storage.replace("hint", b"22")
    assert storage.read_bytes("hint") == b"22"
    storage.sync_dir("")  # a no-op or an fsync; never an error


def test_rename_capability_flag(storage, request):
    assert storage.atomic_dir_rename == (_kind(request) == "local")


def test_run_concurrently_returns_each_result_or_exception_in_order(storage, request):
    storage.replace("a", b"1")

    def refused():
        raise PermissionError(13, "refused")

    out = storage.run_concurrently(
        [
            lambda: storage.read_bytes("a"),
            refused,
            lambda: storage.read_bytes("missing"),
            lambda: None,
        ]
    )
    assert out[0] == b"1" and isinstance(out[1], PermissionError)
    assert isinstance(out[2], FileNotFoundError) and out[3] is None
    # Overlapping pays where a request is a round trip; a local disk keeps one order of file
    # operations (the crash sweeps count them).
    assert storage.overlap_requests == (_kind(request) not in ("local", "memory"))


def test_run_concurrently_overlaps_only_where_requests_are_round_trips(storage):
    """The first call waits (at most 30 s) for the second to start: with overlap that happens at
    once; run one after the other, the first times out and says so."""
    import threading

    second_started = threading.Event()

    def first():
        return second_started.wait(30 if storage.overlap_requests else 0)

    def second():
        second_started.set()
        return "done"

    saw_second, _ = storage.run_concurrently([first, second])
    assert saw_second == storage.overlap_requests


def test_run_concurrently_works_in_a_forked_child(storage):
    """A child forked after the parent used the pool (a DataLoader worker, a fork-based launcher)
    gets a pool of its own: the inherited one has no threads and would never run its work."""
    import multiprocessing

    started = threading.Barrier(4)
    # Four calls that wait for each other: the parent's pool has all its threads now.
    storage.run_concurrently([lambda: started.wait(30)] * 4 if storage.overlap_requests else [])

    def child():
        os._exit(0 if storage.run_concurrently([lambda: 1, lambda: 2]) == [1, 2] else 1)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(120)  # a bound for a hang, not a synchronisation: the child needs milliseconds
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


# =================================================================================================
# S3 specifics: multipart, aborts, request counts
# =================================================================================================
@pytest.fixture
def s3(s3_root, s3_server):
    st = open_storage(*s3_root)
    assert isinstance(st, S3Storage)
    st.part_size = 5 << 20  # S3's minimum: several parts with small test data
    st.multipart_threshold = st.part_size  # multipart from the first full part
    return st


@pytest.mark.s3
def test_s3_file_within_the_threshold_is_one_put_and_larger_is_multipart(s3, s3_server):
    s3.multipart_threshold = 3 * s3.part_size
    small = _blob(3 * s3.part_size, seed=1)  # exactly the threshold: still one request
    large = _blob(3 * s3.part_size + 1, seed=2)
    for key, data, expected in [
        ("tx/small.bin", small, {"PutObject": 1}),
        ("tx/large.bin", large, {"CreateMultipartUpload": 1, "UploadPart": 4, "CompleteMultipartUpload": 1}),
    ]:
        with s3_server.counter() as c:
            f = s3.open_write(key, durable=True)
            for i in range(0, len(data), 1 << 20):
                f.write(data[i : i + (1 << 20)])
            f.close()
        assert dict(c.ops) == expected, key
        assert c.uploaded_bytes == len(data)
        assert s3.read_bytes(key) == data


class _PutHeaders:
    """A WSGI app in front of moto (``S3Server.wrapped``): the x-amz-checksum-crc32 header of
    every PutObject the server receives (None: absent)."""

    def __init__(self, app):
        self.app, self.seen = app, []

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") == "PUT" and "uploadId" not in environ.get("QUERY_STRING", ""):
            self.seen.append((environ.get("PATH_INFO", ""), environ.get("HTTP_X_AMZ_CHECKSUM_CRC32")))
        return self.app(environ, start_response)


def _crc32_b64(data: bytes) -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


@pytest.mark.s3
def test_s3_single_put_carries_the_crc32_of_the_bytes_as_written(s3, s3_server):
    """The writer computes the CRC32 while the bytes are written (in the writing thread, not on
    the event loop), and the PutObject carries it: S3 rejects a body that does not match it
    (BadDigest), so a buffer changed between the write and the upload could not be stored.
    moto does not check the header; the test checks what is sent."""
    s3.multipart_threshold = 8 << 20
    data = _blob(3 << 20, seed=3)
    with s3_server.wrapped(_PutHeaders) as put:
        f = s3.open_write("tx/crc.bin", durable=True)
        for i in range(0, len(data), 1 << 20):
            f.write(data[i : i + (1 << 20)])
        f.close()
        f = s3.open_write("tx/changed.bin", durable=True)
        f.write(data)
        f._head.getbuffer()[5] ^= 1  # the buffer changes after the write (a bug's doing)
        f.close()
    assert [h for _, h in put.seen] == [_crc32_b64(data), _crc32_b64(data)]
    assert s3.read_bytes("tx/crc.bin") == data


@pytest.mark.s3
def test_s3_writer_sends_no_checksum_when_the_client_is_told_not_to(s3_root, s3_server):
    """``request_checksum_calculation="when_required"`` in the client's config (S3-compatible
    stores that reject the checksum headers): the writer sends none either."""
    url, opts = s3_root
    st = open_storage(url, {**opts, "config_kwargs": {"request_checksum_calculation": "when_required"}})
    with s3_server.wrapped(_PutHeaders) as put:
        f = st.open_write("tx/plain.bin", durable=True)
        f.write(b"plain bytes")
        f.close()
    assert [h for _, h in put.seen] == [None]
    assert st.read_bytes("tx/plain.bin") == b"plain bytes"


@pytest.mark.s3
def test_s3_multipart_write_parts_and_bytes(s3, s3_server):
    data = _blob((17 << 20) + 3, seed=11)
    with s3_server.counter() as c:
        f = s3.open_write("tx/big.bin", durable=True)
        for i in range(0, len(data), 1 << 20):  # 1 MiB writes, not aligned to parts
            f.write(data[i : i + (1 << 20)])
        assert not s3.exists("tx/big.bin")
        f.close()
    ops = dict(c.ops)
    ops.pop("HeadObject"), ops.pop("ListObjectsV2")  # the exists() probe
    assert ops == {"CreateMultipartUpload": 1, "UploadPart": 4, "CompleteMultipartUpload": 1}
    assert c.uploaded_bytes == len(data)  # uploaded exactly once: no copy, no rename
    assert s3.read_bytes("tx/big.bin") == data
    assert s3_server.multipart_uploads() == []


@pytest.mark.s3
def test_s3_multipart_abort_leaves_no_upload(s3, s3_server):
    f = s3.open_write("tx/abort.bin", durable=True)
    f.write(_blob(12 << 20))
    assert len(s3_server.multipart_uploads()) == 1
    f.abort()
    assert s3_server.multipart_uploads() == []
    assert not s3.exists("tx/abort.bin")
    f.abort()  # idempotent


@pytest.mark.s3
def test_s3_multipart_exception_in_with_leaves_no_upload(s3, s3_server):
    with pytest.raises(RuntimeError):
        with s3.open_write("tx/boom.bin", durable=True) as f:
            f.write(_blob(11 << 20))
            raise RuntimeError("boom")
    assert s3_server.multipart_uploads() == []
    assert not s3.exists("tx/boom.bin")


@pytest.mark.s3
def test_s3_abandoned_writer_leaves_no_upload(s3, s3_server):
    import gc

    f = s3.open_write("tx/lost.bin", durable=True)
    f.write(_blob(11 << 20))
    del f
    gc.collect()
    assert s3_server.multipart_uploads() == []
    assert not s3.exists("tx/lost.bin")


@pytest.mark.s3
def test_s3_delete_tree_aborts_orphaned_uploads(s3, s3_server):
    client = s3_server.boto3_client()
    client.create_multipart_upload(Bucket="txckpt-test", Key="root/.txckpt/tx/dead/model.bin")
    client.create_multipart_upload(Bucket="txckpt-test", Key="root/.txckpt/tx2/alive.bin")
    s3.delete_tree(".txckpt/tx")
    assert [u["Key"] for u in s3_server.multipart_uploads()] == ["root/.txckpt/tx2/alive.bin"]


@pytest.mark.s3
def test_s3_upload_file_is_concurrent_multipart_once(s3, s3_server, tmp_path):
    data = _blob((21 << 20) + 1, seed=5)
    src = tmp_path / "big"
    src.write_bytes(data)
    with s3_server.counter() as c:
        size, digest = s3.upload_file(str(src), "up/big", durable=True)
    assert (size, digest) == (len(data), digest_bytes(data))
    assert dict(c.ops) == {"CreateMultipartUpload": 1, "UploadPart": 5, "CompleteMultipartUpload": 1}
    assert c.uploaded_bytes == len(data)
    assert s3.read_bytes("up/big") == data


@pytest.mark.s3
def test_s3_request_counts(s3, s3_server, tmp_path):
    """One request per operation where S3 allows it; these numbers are in docs/remote.md."""

    def count(fn, *args, **kwargs):
        with s3_server.counter() as c:
            fn(*args, **kwargs)
        return dict(c.ops)

    assert count(s3.create_exclusive, "a/log.json", b"{}", durable=True) == {"PutObject": 1}
    with pytest.raises(FileExistsError):
        with s3_server.counter() as c:
            s3.create_exclusive("a/log.json", b"{}", durable=True)
    assert dict(c.ops) == {"PutObject": 1}
    assert count(s3.replace, "a/hint", b"1") == {"PutObject": 1}
    assert count(s3.read_bytes, "a/log.json") == {"GetObject": 1}
    assert count(s3.exists, "a/log.json") == {"HeadObject": 1}
    assert count(s3.exists, "a") == {"HeadObject": 1, "ListObjectsV2": 1}
    assert count(s3.exists, "missing") == {"HeadObject": 1, "ListObjectsV2": 1}
    assert count(s3.list_dir, "a") == {"ListObjectsV2": 1}
    assert count(lambda: list(s3.walk_files(""))) == {"ListObjectsV2": 1}
    assert count(s3.modified_time, "a/log.json") == {"HeadObject": 1}
    assert count(s3.sync_dir, "a") == {}

    def small_write():
        f = s3.open_write("a/small", durable=True)
        f.write(b"x" * 1000)
        f.close()

    assert count(small_write) == {"PutObject": 1}

    def small_abort():
        f = s3.open_write("a/small2", durable=True)
        f.write(b"x" * 1000)
        f.abort()

    assert count(small_abort) == {}
    src = tmp_path / "f"
    src.write_bytes(b"y" * 1000)
    assert count(s3.upload_file, str(src), "a/up", durable=True) == {"PutObject": 1}
    assert count(s3.delete_file, "a/up") == {"DeleteObject": 1}
    assert count(s3.delete_tree, "a") == {"ListObjectsV2": 1, "DeleteObjects": 1, "ListMultipartUploads": 1}


@pytest.mark.s3
def test_s3_create_exclusive_sends_if_none_match(s3, s3_server):
    """The commit point is one conditional request, not check-then-write: an unconditional
    PutObject from someone else is not what protects it, the server's 412 is."""
    client = s3_server.boto3_client()
    client.put_object(Bucket="txckpt-test", Key="root/k", Body=b"theirs")
    with s3_server.counter() as c, pytest.raises(FileExistsError):
        s3.create_exclusive("k", b"mine", durable=True)
    assert dict(c.ops) == {"PutObject": 1}
    assert s3.read_bytes("k") == b"theirs"


# =================================================================================================
# The generic fsspec path (what GCS / Azure get) exercised against S3
# =================================================================================================
@pytest.fixture
def generic_s3(s3_root):
    import fsspec

    url, options = s3_root

    def make():
        fs, path = fsspec.core.url_to_fs(url, **options)
        st = object.__new__(FsspecStorage)
        FsspecStorage.__init__(st, url, fs, path)
        return st

    return make


@pytest.mark.s3
def test_generic_fsspec_path_freshness_and_exclusive(generic_s3):
    a, b = generic_s3(), generic_s3()
    assert type(a) is FsspecStorage
    b.create_exclusive("d/old.bin", b"old", durable=True)
    _prime_caches(a, "d")
    b.create_exclusive("d/new.bin", b"new", durable=True)
    f = b.open_write("d/sub/s.bin", durable=True)
    f.write(b"streamed")
    f.close()
    assert a.exists("d/new.bin")
    assert a.read_bytes("d/new.bin") == b"new"
    assert a.list_dir("d") == ["new.bin", "old.bin", "sub"]
    assert sorted(a.walk_files("d")) == [("new.bin", 3), ("old.bin", 3), ("sub/s.bin", 8)]
    with pytest.raises(FileExistsError):
        a.create_exclusive("d/new.bin", b"again", durable=True)
    g = a.open_write("d/aborted.bin", durable=True)
    g.write(b"x")
    g.abort()
    assert not b.exists("d/aborted.bin")
    b.delete_tree("d")
    assert a.list_dir("d") == []
    assert not a.exists("d/new.bin")


@pytest.mark.s3
def test_s3_create_exclusive_ambiguous_retry_resolved_by_read_back(s3, s3_server):
    """The server applies our conditional PutObject but answers 500; botocore retries and gets
    412. create_exclusive reads the object back: our own bytes, so we won and must not raise."""
    s3_server.inject_failure("PutObject", "root/log/0007.json", after_apply=True)
    with s3_server.counter() as c:
        s3.create_exclusive("log/0007.json", b'{"txid": "mine"}', durable=True)
    assert dict(c.ops) == {"PutObject": 2, "GetObject": 1}
    assert s3.read_bytes("log/0007.json") == b'{"txid": "mine"}'


@pytest.mark.s3
def test_s3_create_exclusive_retry_then_loss_still_raises(s3, s3_server):
    """A failed first attempt, a retry, and someone else's object: still FileExistsError."""
    s3_server.boto3_client().put_object(Bucket="txckpt-test", Key="root/log/0008.json", Body=b'{"txid": "theirs"}')
    s3_server.inject_failure("PutObject", "root/log/0008.json", after_apply=False)
    with pytest.raises(FileExistsError):
        s3.create_exclusive("log/0008.json", b'{"txid": "mine"}', durable=True)
    assert s3.read_bytes("log/0008.json") == b'{"txid": "theirs"}'


@pytest.mark.s3
def test_s3_transient_part_failure_is_retried(s3, s3_server):
    data = _blob(12 << 20, seed=9)
    s3_server.inject_failure("UploadPart", "root/tx/retry.bin", after_apply=False)
    f = s3.open_write("tx/retry.bin", durable=True)
    f.write(data)
    f.close()
    assert s3.read_bytes("tx/retry.bin") == data
