"""What a new user's first mistakes with an S3 root raise and print (docs/remote.md, "Using a
remote root"): no credentials, a bucket that does not exist, an endpoint that does not answer.
Each is a typed txckpt error naming the root, bucket or endpoint and saying what to do; the CLI
prints it in one line without a traceback (``-v`` adds it) and exits 1. All against the moto
server of emulators/s3.py; the unreachable endpoint is a closed port on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import txckpt
from txckpt.errors import CredentialsError, EndpointUnreachableError, RootNotFoundError, TxckptError
from txckpt._storage import open_storage

from .conftest import SUMMARY_LINES

pytestmark = pytest.mark.s3

_CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)


@pytest.fixture(autouse=True)
def _botocores_default_retries(monkeypatch):
    """botocore's own default (5 attempts, legacy mode), whatever the environment says."""
    for name in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_credentials(monkeypatch):
    """No credentials anywhere botocore looks (the session's fake env keeps the config files at
    /dev/null and the instance metadata service off, so nothing leaves the machine)."""
    for name in _CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    assert os.environ.get("AWS_EC2_METADATA_DISABLED") == "true"


def _options(endpoint: str, **extra):
    return {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True, **extra}


def _creds():
    return {"key": "testing", "secret": "testing"}


# ----- the API -----------------------------------------------------------------------------------
def test_no_credentials_is_a_typed_error_naming_the_root_and_what_to_set(s3_root, no_credentials):
    url, so = s3_root
    opts = _options(so["client_kwargs"]["endpoint_url"])
    for call in (
        lambda: txckpt.get_last_checkpoint(url, storage_options=opts),
        lambda: txckpt.save_checkpoint(url, 1, {"a.bin": b"x"}, storage_options=opts),
    ):
        with pytest.raises(CredentialsError) as e:
            call()
        assert e.value.root == url and e.value.endpoint == opts["client_kwargs"]["endpoint_url"]
        assert url in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)
        assert "docs/remote.md" in str(e.value)
        txckpt.forget_roots()


def test_a_missing_bucket_is_root_not_found_naming_the_bucket(s3_root):
    url, so = s3_root
    missing = "s3://no-such-bucket-txckpt/run"
    for call in (
        lambda: txckpt.get_last_checkpoint(missing, storage_options=so),
        lambda: txckpt.save_checkpoint(missing, 1, {"a.bin": b"x"}, storage_options=so),
    ):
        with pytest.raises(RootNotFoundError) as e:
            call()
        assert isinstance(e.value, FileNotFoundError)  # transformers' contract for a missing root
        assert e.value.root == missing and e.value.bucket == "s3://no-such-bucket-txckpt"
        assert "s3://no-such-bucket-txckpt" in str(e.value) and "create the bucket" in str(e.value)
        txckpt.forget_roots()
    # A key that is missing in a bucket that exists stays a plain FileNotFoundError.
    with pytest.raises(FileNotFoundError) as e:
        open_storage(url, so).read_bytes("no-such-key")
    assert not isinstance(e.value, TxckptError)


def _count_attempts(storage) -> list[str]:
    """Every HTTP attempt the storage's botocore client makes from now on (retries included)."""
    from txckpt._storage.s3.upload import run_on_loop

    run_on_loop(storage.fs, storage.fs.set_session())
    sent: list[str] = []
    storage.fs._s3.meta.events.register("before-send.s3", lambda request, **kw: sent.append(request.url))
    return sent


