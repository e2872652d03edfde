"""The suite's tiers (tests/harness/tiers.py): which marker a test gets from what it uses, and
the fast tier's guard, which fails a test that starts a process or a server instead of letting
it hide there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.harness import tiers

pytest_plugins = ["pytester"]

_MODULE = textwrap.dedent("""
    import subprocess, pytest
    from tests.harness.procs import run_child

    def _helper():
        return subprocess.run(["true"])

    def _indirect():
        return _helper()

    @pytest.fixture
    def spawned():
        return run_child(lambda: 1)

    def test_pure():
        assert 1 + 1 == 2

    def test_indirect():
        _indirect()

    def test_fixture(spawned):
        pass

    def test_server(s3_server):
        pass

    @pytest.mark.distributed
    def test_dist():
        pass

    @pytest.mark.slow
    def test_sweep():
        pass

    @pytest.mark.trainer
    def test_trainer():
        pass
""")


def _write(pytester):
    pytester.makeconftest(
        'pytest_plugins = ["tests.harness.tiers"]\nimport pytest\n@pytest.fixture\ndef s3_server():\n    return None\n'
    )
    pytester.makepyfile(test_mod=_MODULE)


def _markers(pytester):
    _write(pytester)
    items, _ = pytester.inline_genitems()
    return {item.name: {m.name for m in item.iter_markers()} for item in items}


def _selected(pytester, *args) -> set[str]:
    _write(pytester)
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", *args)
    return {line.split("::")[1] for line in result.outlines if line.startswith("test_mod.py::")}


def test_a_test_gets_the_markers_its_code_and_fixtures_imply(pytester):
    marks = _markers(pytester)
    assert "process" not in marks["test_pure"] and "server" not in marks["test_pure"]
    assert "process" in marks["test_indirect"]  # through two module functions
    assert "process" in marks["test_fixture"]  # through a fixture of its module
    assert "server" in marks["test_server"]
    assert "process" in marks["test_dist"]
    assert "campaign" in marks["test_sweep"]


@pytest.mark.parametrize(
    "tier,expected",
    [
        ("fast", {"test_pure"}),
        ("test", {"test_pure", "test_indirect", "test_fixture", "test_server", "test_dist", "test_trainer"}),
        ("campaign", {"test_sweep"}),
    ],
)
def test_each_tier_selects_by_cost(pytester, tier, expected):
    assert _selected(pytester, "--tier", tier) == expected


def test_the_fast_tier_fails_a_test_that_starts_a_process_it_was_not_marked_for(pytester, monkeypatch):
    # The classification cannot see a process started through a name it does not know: the
    # guard is what catches it, in the test and not silently.
    monkeypatch.setattr(tiers, "SPAWNERS", frozenset())
    tiers._spawning_functions.cache_clear()
    pytester.makeconftest('pytest_plugins = ["tests.harness.tiers"]\n')
    pytester.makepyfile(
        test_hidden=textwrap.dedent("""
        import os, socket, subprocess

        def test_hidden_child():
            subprocess.run(["true"])

        def test_swallowed_fork():
            try:
                os.fork()
            except BaseException:
                pass

        def test_hidden_server():
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()

        def test_in_process():
            assert True
    """)
    )
    result = pytester.runpytest_inprocess("--tier", "fast", "-p", "no:cacheprovider", "-rA")
    tiers._spawning_functions.cache_clear()
    # The child and the server fail their call; the swallowed fork's call passes, and the guard
    # fails its teardown; only test_in_process passes clean.
    result.assert_outcomes(passed=2, failed=2, errors=1)
    text = result.stdout.str()
    assert "PASSED test_hidden.py::test_in_process" in text
    assert "FAILED test_hidden.py::test_hidden_child" in text
    assert "mark it `process`" in text and "mark it `server`" in text


def test_a_fast_tier_run_in_process_leaves_the_run_around_it_free_to_start_processes(pytester):
    # --tier fast once set an environment variable the guard read: a pytest run in-process
    # (the test above) then refused every later test's children in the outer run.
    pytester.makeconftest('pytest_plugins = ["tests.harness.tiers"]\n')
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    pytester.runpytest_inprocess("--tier", "fast", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
