"""A server that answers a ranged GET with ``200`` and the whole object (HTTP allows it; some
proxies and gateways do) serves a healthy checkpoint (issue 45 item 10): the verified load took
the whole object's first bytes for each part and called the checkpoint damaged, and a restart
with on_damaged="fallback" would have abandoned it. Now the first part's ``200`` makes the reader
fetch the object in one plain GET, and a later part's ``200`` has its range taken from the body.
Against the suite's moto server, wrapped (S3Server.wrapped) to drop the Range header."""

from __future__ import annotations

import logging

import pytest
import torch

import txckpt
from txckpt._storage.s3 import store as s3_storage

pytestmark = pytest.mark.s3

PART = 1 << 20


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(s3_storage, "S3_READ_PART", PART)
    monkeypatch.setattr(s3_storage, "S3_READ_IN_FLIGHT", 3)


class _IgnoresRanges:
    """In front of moto: GETs of the big file lose their Range header (all of them, or all but a
    range starting at byte 0), so moto answers 200 with the whole object. Counts what it saw."""

    def __init__(self, app, *, except_first: bool = False, suffix: str = "/model.safetensors"):
        self.app, self.except_first, self.suffix = app, except_first, suffix
        self.dropped = self.plain = 0

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") == "GET" and environ.get("PATH_INFO", "").endswith(self.suffix):
            rng = environ.get("HTTP_RANGE")
            if rng is None:
                self.plain += 1
            elif not (self.except_first and rng.startswith("bytes=0-")):
                del environ["HTTP_RANGE"]
                self.dropped += 1
        return self.app(environ, start_response)


def _files() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "model.safetensors": {"w": torch.randn(PART // 4 * 5 + 3, generator=g)},  # 6 parts
        "trainer_state.json": {"global_step": 1},
    }


@pytest.mark.parametrize("except_first", [False, True], ids=["every-range", "after-the-first"])
def test_a_load_through_a_server_that_ignores_ranges_is_exact(s3_root, s3_server, small_parts, except_first, caplog):
    url, so = s3_root
    files = _files()
    path = txckpt.save_checkpoint(url, 1, files, storage_options=so)
    txckpt.forget_roots()
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        with s3_server.wrapped(lambda app: _IgnoresRanges(app, except_first=except_first)) as server:
            out = txckpt.load_checkpoint(path, storage_options=so)
            txckpt.verify_checkpoint(path, storage_options=so)
    assert torch.equal(out["model.safetensors"]["w"], files["model.safetensors"]["w"])
    if except_first:  # each later part (5 of them) was answered 200; its range taken from the body
        assert server.dropped >= 5
    else:  # the first 200 made the reader ask for the object in one plain GET, and stop asking ranges
        assert server.dropped == 1 and server.plain >= 1
        assert "ignores Range headers" in caplog.text
    assert "damaged" not in caplog.text


def test_a_restart_with_fallback_keeps_the_checkpoint(s3_root, s3_server, small_parts):
    url, so = s3_root
    txckpt.save_checkpoint(url, 1, {"trainer_state.json": {"global_step": 1}}, storage_options=so)
    newest = txckpt.save_checkpoint(url, 2, _files(), storage_options=so)
    txckpt.forget_roots()
    with s3_server.wrapped(_IgnoresRanges):
        assert txckpt.resume(url, storage_options=so, on_damaged="fallback") == newest
        out = txckpt.load_checkpoint(newest, storage_options=so)
    assert out["trainer_state.json"] == {"global_step": 1}


def test_a_fetch_through_a_server_that_ignores_ranges_is_exact(s3_root, s3_server, small_parts, tmp_path):
    url, so = s3_root
    files = _files()
    path = txckpt.save_checkpoint(url, 1, files, storage_options=so)
    txckpt.forget_roots()
    with s3_server.wrapped(_IgnoresRanges):
        local = txckpt.fetch_checkpoint(path, str(tmp_path / "copy"), storage_options=so)
    out = txckpt.load_checkpoint(local)
    assert torch.equal(out["model.safetensors"]["w"], files["model.safetensors"]["w"])


def test_read_ranges_cuts_its_ranges_from_a_whole_object_answer(s3_root, s3_server):
    """The Merkle proof reader (read_ranges) took the whole body of a 200 for its range."""
    url, so = s3_root
    storage = txckpt.CheckpointRoot(url, so).storage
    storage.replace("r/g", bytes(range(100)))
    with s3_server.wrapped(lambda app: _IgnoresRanges(app, suffix="/r/g")) as server:
        got = storage.read_ranges("r/g", [(10, 4), (0, 2), (96, 16)])
    assert got == [bytes(range(10, 14)), bytes([0, 1]), bytes(range(96, 100))]
    assert server.dropped == 3
