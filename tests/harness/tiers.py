"""The test suite's three tiers, chosen by cost, and the guard that keeps the fast one honest.

    make test-fast   pytest --tier fast: in-process only, no child process, no server, no
                     real Trainer; the inner loop (< 2 minutes).
    make test        pytest --tier test: what every change runs, README's command (< 15 minutes).
    make campaign    pytest --tier campaign: the reliability campaign, the crash sweeps,
                     DeepSpeed, the GCS and Azure rows, then the Trainer tests on transformers
                     4.57 (< 25 minutes together; the reliability campaign alone, then
                     the rest on two xdist workers: the Makefile says why).

``--tier`` adds the tier's marker expression (TIERS below) to any ``-m`` given, so
``pytest --tier fast -k lookup`` is the fast part of the lookup tests.

A test says what it costs with a marker; this plugin adds the markers a test's fixtures already
imply, so nobody has to repeat them:
- ``server``: it uses a server (``s3_server``, ``gcs_server``, ``azure_server``, ``seaweedfs_cluster`` or a root built on
  one; the ``s3``/``gcs``/``azure``/``seaweedfs`` markers);
- ``process``: it starts a child process: ``distributed`` implies it, and so does a test whose
  code (or a function or fixture of its module that it calls or takes) names one of the suite's
  process starters (``SPAWNERS``: subprocess, run_child, launch, torchrun, sweep, ...); a test
  that starts one another way says ``@pytest.mark.process``;
- ``campaign``: a long campaign: every ``slow`` test (crash sweeps, soaks, the reliability
  campaign), the DeepSpeed tests, and the ``gcs``, ``azure`` and ``seaweedfs`` rows.

Nothing is trusted blindly: under ``--tier fast`` every fork, exec, spawn and listening
socket a test makes fails it with a message naming the marker it lacks, so a test that starts a
process cannot hide in the fast tier.
"""

from __future__ import annotations

import ast
import inspect
import os
import socket
import subprocess
from functools import lru_cache

import pytest

try:  # what subprocess and multiprocessing's spawn both call to start a child
    import _posixsubprocess
except ImportError:  # not POSIX: the guard then covers fork and spawn only
    _posixsubprocess = None  # type: ignore[assignment]

TIERS = {
    # The real Trainer costs seconds a test (29 of the 40 slowest in-process tests): not the inner loop.
    "fast": "not (campaign or process or server or slow or trainer)",
    "test": "not campaign",
    "campaign": "campaign",
}

#: Fixtures that start (or stand on) a server of their own.
SERVER_FIXTURES = frozenset({"s3_server", "gcs_server", "azure_server", "seaweedfs_cluster"})
#: Markers that imply another marker.
IMPLIED = {
    "s3": ("server",),
    "gcs": ("server", "campaign"),
    "azure": ("server", "campaign"),
    "seaweedfs": ("server", "campaign"),
    "distributed": ("process",),
    "slow": ("campaign",),
}


#: Names whose use starts a child process: the standard library's and the suite's own starters
#: (tests/harness/procs.py, tests/harness/launcher.py, tests/harness/crash_sweep.py, tests/harness/zygote.py,
#: the campaign's runner).
SPAWNERS = frozenset(
    {
        "subprocess",
        "Popen",
        "fork",
        "forkpty",
        "posix_spawn",
        "multiprocessing",
        "get_context",
        "run_child",
        "child_value",
        "torchrun",
        "run_torchrun",
        "launch",
        "run_in_fresh_process",
        "sweep",
        "count_ops",
        "run_cases",
        "run_python",
        "popen_python",
    }
)


@lru_cache(maxsize=None)
def _spawning_functions(path: str) -> frozenset[str]:
    """The module-level functions of the test module at ``path`` that start a child process:
    those naming a spawner, and those calling (or naming) such a function, to a fixed point."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return frozenset()
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            used = names[node.name] = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    used.add(sub.id)
                elif isinstance(sub, ast.Attribute):
                    used.add(sub.attr)
                elif isinstance(sub, ast.arg):  # a fixture it takes
                    used.add(sub.arg)
    spawning = {fn for fn, used in names.items() if used & SPAWNERS}
    while True:
        more = {fn for fn, used in names.items() if fn not in spawning and used & spawning}
        if not more:
            return frozenset(spawning)
        spawning |= more


def _starts_a_process(item) -> bool:
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return False
    spawning = _spawning_functions(path) if path else frozenset()
    return fn.__name__ in spawning or bool(spawning & set(getattr(item, "fixturenames", ())))


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--tier",
        choices=sorted(TIERS),
        default=None,
        help="run one tier of the suite: " + "; ".join(f"{k}: -m '{v}'" for k, v in TIERS.items()),
    )


def pytest_configure(config) -> None:
    tier = config.getoption("--tier")
    if tier:
        given = config.option.markexpr
        config.option.markexpr = f"({TIERS[tier]}) and ({given})" if given else TIERS[tier]
    config.addinivalue_line(
        "markers", "campaign: a long campaign, run by `make campaign` only (tests/harness/tiers.py)"
    )
    config.addinivalue_line("markers", "process: starts a child process: not in `make test-fast`")
    config.addinivalue_line(
        "markers", "server: uses a server (moto, fake-gcs-server, Azurite): not in `make test-fast`"
    )


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            names.add("server")
        if "process" not in names and _starts_a_process(item):
            names.add("process")
        added: set[str] = set()
        for name in list(names):
            added.update(IMPLIED.get(name, ()))
        before = {m.name for m in item.iter_markers()}
        for name in sorted((names | added) - before):
            item.add_marker(name)


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call" and outcome.get_result().failed:
        item.stash[_CALL_FAILED] = True


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
    """Under ``--tier fast`` (this session's option, not an environment variable: a pytest run
    in-process, as tests/test_tiers.py makes, must not leave its tier to the run around it),
    refuse forks, execs, spawns and listening sockets; fail the
    test (also when the refusal happened on a thread that swallowed it).

    TXCKPT_TIER_AUDIT=<file> instead lets them happen and appends a line per test that made one
    to the file: how a new module's tests are found that need a marker."""
    audit = os.environ.get("TXCKPT_TIER_AUDIT")
    if request.config.getoption("--tier") != "fast" and not audit:
        yield
        return
    refused: list[str] = []

    def refuse(what: str, marker: str, original):
        def refusing(*args, **kwargs):
            if audit:
                if not refused:
                    with open(audit, "a") as f:
                        f.write(f"{request.node.nodeid}\t{marker}\t{what}\n")
                refused.append(what)
                return original(*args, **kwargs)
            refused.append(f"{what}: mark it `{marker}` (tests/harness/tiers.py)")
            # pytest's Failed is a BaseException: library code's `except Exception` lets it by.
            pytest.fail(refused[-1], pytrace=False)

        return refusing

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name} in the fast tier", "process", getattr(os, name)))
    if _posixsubprocess is not None:
        child = refuse("a child process in the fast tier", "process", _posixsubprocess.fork_exec)
        monkeypatch.setattr(_posixsubprocess, "fork_exec", child)
        if hasattr(subprocess, "_fork_exec"):  # the name subprocess bound at its import (3.11+)
            monkeypatch.setattr(subprocess, "_fork_exec", child)
    monkeypatch.setattr(
        socket.socket, "listen", refuse("a listening socket in the fast tier", "server", socket.socket.listen)
    )
    yield
    if refused and not audit and not request.node.stash.get(_CALL_FAILED, False):  # swallowed on the way
        pytest.fail(f"{request.node.nodeid}: {refused[0]}", pytrace=False)
