"""Tiered roots (issue 31 item 3, protocol §14). So far: the seam the replicator needs, a fork
appended under a given lineage id, so that one id names a lineage on both tiers."""
import pytest

from txckpt import commit, save_checkpoint
from txckpt.errors import ConcurrentWriterError
from txckpt.root import open_root


def test_a_fork_repeated_under_the_fast_tiers_lineage_id_names_the_same_lineage(tmp_path):
    fast, durable = open_root(str(tmp_path / "fast")), open_root(str(tmp_path / "durable"))
    lid = commit.new_lineage(fast)
    assert commit.new_lineage(durable, lineage_id=lid) == lid
    assert durable.state().head == fast.state().head == lid
    # The durable lineage is an ordinary one: a save commits to it.
    save_checkpoint(str(tmp_path / "durable"), 1, {"w.bin": b"1"})
    assert open_root(str(tmp_path / "durable")).state().head == lid


def test_a_replicated_fork_is_appended_once(tmp_path):
    fast, durable = open_root(str(tmp_path / "fast")), open_root(str(tmp_path / "durable"))
    lid = commit.new_lineage(fast)
    commit.new_lineage(durable, lineage_id=lid)
    seq = durable.state().seq
    with pytest.raises(ConcurrentWriterError, match=lid):
        commit.new_lineage(durable, lineage_id=lid)
    assert durable.state().seq == seq
