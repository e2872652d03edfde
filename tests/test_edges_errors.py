"""Typed errors at the edges (issue 45 item 9): each names what is wrong and what to do, and the
CLI maps it to docs/cli.md's exit code instead of printing a bare OSError."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import txckpt
from txckpt import cli, preemption
from txckpt import errors
from txckpt.errors import IntegrityError


def test_show_with_a_step_past_2_63_is_a_usage_error_like_a_negative_one(tmp_path, capsys):
    """`txckpt show --step 2**64` exited 1 (a lookup of step 0: the number wrapped), --step -1 2."""
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, {"x.json": 1})
    for step in (-1, 2**63, 2**64):
        assert cli.main(["show", root, "--step", str(step)]) == 2, step
        err = capsys.readouterr().err
        assert "usage error" in err and str(step) in err
    assert cli.main(["show", root, "--step", str(2**63 - 1)]) == 1  # a valid step, not committed
    assert "no committed checkpoint at step 9223372036854775807" in capsys.readouterr().err


def test_export_of_a_file_replaced_by_a_directory_is_damage_not_an_oserror(tmp_path, capsys):
    root, dest = str(tmp_path / "out"), str(tmp_path / "export")
    path = txckpt.save_checkpoint(root, 1, {"a.bin": b"a" * 1000, "b.json": {"k": 1}})
    os.remove(os.path.join(path, "a.bin"))
    os.mkdir(os.path.join(path, "a.bin"))
    with pytest.raises(IntegrityError, match="a.bin is a directory where the manifest lists a file") as e:
        txckpt.fetch_checkpoint(path, str(tmp_path / "fetched"))
    assert e.value.path == f"{path}/a.bin"
    assert cli.main(["export", root, "--step", "1", dest]) == 1
    err = capsys.readouterr().err
    assert "PROBLEM:" in err and "is a directory" in err and "IsADirectoryError" not in err
    assert not os.path.exists(dest)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_preemption_refuses_a_signal_no_process_can_catch(sig):
    """install(signals=(SIGKILL,)) raised a bare OSError [Errno 22] from restoring SIGKILL's handler."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(errors.SignalNotCatchableError, match=f"{sig.name} cannot be caught.*SIGTERM") as e:
        preemption.install(signals=(signal.SIGTERM, sig))
    assert e.value.signals == [int(sig)]
    assert not preemption.installed() and signal.getsignal(signal.SIGTERM) == before
    assert not [t for t in threading.enumerate() if t.name == "txckpt-preemption"]  # no watchdog left
    preemption.install(signals=(signal.SIGTERM,))  # a catchable one still installs
    preemption.uninstall()


@pytest.mark.parametrize("other_rank,this_rank", [("a", "a/b"), ("a/b", "a"), ("d/a", "d/a/b/c")])
def test_a_name_clash_with_another_ranks_file_is_a_typed_error(tmp_path, other_rank, this_rank):
    """Two ranks writing `a` and `a/b` into the shared staging: the second to create its file got
    a bare FileExistsError / IsADirectoryError. The other rank's file is put there directly (what
    its write leaves in the shared directory); this rank's own bookkeeping cannot know of it."""
    root = str(tmp_path / "out")
    prev = txckpt.save_checkpoint(root, 1, {"x.json": 1})
    with pytest.raises(errors.FileNameConflictError, match=r"written by two ranks.*Rename one of them") as e:
        with txckpt.transaction(root, 2) as tx:
            staging = tx._root.storage.local_path(tx.staging_key)
            theirs = os.path.join(staging, *other_rank.split("/"))
            os.makedirs(os.path.dirname(theirs), exist_ok=True)
            with open(theirs, "wb") as f:
                f.write(b"the other rank's")
            tx.save(this_rank, b"mine")
    shorter, longer = sorted((other_rank, this_rank), key=len)
    assert (e.value.name, e.value.nested) == (shorter, longer)
    assert txckpt.get_last_checkpoint(root) == prev
