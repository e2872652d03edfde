"""CHANGELOG.md keeps up with the code (issue 46): it opens with an "Unreleased" section, has a
section for the version installed (which pyproject.toml and ``txckpt.__version__`` agree on), says
when the version changes, and names every on-disk format string the package writes or reads, so a
new format cannot land without its line. In-process, fast tier."""

import os
import re

import pytest

import txckpt

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(HERE, *parts), encoding="utf-8") as f:
        return f.read()


def _versions() -> list[str]:
    return re.findall(r"^## (Unreleased|\d+\.\d+\.\d+)\b", _read("CHANGELOG.md"), re.M)


def test_changelog_opens_with_unreleased_then_the_installed_version():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    assert declared == txckpt.__version__
    versions = _versions()
    assert versions[:2] == ["Unreleased", txckpt.__version__], versions


def test_changelog_states_the_versioning_policy():
    text = _read("CHANGELOG.md")
    policy = text[text.index("## Versions") : text.index("## Unreleased")]
    for word in ("**patch**", "**minor**", "**major**", "format", "reader", "docs/api.md", "Breaking"):
        assert word in policy, word


def test_every_format_the_package_knows_is_in_the_changelog():
    formats = set()
    for dirpath, _dirnames, filenames in os.walk(os.path.join(HERE, "txckpt")):
        for name in filenames:
            if name.endswith(".py"):
                formats |= set(re.findall(r"txckpt-[a-z-]+/\d+", _read(dirpath, name)))
    assert {"txckpt-manifest/2", "txckpt-log/2", "txckpt-dcp-items/2"} <= formats, formats  # the scan works
    text = _read("CHANGELOG.md")
    missing = sorted(f for f in formats if f"`{f}`" not in text)
    assert not missing, f"CHANGELOG.md does not mention {missing}: add them to its formats table"
