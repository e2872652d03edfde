"""A fork publishes the new head's view (protocol §10 step 4): undoing a rollback gives the
restored checkpoints back their checkpoint-N names, so plain tools agree with txckpt."""

from __future__ import annotations

import os

import pytest
from transformers.trainer_utils import get_last_checkpoint as stock_get_last_checkpoint

import txckpt
from txckpt._maintenance.gc import collect_garbage
from txckpt._log.publication import manifest_txid


pytestmark = pytest.mark.non_durable  # TXCKPT_DURABLE=0 for every test here (tests/conftest.py)


def published(root: str) -> dict[int, str | None]:
    """step -> txid named by the manifest of every checkpoint-N directory."""
    r = txckpt.CheckpointRoot(root)
    return {
        int(n[len("checkpoint-") :]): manifest_txid(r.storage, n)
        for n in os.listdir(root)
        if n.startswith("checkpoint-")
    }


def view(root: str) -> dict[int, str]:
    return {c.step: c.txid for c in txckpt.CheckpointRoot(root).checkpoints()}


@pytest.mark.parametrize("undo_to", [40, 25])
def test_undoing_a_rollback_publishes_the_restored_checkpoints(tmp_path, undo_to):
    root = str(tmp_path / "out")
    for s in range(5, 45, 5):
        txckpt.save_checkpoint(root, s, {"w.bin": f"A{s}".encode()})
    txckpt.forget_roots()
    txckpt.resume(root, step=10)
    assert published(root) == view(root) and sorted(view(root)) == [5, 10]
    assert stock_get_last_checkpoint(root) == os.path.join(root, "checkpoint-10")
    abandoned = {c.step: c for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state == "abandoned"}
    assert sorted(abandoned) == [15, 20, 25, 30, 35, 40]
    assert "/.txckpt/tx/" in abandoned[undo_to].path

    txckpt.forget_roots()
    resumed = txckpt.resume(root, path=abandoned[undo_to].path)

    expected = os.path.join(root, f"checkpoint-{undo_to}")
    assert resumed == expected
    assert sorted(view(root)) == list(range(5, undo_to + 5, 5))
    # Every checkpoint of the current view holds its name, and only those do.
    assert published(root) == view(root)
    assert txckpt.get_last_checkpoint(root) == expected
    assert stock_get_last_checkpoint(root) == expected
    assert bytes(txckpt.load_checkpoint(expected)["w.bin"]) == f"A{undo_to}".encode()
    # Nothing is left for gc to complete.
    txckpt.forget_roots()
    assert [
        i
        for i in collect_garbage(txckpt.CheckpointRoot(root), dry_run=True).items
        if i.kind in ("publish", "unpublish")
    ] == []


def test_a_name_another_tool_holds_at_commit_is_moved_aside_not_overwritten(tmp_path, caplog):
    """The committer renames first (protocol §7: RENAME_NOREPLACE from its home): where
    ``checkpoint-N`` is taken by a directory another tool wrote after the save began, the
    rename fails with EEXIST, and the full publication moves that directory to
    ``.txckpt/orphans/`` whole, with a warning, before the checkpoint takes its name."""
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, {"w.bin": b"one"})
    with txckpt.transaction(root, 2) as tx:
        tx.save("w.bin", b"two")
        os.makedirs(os.path.join(root, "checkpoint-2"))
        with open(os.path.join(root, "checkpoint-2", "theirs.txt"), "w") as f:
            f.write("not txckpt's")
    assert tx.path == os.path.join(root, "checkpoint-2")
    assert published(root) == view(root) and sorted(view(root)) == [1, 2]
    with open(os.path.join(root, "checkpoint-2", "w.bin"), "rb") as f:
        assert f.read() == b"two"
    (aside,) = os.listdir(os.path.join(root, ".txckpt", "orphans"))
    with open(os.path.join(root, ".txckpt", "orphans", aside, "theirs.txt")) as f:
        assert f.read() == "not txckpt's"
    assert any("no committed txckpt manifest" in r.getMessage() for r in caplog.records)
