"""The figures docs/architecture.md states are the ones its measuring command gives (issue 46:
5 of 10 claims spot-checked in the docs were stale, the hop counts among them).

One child process runs ``python -m benchmarks.hops both`` (the command the page names), and the
table's "now" rows must equal its counts: hops, hops into ``_storage/``, storage opens."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = {
    "load": "verified load, now (one storage question per file: `read_location`)",
    "save": (
        "synchronous save, now (rename-first publication, no phase records below DEBUG, "
        "chunk digests in the hashing writer)"
    ),
    "incremental": "incremental save of an unchanged state, now (the log fold extends a copy of the history it had handed out)",
}

pytestmark = pytest.mark.process


def _stated() -> dict[str, tuple[int, int, int]]:
    text = open(os.path.join(HERE, "docs", "architecture.md")).read()
    out = {}
    for mode, row in ROWS.items():
        m = re.search(rf"^\| {re.escape(row)} \| (\d+) \| (\d+) \| (\d+)", text, re.M)
        assert m, f"docs/architecture.md has no row '{row}'"
        out[mode] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return out


def test_the_hop_table_is_what_the_command_counts():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.hops", "both"], cwd=HERE, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    measured = {}
    for m in re.finditer(
        r"^(\w+): (\d+) hops, (\d+) of them into txckpt\._storage\.\*; storage opened (\d+)", run.stdout, re.M
    ):
        measured[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
    assert measured == _stated(), run.stdout
