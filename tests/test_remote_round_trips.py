"""Round trips of a remote load (issue 31: restores at the network's pace). On a store where every
read is a round trip (``Storage.overlap_requests``), the reads that do not depend on each other
go out together: the manifest beside the log's ``latest`` hint, the probe past the newest entry
beside that entry, and a checkpoint's small files at once. Each test holds the requests it
names at a barrier in front of moto: they pass only if they are in flight together, and one
sent after the other would wait for the barrier's timeout and fail the test."""

from __future__ import annotations

import threading

import pytest

import txckpt
from txckpt._log import log
from txckpt._base.layout import LATEST_HINT, LOG_DIR
from txckpt._base.layout import MANIFEST_NAME

pytestmark = pytest.mark.s3


class _Meet:
    """Holds the first GET of each path ending in one of ``ends`` until all of them arrived."""

    def __init__(self, app, ends: list[str]):
        self.app, self.ends = app, ends
        # Shorter than s3fs's read timeout (15 s): a held request must not be retried past the barrier.
        self.barrier = threading.Barrier(len(ends), timeout=10)
        self.met: set[str] = set()
        self.lock = threading.Lock()
        self.apart = False  # a request reached the barrier alone: they were not in flight together

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        end = next((e for e in self.ends if path.endswith("/" + e)), None)
        if environ.get("REQUEST_METHOD") == "GET" and end is not None:
            with self.lock:
                first = end not in self.met
                self.met.add(end)
            if first:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    self.apart = True
        return self.app(environ, start_response)


def _meeting(ends):
    return lambda app: _Meet(app, ends)


def _files(n_small: int) -> dict:
    return {"model.safetensors": b"m" * 1000, **{f"state-{i}.json": {"i": i} for i in range(n_small)}}


def test_a_load_reads_the_manifest_beside_the_log(s3_root, s3_server):
    url, so = s3_root
    path = txckpt.save_checkpoint(url, 1, _files(1), storage_options=so)
    txckpt.forget_roots()
    with s3_server.wrapped(_meeting([LATEST_HINT, MANIFEST_NAME])) as meet:
        out = txckpt.load_checkpoint(path, storage_options=so)
    assert out["state-0.json"] == {"i": 0}
    assert meet.met == {LATEST_HINT, MANIFEST_NAME} and not meet.apart


def test_a_lookup_probes_past_the_newest_entry_beside_reading_it(s3_root, s3_server):
    url, so = s3_root
    for step in (1, 2):
        path = txckpt.save_checkpoint(url, step, _files(1), storage_options=so)
    newest = log.list_seqs(txckpt.CheckpointRoot(url, so).storage)[-1]
    entries = [f"{LOG_DIR}/{seq:020d}.json" for seq in (newest, newest + 1)]  # the newest, the probe past it
    txckpt.forget_roots()
    with s3_server.wrapped(_meeting(entries)) as meet:
        assert txckpt.get_last_checkpoint(url, storage_options=so) == path
    assert meet.met == set(entries) and not meet.apart


def test_a_checkpoints_small_files_are_read_at_once(s3_root, s3_server):
    url, so = s3_root
    path = txckpt.save_checkpoint(url, 1, _files(5), storage_options=so)
    names = ["model.safetensors"] + [f"state-{i}.json" for i in range(5)]
    txckpt.forget_roots()
    with s3_server.wrapped(_meeting(names)) as meet:
        out = txckpt.load_checkpoint(path, storage_options=so)
    assert [out[f"state-{i}.json"] for i in range(5)] == [{"i": i} for i in range(5)]
    assert meet.met == set(names) and not meet.apart
