"""One room owns the read path (issue 28): a verified local load opens storage once, through
the factory, and passes through at most 50 module-to-module hops; a warm synchronous save opens
none and passes through at most 110 (benchmarks/hops.py defines and counts them;
docs/architecture.md records the counts)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

import txckpt
from txckpt import _storage as storage_pkg
from txckpt._storage.base import Storage

from benchmarks import hops

#: 49 before the tensor index (issue 47), whose decoding is one call into
#: txckpt._manifest.tensor_index per file that has one (the load's checkpoint has two); 47 since
#: checksum's xxh3 entry points are xxhash's C functions, not Python wrappers; 45 since a verified
#: read asks the storage one question per file (Storage.read_location), not two.
MAX_LOAD_HOPS = 45
#: 109 before format /2 (per-rank parts). It added two calls to every save, both inherent: the
#: staging check (step 7) moved from transactions (at the 600-line cap) into rankparts, beside
#: its per-part form, and the commit entry's file count and bytes are the manifest's to say (a /2
#: manifest holds them for the parts it does not list).
#: 112 before the tensor index (issue 47), which adds about 6 per file written (the save's two):
#: the indexer's construction and finish, its tap from the hashing writer per write, and the
#: index's JSON form in the report and the manifest; 123 with xxh3 called unwrapped; 112 since a
#: lone rank's report keeps its FileEntry objects (no JSON round trip), the commit publishes from
#: the home it wrote, and the writer notes its own entry's state without parsing it back; 100
#: since the publication renames first, phase records are skipped below DEBUG, only a
#: safetensors file gets a tensor indexer (the hashing writer takes chunk digests), the commit
#: entry's totals are one look and the history snapshot is finish_commit's last step.
MAX_SAVE_HOPS = 100
#: Issue 46's goal for an incremental save of an unchanged state (225 before its cuts).
MAX_INCREMENTAL_HOPS = 140


@pytest.fixture(autouse=True)
def _fresh():
    txckpt.forget_roots()
    yield
    txckpt.forget_roots()


def _opens(monkeypatch) -> list[str]:
    """Every Storage the code builds from now on: the factory's (open_storage, as the modules
    that import it name it) and any built directly (Storage.__init__)."""
    opened: list[str] = []
    real_init = Storage.__init__

    def init(self, url):
        opened.append(url)
        real_init(self, url)

    monkeypatch.setattr(Storage, "__init__", init)
    return opened


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_verified_local_load_opens_storage_once(tmp_path, monkeypatch, warm):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, hops._state(1))
    path = txckpt.save_checkpoint(root, 2, hops._state(2))
    if warm:
        txckpt.load_checkpoint(path)
    else:
        txckpt.forget_roots()  # as a fresh process: no CheckpointRoot to lean on
    calls: list[str] = []
    real_factory = storage_pkg.open_storage

    def factory(root, storage_options=None):
        calls.append(os.fspath(root))
        return real_factory(root, storage_options)

    for module in (
        "txckpt._storage",
        "txckpt._read.reader",
        "txckpt._root.root",
        "txckpt._log.identity",
        "txckpt._read.fetch",
    ):
        monkeypatch.setattr(f"{module}.open_storage", factory)
    opened = _opens(monkeypatch)
    out = txckpt.load_checkpoint(path)
    assert out[hops.FILES_NAMES[1]] == {"global_step": 2}
    assert calls == [root] and opened == [root]  # the root's storage reads the log and the checkpoint


def test_a_checkpoint_copied_out_of_its_root_opens_its_own_storage_once(tmp_path, monkeypatch):
    path = txckpt.save_checkpoint(str(tmp_path / "out"), 1, hops._state(1))
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    opened = _opens(monkeypatch)
    txckpt.load_checkpoint(copy)
    assert opened == [copy]


def test_a_warm_verified_load_makes_at_most_50_hops():
    t = hops.measure("load")
    assert t.storage_opens == 1 and t.open_storage_calls == 1
    assert t.hops <= MAX_LOAD_HOPS, (
        t.summary("load") + "\n" + "\n".join(f"{n:4d}  {a} -> {b}" for (a, b), n in t.edges.most_common())
    )


@pytest.mark.parametrize("mode, limit", [("save", MAX_SAVE_HOPS), ("incremental", MAX_INCREMENTAL_HOPS)])
def test_a_warm_save_stays_within_its_hops(mode, limit):
    # In a process of its own, as `python -m benchmarks.hops save` counts it: a test process
    # holds what earlier tests left (an async saver makes every save ask which root it is).
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.hops", mode, "--edges"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    summary = out.stdout.splitlines()[0]
    found = re.match(rf"{mode}: (\d+) hops, .* storage opened (\d+) times \((\d+) open_storage calls\)", summary)
    assert found, out.stdout
    assert found.group(2) == found.group(3) == "0", summary  # the root's storage is open already
    assert int(found.group(1)) <= limit, out.stdout


def test_the_hop_counter_counts_edges_between_modules_only():
    """Not vacuous: the operation's entry and calls inside one module are no hop; a call into
    another module is one; Storage constructions are counted."""
    from txckpt._base import layout

    t = hops.trace(lambda: layout.is_url("s3://b/k"))
    assert t.hops == 0  # is_url calls nothing of another module
    t = hops.trace(lambda: txckpt._read.reader.parse("/x/checkpoint-3"))
    assert (
        dict(t.edges)
        == {
            ("txckpt._read.reader", "txckpt._base.layout"): 1,
            ("txckpt._read.reader", "txckpt._base.naming"): 1,
            ("txckpt._base.naming", "txckpt._base.layout"): 1,
        }
        and t.hops == 3
    )
    t = hops.trace(lambda: storage_pkg.open_storage("/tmp"))
    assert (t.storage_opens, t.open_storage_calls) == (1, 1)
