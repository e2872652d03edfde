import logging
import os

import pytest

import txckpt

# The backend fixtures (s3_server on moto, s3_root, any_root, ...) live in tests/harness/backends.py;
# the servers they start in the top-level emulators/ package. The tiers (`pytest --tier fast|test|
# campaign`) and the markers that choose them are tests/harness/tiers.py.
pytest_plugins = ["tests.harness.backends", "tests.harness.tiers"]


def count_reads(
    monkeypatch, root: txckpt.CheckpointRoot, under: str = "", methods: tuple[str, ...] = ("read_bytes",)
) -> list[str]:
    """The keys under ``under`` (a prefix inside the root) that ``root`` reads from now on
    through ``methods`` of its storage; a ``list_dir`` also adds ``<key>/<name>`` for every name
    it returns (what a listing costs grows with them)."""
    reads: list[str] = []
    for method in methods:
        original = getattr(root.storage, method)

        def counting(key, *args, _original=original, _method=method, **kwargs):
            out = _original(key, *args, **kwargs)
            if key.startswith(under):
                reads.append(key)
                if _method == "list_dir":
                    reads.extend(f"{key}/{name}" for name in out)
            return out

        monkeypatch.setattr(root.storage, method, counting)
    return reads


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Each test starts as a fresh process would: no remembered roots or lineages."""
    txckpt.forget_roots()
    yield
    txckpt.forget_roots()


@pytest.fixture(autouse=True)
def _non_durable(request, monkeypatch):
    """``pytest.mark.non_durable`` (a module's pytestmark): TXCKPT_DURABLE=0, no fsync, for tests
    whose subject is not durability (five modules had a copy of this fixture each)."""
    if request.node.get_closest_marker("non_durable") is not None:
        monkeypatch.setenv("TXCKPT_DURABLE", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "non_durable: run with TXCKPT_DURABLE=0 (tests/conftest.py)")
    # One sweep seed per run (tests/harness/sampling.py), drawn here in the controller and passed
    # on in the environment: pytest-xdist's workers (the campaign tier runs on two) and the
    # children of any test then draw from the seed the summary prints, not one each.
    if not hasattr(config, "workerinput") and not os.environ.get("TXCKPT_SWEEP_SEED", "").strip():
        from tests.harness import sampling

        os.environ["TXCKPT_SWEEP_SEED"] = str(sampling.sweep_seed())


@pytest.fixture
def no_save_left_behind():
    """Every async save a test requested is finished, and its error reported, before the next
    test starts (the async tests take it in an autouse fixture of their module)."""
    yield
    try:
        txckpt.wait_for_saves()
    except Exception:
        pass


@pytest.fixture
def closed_endpoint() -> str:
    """An http URL on loopback where nothing listens (bound, then closed): an unreachable
    endpoint for the remote-error tests."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "out")


@pytest.fixture
def txlog(caplog):
    caplog.set_level(logging.WARNING, logger="txckpt")
    return caplog


#: Lines that tests want in the run's log whatever the capture mode (crash-point counts, ...).
SUMMARY_LINES: list[str] = []
#: The lines the terminal summary prints: this process's, and under ``make test``'s parallel
#: workers (pytest-xdist) those each worker's reports carried back (``txckpt-summary`` properties).
_REPORTED: list[str] = []
_SUMMARY_KEY = "txckpt-summary"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Lines a test appended travel in its report, so a worker's lines reach the controller."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown":
        while SUMMARY_LINES:
            report.user_properties.append((_SUMMARY_KEY, SUMMARY_LINES.pop(0)))


def pytest_runtest_logreport(report):
    _REPORTED.extend(value for key, value in report.user_properties if key == _SUMMARY_KEY)


def pytest_terminal_summary(terminalreporter):
    lines = _REPORTED + SUMMARY_LINES  # SUMMARY_LINES: appended outside any test (a module fixture's teardown)
    if lines:
        terminalreporter.section("txckpt summary")
        for line in lines:
            terminalreporter.write_line(line)


def forge_snapshot(data: bytes, edit) -> bytes:
    """A ``txckpt-snapshot/3`` file's bytes after ``edit(header, body)`` changed them, with both
    digests made to match again: a snapshot that verifies on its own, to test the checks after."""
    import json

    from txckpt._log import log as commit_log
    from txckpt._base.checksum import digest_bytes

    line, _, rest = data.partition(b"\n")
    head, body = json.loads(line), json.loads(rest)
    assert head.pop("digest") and head["format"] == "txckpt-snapshot/3"
    edit(head, body)
    rest = (json.dumps(body, separators=(",", ":")) + "\n").encode()
    head["body_digest"] = digest_bytes(rest)
    return (json.dumps({**head, "digest": commit_log._digest(head)}) + "\n").encode() + rest
