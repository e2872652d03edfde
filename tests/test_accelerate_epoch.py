"""txckpt/integrations/_accelerate/epoch.py in one process: a restart mid-epoch
(``load_state()`` then ``acc.skip_first_batches(loader, done)``) yields the batches the
uninterrupted epoch yielded next, and the torch RNG continues where the saved step left it (a
dropout draw after each batch stands for the model's). The control: stock ``Accelerator`` on the
same sequence yields another order. The end-to-end matrix (processes, workers, SIGKILL and
SIGTERM) is tests/test_resume_equivalence_accelerate.py."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402

STEPS_DONE = 3  # batches of the epoch trained before the save


def _accelerator(project, stock: bool):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from txckpt.integrations.accelerate import TransactionalAccelerator

    config = ProjectConfiguration(project_dir=str(project))
    return (
        Accelerator(cpu=True, project_config=config)
        if stock
        else TransactionalAccelerator(cpu=True, project_config=config)
    )


def _prepared(acc):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(24.0))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))


def _epoch(batches, record: list, stop_after: int | None = None, on_stop=None) -> None:
    """Each batch, then one RNG draw (the step's dropout); ``on_stop`` after batch ``stop_after``."""
    for i, (x,) in enumerate(batches, 1):
        record.append((x.tolist(), torch.rand(1).item()))
        if i == stop_after:
            on_stop()


def _run_and_restart(tmp_path, *, stock: bool, second_epoch: bool = True):
    """(what the uninterrupted run saw after the save, what the restart saw)."""
    acc = _accelerator(tmp_path / "project", stock)
    _, _, loader = _prepared(acc)
    torch.manual_seed(7)
    if second_epoch:  # an epoch before: the saved one is not the loader's first
        _epoch(loader, [])
    seen: list = []
    _epoch(loader, seen, STEPS_DONE, lambda: acc.save_state(str(tmp_path / "project" / f"step_{STEPS_DONE}")))
    _epoch(loader, seen)  # and the next epoch
    expected = seen[STEPS_DONE:]

    acc = _accelerator(tmp_path / "project", stock)  # the restart: fresh objects, other RNG state
    _, _, loader = _prepared(acc)
    torch.manual_seed(12345)
    acc.load_state(str(tmp_path / "project" / f"step_{STEPS_DONE}"))
    got: list = []
    _epoch(acc.skip_first_batches(loader, STEPS_DONE), got)
    _epoch(loader, got)
    return expected, got


@pytest.mark.parametrize("second_epoch", [False, True])
def test_a_restart_mid_epoch_continues_the_epoch_and_the_rng_exactly(tmp_path, second_epoch):
    expected, got = _run_and_restart(tmp_path, stock=False, second_epoch=second_epoch)
    assert len(got) == len(expected) == 6 - STEPS_DONE + 6
    assert got == expected


def test_the_control_stock_accelerate_restarts_into_another_order(tmp_path):
    expected, got = _run_and_restart(tmp_path, stock=True)
    assert [b for b, _ in got] != [b for b, _ in expected] or [r for _, r in got] != [r for _, r in expected]


def test_a_save_between_epochs_replays_nothing(tmp_path):
    """Saved after the epoch's last batch: the restart's next epoch draws from the restored RNG,
    as the uninterrupted run's did (no epoch-start replay)."""
    acc = _accelerator(tmp_path / "project", False)
    _, _, loader = _prepared(acc)
    torch.manual_seed(7)
    _epoch(loader, [], 6, lambda: acc.save_state(str(tmp_path / "project" / "step_6")))
    expected: list = []
    _epoch(loader, expected)

    acc = _accelerator(tmp_path / "project", False)
    _, _, loader = _prepared(acc)
    acc.load_state(str(tmp_path / "project" / "step_6"))
    got: list = []
    _epoch(loader, got)
    assert got == expected
