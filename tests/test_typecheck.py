"""The type checker's configuration is strict enough to matter (issue 15): with the repository's
own [tool.mypy] settings, a ``str | None`` passed where an ``int`` is declared is an error, also
inside a function without annotations. `.ci/run` runs the checker over txckpt itself
(`make typecheck`); this test keeps the settings from being weakened to where it would pass
anything, and checks that the package ships its PEP 561 marker."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("mypy")

SNIPPET = '''
import os


def needs_int(n: int) -> int:
    return n + 1


def annotated() -> int:
    return needs_int(os.environ.get("STEP"))


def unannotated():
    return needs_int(os.environ.get("STEP"))
'''


def test_mypy_config_rejects_optional_str_as_int(tmp_path):
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    # The repository's config, applied to the snippet instead of its `files`.
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", os.path.join(HERE, "pyproject.toml"),
         "--no-incremental", str(snippet)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    # One in the annotated function, one in the unannotated one (check_untyped_defs).
    assert len(errors) == 2, r.stdout
    assert all('"str | None"' in e and '"int"' in e for e in errors), r.stdout


def test_package_ships_py_typed():
    import txckpt

    assert os.path.isfile(os.path.join(os.path.dirname(txckpt.__file__), "py.typed"))