def test_an_unreachable_endpoint_says_how_many_attempts_it_made(closed_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's knob, named in the message
    storage = open_storage("s3://bucket/run", _options(closed_endpoint, **_creds()))
    sent = _count_attempts(storage)
    with pytest.raises(EndpointUnreachableError) as e:
        storage.read_bytes(".txckpt/latest")
    assert e.value.endpoint == closed_endpoint and e.value.root == "s3://bucket/run"
    assert e.value.attempts == len(sent) == 2, sent
    assert f"{closed_endpoint} for s3://bucket/run: 2 attempts failed" in str(e.value)
    assert "endpoint_url" in str(e.value) and "AWS_ENDPOINT_URL" in str(e.value)


def test_the_commit_write_does_not_multiply_botocores_retries(closed_endpoint, monkeypatch):
    # create_exclusive sends its conditional PUT itself and retries what may have been applied;
    # a connection that was never made was not, and botocore already retried it.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    storage = open_storage("s3://bucket/run", _options(closed_endpoint, **_creds()))
    sent = _count_attempts(storage)
    with pytest.raises(EndpointUnreachableError) as e:
        storage.create_exclusive(".txckpt/log/00000000000000000000.json", b"{}", durable=False)
    assert e.value.attempts == len(sent) == 2, sent


def test_an_unreachable_endpoint_fails_the_api_with_the_typed_error(closed_endpoint):
    url = "s3://bucket/run"
    with pytest.raises(EndpointUnreachableError) as e:
        txckpt.get_last_checkpoint(url, storage_options=_options(closed_endpoint, **_creds()))
    assert e.value.endpoint == closed_endpoint and e.value.attempts == 5  # botocore's default
    SUMMARY_LINES.append(
        f"unreachable endpoint, get_last_checkpoint: gave up after "
        f"{e.value.attempts} attempts in {e.value.seconds:.1f} s"
    )


# ----- the CLI -----------------------------------------------------------------------------------
def _cli(args: list[str], env_drop: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    started = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "txckpt", *args], env=env, capture_output=True, text=True, timeout=120)
    return p, time.monotonic() - started


@pytest.mark.parametrize("case", ["no-credentials", "missing-bucket", "unreachable"])
def test_the_cli_prints_one_line_and_exits_1(case, s3_root, closed_endpoint):
    url, so = s3_root
    endpoint = so["client_kwargs"]["endpoint_url"]
    drop: tuple[str, ...] = ()
    if case == "no-credentials":
        args, drop, expect = (
            ["log", url, "-o", f"endpoint_url={endpoint}"],
            _CREDENTIAL_VARS,
            ("CredentialsError", url, "AWS_ACCESS_KEY_ID"),
        )
    elif case == "missing-bucket":
        args, expect = (
            ["log", "s3://no-such-bucket-txckpt/run", "-o", f"endpoint_url={endpoint}"],
            ("RootNotFoundError", "s3://no-such-bucket-txckpt", "create the bucket"),
        )
    else:
        args, expect = (
            ["log", url, "-o", f"endpoint_url={closed_endpoint}"],
            ("EndpointUnreachableError", closed_endpoint, "5 attempts failed"),
        )
    p, seconds = _cli(args, drop)
    SUMMARY_LINES.append(
        f"txckpt log, {case}: exit {p.returncode} in {seconds:.1f} s, {len(p.stderr.splitlines())} line(s) on stderr"
    )
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) <= 2, p.stderr
    assert all(part in p.stderr for part in expect), p.stderr
    verbose, _ = _cli(args + ["-v"], drop)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert verbose.stderr.rstrip().splitlines()[-1].startswith(f"txckpt log: {expect[0]}: ")


def test_retries_against_an_unreachable_endpoint_are_logged_as_they_happen(closed_endpoint, monkeypatch, caplog):
    """A wrong endpoint used to be silent for the 7-10 s of botocore's retries: each retried
    attempt is logged, naming the endpoint, the request and the attempt; the first at INFO, the
    second at WARNING (shown at Python's default level); the last one raises the typed error."""
    import logging

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    caplog.set_level(logging.INFO, logger="txckpt")
    storage = open_storage("s3://bucket/run", _options(closed_endpoint, **_creds()))
    with pytest.raises(EndpointUnreachableError):
        storage.read_bytes(".txckpt/latest")
    retried = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert [r.levelname for r in retried] == ["INFO", "WARNING", "INFO"], caplog.text
    for n, r in enumerate(retried, 1):
        text = r.getMessage()
        assert closed_endpoint in text and "GetObject" in text and f"attempt {n} of 4 failed" in text
        assert "EndpointConnectionError" in text


def test_a_dropped_s3_root_frees_its_filesystem(closed_endpoint):
    """The retry-logging hook held its s3fs filesystem strongly; s3fs's weakref.finalize holds
    the client, the client its hooks: every filesystem ever opened stayed alive with its botocore
    session and service models (~40 000 objects each; `make test` grew to 22 M objects and 8.7 GB,
    and each garbage collection walked them all). A dropped root's filesystem must be freed."""
    import gc
    import weakref

    def open_and_drop():
        storage = open_storage("s3://bucket/run", _options(closed_endpoint, **_creds()))
        storage.fs.connect()  # the client and s3fs's finalizer exist (no request is sent)
        assert storage.fs._s3 is not None
        return weakref.ref(storage.fs)

    refs = [open_and_drop() for _ in range(3)]
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
