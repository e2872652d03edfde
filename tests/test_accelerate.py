"""Accelerate's save_state / load_state: each failure of stock accelerate's own checkpointing is
a test here. It runs against stock ``Accelerator`` (marked xfail(strict): the test must fail
there) and against ``TransactionalAccelerator`` on a local and an S3 (moto) root, with 1 and 2
real processes (gloo). Every "run" is a fresh job; crashes SIGKILL every rank of a job."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("accelerate")

from tests import dist_workers as dw  # noqa: E402
from tests.accelerate_workers import job  # noqa: E402

# Ranks fork from a server that imported these once (if this module starts it), instead of
# importing accelerate in every rank of every job.
for _module in ("accelerate", "txckpt.integrations.accelerate", "tests.accelerate_workers"):
    if _module not in dw._PRELOAD:
        dw._PRELOAD.append(_module)

# Every job runs in real processes (tests/dist_workers.py), one rank or two.
pytestmark = pytest.mark.process

STOCK_FAILS = pytest.mark.xfail(strict=True, reason="stock accelerate has this failure (the issue)")
VARIANTS = [
    pytest.param(("stock", "local"), marks=STOCK_FAILS, id="stock-local"),
    pytest.param(("txckpt", "local"), id="txckpt-local"),
    pytest.param(("txckpt", "s3"), marks=pytest.mark.s3, id="txckpt-s3"),
]


class Runs:
    """Launches the jobs of one test: same kind, base directory or URL, and world size."""

    def __init__(self, tmp_path, kind: str, where: str, world: int, request):
        self.tmp_path, self.kind, self.world = tmp_path, kind, world
        self.n = 0
        if where == "s3":
            url, self.options = request.getfixturevalue("s3_root")
            self.base = url
        else:
            self.base, self.options = str(tmp_path / "base"), None
            os.makedirs(self.base)

    def path(self, rel: str) -> str:
        return self.base.rstrip("/") + "/" + rel if "://" in self.base else os.path.join(self.base, rel)

    def __call__(self, ops: list, *, crash: bool = False, **kw) -> list:
        self.n += 1
        d = self.tmp_path / f"job{self.n}"
        pid_dir = d / "pids"
        os.makedirs(pid_dir)
        run = dw.launch(self.world, job, str(d / "results"), deadline=120.0, kind=self.kind,
                        project=kw.pop("project", self.path("proj")), ops=ops, pid_dir=str(pid_dir),
                        storage_options=self.options, local_dir=str(d / "scratch"), **kw)
        if crash:
            assert all(r.killed for r in run.results), run.describe()
            return []
        assert all(r.exitcode == 0 and r.error is None for r in run.results), run.describe()
        outs = [r.ok for r in run.results]
        assert all(o == outs[0] for o in outs[1:]) or self.kind == "stock", outs
        return outs[0]


@pytest.fixture(params=[pytest.param(1, id="1proc"), pytest.param(2, marks=pytest.mark.distributed, id="2proc")])
def world(request):
    return request.param


@pytest.fixture(params=VARIANTS)
def runs(request, tmp_path, world):
    kind, where = request.param
    return Runs(tmp_path, kind, where, world, request)


def _loaded(obs, tag: float) -> None:
    """A load observed model, optimizer and custom object of the save tagged ``tag``."""
    assert isinstance(obs, dict) and "error" not in obs, obs
    assert obs["uniform"] and obs == {"model": tag, "uniform": True, "lr": tag, "custom": tag}, obs


def _four_saves(runs, **kw) -> list:
    """Run A: checkpoints 0..3 tagged 10..13; returns the paths save_state returned."""
    ops = []
    for i in range(4):
        ops += [["train", 10 + i], ["save", None]]
    out = runs(ops, **kw)
    paths = [o for o in out if o is not None]
    assert all(isinstance(p, str) for p in paths), paths
    return paths


def test_rollback_save_keeps_the_checkpoint_resumed_from(runs):
    """total_limit=2; load checkpoint_2 and set the iteration to 3: stock rotation deletes
    checkpoint_2 (the one resumed from) and then raises "already exists"."""
    paths = _four_saves(runs, total_limit=2)
    out = runs([["load", paths[2]], ["iteration", 3], ["train", 23], ["save", None]], total_limit=2)
    _loaded(out[0], 12)
    assert isinstance(out[3], str), out[3]  # the save succeeded
    # The checkpoint resumed from is intact, and the new one holds the new run's state.
    again = runs([["load", out[3]], ["load", paths[2]]], total_limit=2)
    _loaded(again[0], 23)
    _loaded(again[1], 12)


def test_rollback_then_latest_is_the_new_run(runs):
    """total_limit=2, iteration left alone: stock rotation deletes the new run's own newest
    checkpoints and load_state() then picks the abandoned run's checkpoint_3."""
    paths = _four_saves(runs, total_limit=2)
    out = runs([["load", paths[2]], ["train", 31], ["save", None], ["train", 32], ["save", None]], total_limit=2)
    _loaded(out[0], 12)
    assert isinstance(out[2], str) and isinstance(out[4], str), out
    restart = runs([["load", None]], total_limit=2)
    _loaded(restart[0], 32)


def test_crash_after_rollback_before_first_save(runs):
    """A crash after load_state(older checkpoint), before any save: the restart must continue
    from the checkpoint resumed from, not the abandoned run's newest."""
    paths = _four_saves(runs)
    runs([["load", paths[2]], ["crash"]], crash=True)
    restart = runs([["load", None]])
    _loaded(restart[0], 12)


def test_crash_mid_save_never_leaves_a_partial_newest(runs):
    """A crash while save_state writes optimizer.bin: stock leaves checkpoint_2 with a model and
    no optimizer, which the next load_state() picks and fails on (FileNotFoundError)."""
    _four_saves(runs)
    # (A restarted stock job must set the iteration itself, or its save raises "already exists".)
    runs([["train", 42], ["iteration", 4], ["save", None]], crash=True, crash_file="optimizer.bin")
    restart = runs([["load", None]])
    _loaded(restart[0], 13)


def test_explicit_dir_resave_after_rollback_and_crash_never_mixes(runs):
    """save_state("out/step_N"): re-saving step 4 after a rollback to step 3 and crashing while
    writing the optimizer leaves stock's out/step_4 with the new run's model and the old run's
    optimizer, loaded silently. Here step 4 of the new run never committed: out/step_4 is not a
    checkpoint of the current lineage (CheckpointNotFoundError), and step 3 loads whole."""
    ops = []
    for i in range(1, 5):
        ops += [["train", 10 + i], ["save", runs.path(f"out/step_{i}")]]
    out = runs(ops, auto=False)
    assert all(isinstance(p, str) for p in out[1::2]), out
    runs([["load", runs.path("out/step_3")], ["train", 54], ["save", runs.path("out/step_4")]],
         auto=False, crash=True, crash_file="optimizer.bin")
    after = runs([["load", runs.path("out/step_4")], ["load", runs.path("out/step_3")]], auto=False)
    assert isinstance(after[0], dict) and after[0].get("error") == "CheckpointNotFoundError", after[0]
    _loaded(after[1], 13)
