"""One process, several threads on one root (an async save's commit beside a lookup, Lightning's
AsyncCheckpointIO thread beside ModelCheckpoint's rotation): the folded log history the process
keeps per root is shared by them. A history handed out must never change under its reader when a
later fold takes in new entries, and folds from two threads must not fold the same entry twice
(both happened: ``LogCorruptError: log entry 0 follows entry 0``, found running Lightning's own
test_async_checkpoint_plugin against the plugin, 1 run in 13)."""

from __future__ import annotations

import threading

import torch

import txckpt
from txckpt._root.root import open_root


def test_a_history_handed_out_is_not_changed_by_a_later_fold(tmp_path):
    root = open_root(str(tmp_path))
    txckpt.save_checkpoint(str(tmp_path), 1, {"w.pt": torch.zeros(2)})
    first = root.history()
    seq, steps = first.state.seq, sorted(c.step for c in first.checkpoints.values())
    live = sorted(c.step for c in first.live())  # (builds the index, which a fold then extends)
    txckpt.save_checkpoint(str(tmp_path), 2, {"w.pt": torch.ones(2)})
    second = root.history()
    assert second is not first
    assert (first.state.seq, sorted(c.step for c in first.checkpoints.values())) == (seq, steps)  # as handed out
    assert sorted(c.step for c in first.live()) == live
    assert second.state.seq > seq and sorted(c.step for c in second.checkpoints.values()) == [1, 2]
    assert root.history() is second  # nothing new: the same one, no copy


def test_folds_on_two_threads_beside_commits_each_see_a_whole_log(tmp_path):
    path = str(tmp_path)
    root = open_root(path)
    txckpt.save_checkpoint(path, 0, {"w.pt": torch.zeros(2)})
    start = threading.Barrier(3)
    errors: list[BaseException] = []
    seen: list[list[int]] = [[], []]

    def fold(k: int) -> None:
        try:
            start.wait()
            for _ in range(200):
                h = root.history()
                steps = sorted(c.step for c in h.checkpoints.values())
                assert steps == list(range(len(steps))), steps  # every commit up to its seq, no other
                assert not h.entries or h.state.seq == h.entries[-1]["seq"]
                seen[k].append(len(steps))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=fold, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    start.wait()
    for step in range(1, 21):
        txckpt.save_checkpoint(path, step, {"w.pt": torch.full((2,), float(step))})
    for t in threads:
        t.join()
    assert not errors, errors
    for counts in seen:
        assert counts == sorted(counts)  # each thread's view only moves forward
    assert sorted(c.step for c in root.history().checkpoints.values()) == list(range(21))
