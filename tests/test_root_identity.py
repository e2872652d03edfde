"""One root, however it is spelled (issue 29, item 2): a directory reached through a symlink, a
``..`` segment, a trailing slash or a relative path is one root in a process, with one writer
session, one async saver and one root cache entry. Each spelling still gets paths in its own
spelling back (protocol §6: what ``get_last_checkpoint`` and saves return)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

import txckpt
from txckpt._async import asyncsave
from txckpt._save import transactions
from txckpt.errors import RootNotFoundError
from txckpt._log.identity import root_key

pytestmark = pytest.mark.non_durable


@pytest.fixture
def spellings(tmp_path):
    """``(real, link)``: a root directory and a symlink to it."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    return str(real), str(link)


@pytest.fixture
def held_save(monkeypatch):
    """The background save waits at its first file write until a caller waits for it: the
    writes go on only once another call found the pending save of its root (no sleeps). A call
    that does not wait for it sees the save still pending."""
    release, reached = threading.Event(), threading.Event()
    write, wait = transactions.write_object, asyncsave._Saver.wait

    def write_object(name, obj, out):
        if threading.current_thread().name.startswith("txckpt-async-save"):  # the background only
            reached.set()
            release.wait()
        return write(name, obj, out)

    def waits_for_it(saver):
        release.set()
        return wait(saver)

    monkeypatch.setattr(transactions, "write_object", write_object)
    monkeypatch.setattr(asyncsave._Saver, "wait", waits_for_it)
    yield reached
    release.set()


@pytest.fixture(autouse=True)
def _no_save_left_behind(no_save_left_behind):  # tests/conftest.py
    yield


def files(step: int) -> dict:
    return {"state.json": {"step": step}}


def steps(path: str | None) -> int | None:
    return None if path is None else txckpt.load_checkpoint(path)["state.json"]["step"]


def test_saving_through_a_symlink_and_the_real_path_is_one_writer(spellings):
    real, link = spellings
    txckpt.save_checkpoint(real, 1, files(1))
    txckpt.save_checkpoint(link, 2, files(2))
    # Before: the link was a second writer session, which claimed the lineage; the real path's
    # session was then stale and this save raised StaleLineageError.
    txckpt.save_checkpoint(real, 3, files(3))
    assert steps(txckpt.get_last_checkpoint(link)) == 3
    root = txckpt.open_root(real)
    assert [c.step for c in root.checkpoints()] == [1, 2, 3]
    assert len(root.history().state.lineages) == 1  # no fork, no second lineage


def test_a_lookup_through_a_symlink_waits_for_the_async_save_of_the_real_path(spellings, held_save):
    real, link = spellings
    txckpt.save_checkpoint(real, 1, files(1))
    future = txckpt.async_save(real, 2, files(2))
    held_save.wait()
    last = txckpt.get_last_checkpoint(link)
    assert future.done()  # before: the link had no pending save, the lookup read step 1
    assert steps(last) == 2
    assert last == os.path.join(link, "checkpoint-2")  # in the spelling it was asked in


def test_a_synchronous_save_through_a_symlink_runs_after_the_pending_async_save(spellings, held_save):
    real, link = spellings
    txckpt.save_checkpoint(real, 1, files(1))
    future = txckpt.async_save(real, 2, files(2))
    held_save.wait()
    path = txckpt.save_checkpoint(link, 3, files(3))
    assert future.done()
    assert steps(future.result()) == 2  # before: StaleLineageError, the link's session claimed it
    assert steps(path) == 3
    txckpt.wait_for_saves()
    assert [c.step for c in txckpt.open_root(real).checkpoints()] == [1, 2, 3]


def test_each_spelling_gets_paths_in_its_own_spelling(spellings):
    real, link = spellings
    assert txckpt.save_checkpoint(real, 1, files(1)) == os.path.join(real, "checkpoint-1")
    assert txckpt.save_checkpoint(link, 2, files(2)) == os.path.join(link, "checkpoint-2")
    assert txckpt.async_save(link, 3, files(3)).result() == os.path.join(link, "checkpoint-3")
    assert txckpt.get_last_checkpoint(real) == os.path.join(real, "checkpoint-3")
    assert [c.path for c in txckpt.open_root(link).checkpoints()] == [
        os.path.join(link, f"checkpoint-{n}") for n in (1, 2, 3)
    ]


def test_dot_dot_trailing_slash_and_relative_spellings_name_one_root(spellings, monkeypatch):
    real, link = spellings
    parent, name = os.path.split(real)
    monkeypatch.chdir(parent)
    others = [real + "/", os.path.join(link, "..", name), name, "./" + name + "/", os.path.join(link, ".")]
    keys = {root_key(s, None) for s in [real, link, *others]}
    assert len(keys) == 1
    txckpt.save_checkpoint(real, 1, files(1))
    for step, spelling in enumerate(others, start=2):
        txckpt.save_checkpoint(spelling, step, files(step))  # no StaleLineageError on any
    assert steps(txckpt.get_last_checkpoint(link)) == len(others) + 1


