"""The same first mistakes as test_remote_errors.py, on GCS and Azure roots: a bucket (container)
that does not exist, credentials the server refuses, an endpoint that does not answer. Each is
the same typed txckpt error an S3 root gives, naming the root, the bucket or the endpoint, and
saying what to do: storage/errors.py recognises gcsfs', google-auth's, aiohttp's and azure-core's
exceptions at the storage seam. Against fake-gcs-server and Azurite on loopback (the rows skip
where those are not installed); the unreachable endpoint is a closed port on 127.0.0.1."""

from __future__ import annotations

import uuid

import pytest

import txckpt
from txckpt.errors import CredentialsError, EndpointUnreachableError, RootNotFoundError, TxckptError
from txckpt._storage import open_storage
from txckpt._storage.errors import translate


def _calls(url, so):
    return (
        ("lookup", lambda: txckpt.get_last_checkpoint(url, storage_options=so)),
        ("save", lambda: txckpt.save_checkpoint(url, 1, {"a.bin": b"x"}, storage_options=so)),
    )


# ----- GCS ---------------------------------------------------------------------------------------
@pytest.mark.gcs
def test_gcs_missing_bucket_is_root_not_found_for_lookup_and_save(gcs_server, gcs_root):
    bucket = f"no-such-{uuid.uuid4().hex[:12]}"
    url = f"gs://{bucket}/run"
    for what, call in _calls(url, gcs_server.storage_options()):
        with pytest.raises(RootNotFoundError) as e:
            call()
        assert isinstance(e.value, FileNotFoundError), what
        assert e.value.root == url and e.value.bucket == f"gs://{bucket}", what
        assert f"gs://{bucket}" in str(e.value) and "create the bucket" in str(e.value), what
        assert gcs_server.endpoint_url.rstrip("/") in str(e.value), what
        txckpt.forget_roots()
    # A key missing in a bucket that exists stays a plain FileNotFoundError.
    real, so = gcs_root
    with pytest.raises(FileNotFoundError) as missing_key:
        open_storage(real, so).read_bytes("no-such-key")
    assert not isinstance(missing_key.value, TxckptError)


@pytest.mark.gcs
def test_gcs_unreachable_endpoint_names_it(gcs_server, closed_endpoint):
    # gcsfs retries a failed connection 6 times with its own backoff (~33 s, fixed at import):
    # the live call is too slow for the suite, so the connection failure is aiohttp's own, made
    # by a real connect to the closed port, and mapped for a GCS root opened at that endpoint.
    aiohttp = pytest.importorskip("aiohttp")
    import asyncio

    async def connect():
        async with aiohttp.ClientSession() as session:
            async with session.get(closed_endpoint):
                pass

    so = {**gcs_server.storage_options(), "endpoint_url": closed_endpoint}
    storage = open_storage("gs://bucket/run", so)
    try:
        asyncio.run(connect())
    except aiohttp.ClientConnectorError as e:
        mapped = translate(e, storage, 2.0)
    assert isinstance(mapped, EndpointUnreachableError)
    assert mapped.endpoint == closed_endpoint and mapped.seconds == 2.0
    assert closed_endpoint in str(mapped) and "endpoint_url=" in str(mapped)
    assert "gs://bucket/run" in str(mapped)


def test_gcs_refused_credentials_are_credentials_error():
    google_auth = pytest.importorskip("google.auth.exceptions")
    storage = open_storage("memory://gcs-like/root", {})
    storage.url = "gs://bucket/root"  # the message is worded by the root's scheme
    err = google_auth.RefreshError("invalid_grant: Token has been expired or revoked.")
    mapped = translate(err, storage)
    assert isinstance(mapped, CredentialsError) and "token=" in str(mapped)
    assert "gs://bucket/root" in str(mapped) and "docs/remote.md" in str(mapped)


# ----- Azure -------------------------------------------------------------------------------------
@pytest.mark.azure
def test_azure_missing_container_is_root_not_found_for_lookup_and_save(azure_server, azure_root):
    container = f"no-such-{uuid.uuid4().hex[:12]}"
    url = f"az://{container}/run"
    for what, call in _calls(url, azure_server.storage_options()):
        with pytest.raises(RootNotFoundError) as e:
            call()
        assert e.value.root == url and e.value.bucket == f"az://{container}", what
        assert "create the container" in str(e.value) and "abfs://" not in str(e.value), what
        txckpt.forget_roots()
    real, so = azure_root
    with pytest.raises(FileNotFoundError) as missing_key:
        open_storage(real, so).read_bytes("no-such-key")
    assert not isinstance(missing_key.value, TxckptError)


@pytest.mark.azure
def test_azure_wrong_account_key_is_credentials_error(azure_server, azure_root):
    url, so = azure_root
    bad = dict(so)
    bad["connection_string"] = so["connection_string"].replace("AccountKey=", "AccountKey=AAAA")
    for what, call in _calls(url, bad):
        with pytest.raises(CredentialsError) as e:
            call()
        assert e.value.root == url, what
        assert "account_key=" in str(e.value) and "AZURE_STORAGE_CONNECTION_STRING" in str(e.value), what
        txckpt.forget_roots()


def test_azure_connection_failure_is_endpoint_unreachable():
    # A real Azure SDK exception, raised from aiohttp's as the SDK does (a live one takes the SDK's
    # retry policy, ~90 s, to arrive: too slow for the suite).
    azure_exc = pytest.importorskip("azure.core.exceptions")
    storage = open_storage("memory://az-like/root", {})
    storage.url = "az://container/root"
    try:
        try:
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
        except ConnectionRefusedError as inner:
            raise azure_exc.ServiceRequestError("Cannot connect to host 127.0.0.1:9") from inner
    except azure_exc.ServiceRequestError as e:
        mapped = translate(e, storage, 1.5)
    assert isinstance(mapped, EndpointUnreachableError) and mapped.seconds == 1.5
    assert "BlobEndpoint=" in str(mapped) and "az://container/root" in str(mapped)
    auth = translate(azure_exc.ClientAuthenticationError("DefaultAzureCredential failed"), storage)
    assert isinstance(auth, CredentialsError) and "account_name=" in str(auth)
