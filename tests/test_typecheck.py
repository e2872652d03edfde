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

SNIPPET = """
import os


def needs_int(n: int) -> int:
    return n + 1


def annotated() -> int:
    return needs_int(os.environ.get("STEP"))


def unannotated():
    return needs_int(os.environ.get("STEP"))
"""


def test_mypy_config_rejects_optional_str_as_int(tmp_path):
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    # The repository's config, applied to the snippet instead of its `files`.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            os.path.join(HERE, "pyproject.toml"),
            "--no-incremental",
            str(snippet),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    # One in the annotated function, one in the unannotated one (check_untyped_defs).
    assert len(errors) == 2, r.stdout
    assert all('"str | None"' in e and '"int"' in e for e in errors), r.stdout


def test_package_ships_py_typed():
    import txckpt

    assert os.path.isfile(os.path.join(os.path.dirname(txckpt.__file__), "py.typed"))


# The public modules (issue 46): the modules users import, checked as `mypy --strict` would.
STRICT_MODULES = {
    "txckpt",
    "txckpt.errors",
    "txckpt.preemption",
    "txckpt.integrations.transformers",
    "txckpt.integrations.accelerate",
    "txckpt.integrations.dcp",
    "txckpt.cli",
}
# `strict`'s per-module flags (mypy cannot set `strict` itself per module).
STRICT_FLAGS = {
    "disallow_any_generics",
    "disallow_subclassing_any",
    "disallow_untyped_calls",
    "disallow_untyped_defs",
    "disallow_incomplete_defs",
    "disallow_untyped_decorators",
    "warn_return_any",
    "extra_checks",
}


def _mypy_config():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["mypy"]


def test_public_modules_have_the_strict_flags():
    overrides = _mypy_config().get("overrides", [])
    for module in sorted(STRICT_MODULES):
        flags = {k for o in overrides if module in o["module"] for k, v in o.items() if v is True}
        reexport = [o["implicit_reexport"] for o in overrides if module in o["module"] and "implicit_reexport" in o]
        assert STRICT_FLAGS <= flags, (module, sorted(STRICT_FLAGS - flags))
        assert reexport == [False], (module, reexport)


def test_strict_override_rejects_an_unannotated_public_function(tmp_path):
    # A file that mypy names txckpt.errors (a public module) and one it names txckpt.other: the same
    # unannotated function is an error only in the first, and a bare `dict` too.
    pkg = tmp_path / "txckpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "def untyped(x):\n    return x\n\n\ndef bare(d: dict) -> dict:\n    return d\n"
    (pkg / "errors.py").write_text(body)
    (pkg / "other.py").write_text(body)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            os.path.join(HERE, "pyproject.toml"),
            "--no-incremental",
            "txckpt/errors.py",
            "txckpt/other.py",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert r.returncode == 1, r.stdout + r.stderr
    assert {e.split(":")[0] for e in errors} == {os.path.join("txckpt", "errors.py")}, r.stdout
    assert any("missing a type annotation" in e for e in errors), r.stdout
    assert any('Missing type arguments for generic type "dict"' in e for e in errors), r.stdout
