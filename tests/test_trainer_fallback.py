"""A Trainer restart past a damaged newest checkpoint (``txckpt_on_damaged``), through the real
Trainer (tiny model, CPU), on a local output_dir and on an S3 root (moto server)."""

import logging
import os
from pathlib import Path

import fsspec
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import txckpt  # noqa: E402
import txckpt._read.fetch  # noqa: E402
from txckpt.errors import IntegrityError, InvalidArgumentError  # noqa: E402
from txckpt.integrations.transformers import TransactionalTrainer  # noqa: E402

from .harness.fs import flip_byte  # noqa: E402

from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args  # noqa: E402

pytestmark = pytest.mark.trainer
WEIGHTS = "model.safetensors"


class Begin(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def train(out, max_steps, resume=None, **mixin):
    torch.manual_seed(0)
    begin = Begin()
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()),
        args=make_args(str(out), max_steps),
        train_dataset=Data(0),
        callbacks=[begin],
        **mixin,
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.begin_step = begin.steps[0]
    return trainer


def checkpoints(root, opts=None, lineage="current"):
    txckpt.forget_roots()
    return {
        (c.step if lineage == "current" else c.txid): c for c in txckpt.CheckpointRoot(root, opts).checkpoints(lineage)
    }


def test_a_restart_falls_back_past_a_damaged_newest_checkpoint(tmp_path, caplog):
    out = tmp_path / "out"
    train(out, 6)
    before = checkpoints(str(out))
    assert sorted(before) == [2, 4, 6]
    victim = out / "checkpoint-6" / WEIGHTS
    flip_byte(victim, from_end=5, mask=0x01)
    damaged_bytes = victim.read_bytes()

    # The default: the restart refuses, naming the file and the way out.
    txckpt.forget_roots()
    with pytest.raises(IntegrityError) as e:
        train(out, 6, resume=True)
    assert e.value.path == str(victim) and "txckpt_on_damaged" in str(e.value)
    assert checkpoints(str(out))[6].txid == before[6].txid  # nothing changed

    txckpt.forget_roots()
    caplog.set_level(logging.WARNING, logger="txckpt")
    t = train(out, 6, resume=True, txckpt_on_damaged="fallback")
    assert t.begin_step == 4
    (warning,) = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "failed verification" in r.getMessage()
    ]
    assert f"checkpoint-6 (txid {before[6].txid})" in warning and f"checkpoint-6/{WEIGHTS}" in warning
    after = checkpoints(str(out))
    assert sorted(after) == [2, 4, 6] and after[4].txid == before[4].txid
    assert after[6].txid != before[6].txid  # its next save of step 6 committed
    txckpt.verify_checkpoint(after[6].path)
    old = checkpoints(str(out), lineage="all")[before[6].txid]
    assert old.state == "abandoned" and old.path is not None
    assert Path(old.path, WEIGHTS).read_bytes() == damaged_bytes  # kept, untouched, on disk


def test_the_option_is_checked_at_construction(tmp_path):
    with pytest.raises(InvalidArgumentError, match="on_damaged"):
        TransactionalTrainer(
            model=TinyModel(TinyConfig()),
            args=make_args(str(tmp_path), 2),
            train_dataset=Data(0),
            txckpt_on_damaged="ignore",
        )


@pytest.mark.s3
def test_a_remote_restart_falls_back_and_downloads_what_it_loads_once(tmp_path, s3_root, monkeypatch):
    from txckpt._storage import open_storage

    url, opts = s3_root
    out = tmp_path / "out"
    mixin = {"txckpt_root": url, "txckpt_storage_options": opts}
    train(out, 6, **mixin)
    before = checkpoints(url, opts)
    fs, key = fsspec.core.url_to_fs(f"{before[6].path}/{WEIGHTS}", **opts)
    data = bytearray(fs.cat_file(key))
    data[-5] ^= 0x01
    fs.pipe_file(key, bytes(data))

    downloads: list[tuple[str, str]] = []
    copy = txckpt._read.fetch.copy_hashing  # checksum's hash-while-copy loop, as the fetch calls it

    def counting(reader, target, **kw):
        scratch = os.path.dirname(target.name)
        while not os.path.basename(scratch).startswith(".txckpt-fetch-"):
            scratch = os.path.dirname(scratch)
        downloads.append((os.path.basename(os.path.dirname(scratch)), os.path.relpath(target.name, scratch)))
        return copy(reader, target, **kw)

    monkeypatch.setattr(txckpt._read.fetch, "copy_hashing", counting)
    txckpt.forget_roots()
    t = train(out, 6, resume=True, **mixin, txckpt_on_damaged="fallback")
    assert t.begin_step == 4
    loaded = [name for txid, name in downloads if txid == before[4].txid]
    assert WEIGHTS in loaded and len(loaded) == len(set(loaded))  # each file of it fetched once
    assert {txid for txid, _ in downloads} == {before[4].txid, before[6].txid}
    after = checkpoints(url, opts)
    assert sorted(after) == [2, 4, 6] and after[6].txid != before[6].txid
    assert checkpoints(url, opts, "all")[before[6].txid].state == "abandoned"
    assert open_storage(before[6].path, opts).read_bytes(WEIGHTS) == bytes(data)
