"""A run whose resume cannot be exact says so at its first save (issue 32): an IterableDataset
without state_dict() (a resume re-reads it and skips what it saw: the same batches only if it
is deterministic), or ``ignore_data_skip=True``. A run that resumes exactly says nothing."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args
from txckpt.integrations.transformers import TransactionalTrainer

pytestmark = pytest.mark.trainer


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, with_state: bool = False):
        self.data = Data(0)
        if with_state:
            self.state_dict = lambda: {"position": 0}

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def warnings_of(tmp_path, caplog, dataset, **overrides):
    caplog.set_level(logging.WARNING, logger="txckpt")
    torch.manual_seed(0)
    trainer = TransactionalTrainer(
        model=TinyModel(TinyConfig()), args=make_args(str(tmp_path / "out"), 4, **overrides), train_dataset=dataset
    )
    trainer.train()
    return [r.getMessage() for r in caplog.records if "will not continue it exactly" in r.getMessage()]


def test_a_map_style_dataset_says_nothing(tmp_path, caplog):
    assert warnings_of(tmp_path, caplog, Data(0)) == []


def test_an_iterable_dataset_without_state_is_named_once(tmp_path, caplog):
    found = warnings_of(tmp_path, caplog, Stream())
    assert len(found) == 1, found  # two saves, one warning
    assert "IterableDataset (Stream) without state_dict()" in found[0]


def test_an_iterable_dataset_with_state_says_nothing(tmp_path, caplog):
    assert warnings_of(tmp_path, caplog, Stream(with_state=True)) == []


def test_ignore_data_skip_is_named(tmp_path, caplog):
    found = warnings_of(tmp_path, caplog, Data(0), ignore_data_skip=True)
    assert len(found) == 1 and "ignore_data_skip=True" in found[0], found