def test_a_symlink_to_a_root_not_created_yet_is_that_root(tmp_path):
    real, link = tmp_path / "later" / "run", tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)  # dangling until the first save creates it
    before = root_key(str(link), None)
    assert before == root_key(str(real), None)
    with pytest.raises(RootNotFoundError):  # caches the link's root before the directory exists
        txckpt.get_last_checkpoint(str(link))
    txckpt.save_checkpoint(str(real), 1, files(1))  # creates it
    assert root_key(str(link), None) == root_key(str(real), None) == before
    txckpt.save_checkpoint(str(link), 2, files(2))
    txckpt.save_checkpoint(str(real), 3, files(3))
    assert steps(txckpt.get_last_checkpoint(str(link))) == 3


def test_a_root_under_a_symlinked_parent_that_does_not_exist_yet(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "data", target_is_directory=True)
    via_link, real = str(tmp_path / "home" / "run"), str(tmp_path / "data" / "run")
    before = root_key(via_link, None)
    assert before == root_key(real, None)
    txckpt.save_checkpoint(via_link, 1, files(1))  # creates it
    assert root_key(real, None) == root_key(via_link, None) == before
    txckpt.save_checkpoint(real, 2, files(2))
    txckpt.save_checkpoint(via_link, 3, files(3))
    assert steps(txckpt.get_last_checkpoint(real)) == 3


BIND_CHILD = """
import sys, txckpt
real, bind = sys.argv[1:3]
txckpt.save_checkpoint(real, 1, {"state.json": {"step": 1}})
txckpt.save_checkpoint(bind, 2, {"state.json": {"step": 2}})
txckpt.save_checkpoint(real, 3, {"state.json": {"step": 3}})
print(txckpt.load_checkpoint(txckpt.get_last_checkpoint(bind))["state.json"]["step"])
"""


def test_a_second_mount_of_the_root_directory_is_the_same_root(tmp_path):
    """A bind mount is a second path to one directory that no symlink resolution sees (its
    realpath is its own). It takes a mount namespace of its own: ``unshare`` in a child."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to make a private bind mount")
    real, bind = tmp_path / "real", tmp_path / "bind"
    real.mkdir()
    bind.mkdir()
    mount = [
        unshare,
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        'mount --bind "$1" "$2" && shift 2 && exec "$@"',
        "sh",
        str(real),
        str(bind),
    ]
    probe = subprocess.run([*mount, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private bind mount here: {probe.stderr.strip()}")
    env = dict(os.environ, TXCKPT_DURABLE="0")
    out = subprocess.run(
        [*mount, sys.executable, "-c", BIND_CHILD, str(real), str(bind)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr  # before: StaleLineageError at the third save
    assert out.stdout.split() == ["3"]


def test_distinct_directories_stay_distinct_roots(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert root_key(str(a), None) != root_key(str(b), None)
    assert root_key(str(a), None) != root_key(str(a), {"anon": True})  # options are part of it
    txckpt.save_checkpoint(str(a), 5, files(5))
    txckpt.save_checkpoint(str(b), 1, files(1))  # b's own lineage: step 1 is not behind a's 5
    assert steps(txckpt.get_last_checkpoint(str(a))) == 5


def test_a_removed_directory_does_not_lend_its_identity_to_a_new_one(tmp_path):
    """Inode numbers are reused: a directory created after another one was removed may get its
    number. The identity of a path is the directory there now, never a remembered number."""
    first = tmp_path / "first"
    first.mkdir()
    k1 = root_key(str(first), None)
    shutil.rmtree(first)
    for n in range(20):  # some of these may reuse first's inode number
        d = tmp_path / f"other{n}"
        d.mkdir()
        assert root_key(str(d), None) != k1


@pytest.mark.parametrize("spelling", ["memory://idroot/a/", "memory://idroot/a", "memory://idroot/a//"])
def test_url_spellings_with_trailing_slashes_name_one_root(spelling):
    assert root_key(spelling, None) == root_key("memory://idroot/a", None)
    assert root_key(spelling, None) != root_key("memory://idroot/b", None)


def test_s3_prefix_spellings_name_one_root():
    pytest.importorskip("s3fs")
    options = {"anon": True}
    keys = {root_key(u, options) for u in ("s3://bucket/a/", "s3://bucket/a", "s3://bucket//a")}
    assert len(keys) == 1
    assert root_key("s3://bucket/ab", options) not in keys
