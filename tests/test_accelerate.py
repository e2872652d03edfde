"""Accelerate's save_state / load_state: each failure of stock accelerate's own checkpointing is
a test here. It runs against stock ``Accelerator`` (marked xfail(strict): the test must fail
there) and against ``TransactionalAccelerator`` on a local and an S3 (moto) root, with 1 and 2
real processes (gloo). Every "run" is a fresh job; crashes SIGKILL every rank of a job."""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("accelerate")

from tests.harness import launcher
from tests.children.accelerate_workers import job  # noqa: E402

# Ranks fork from a server that imported these once (if this module starts it), instead of
# importing accelerate in every rank of every job.
for _module in ("accelerate", "txckpt.integrations.accelerate", "tests.children.accelerate_workers"):
    if _module not in launcher._PRELOAD:
        launcher._PRELOAD.append(_module)

# Every job runs in real processes (tests/harness/launcher.py), one rank or two.
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
        kind = kw.pop("kind", self.kind)
        run = launcher.launch(
            self.world,
            job,
            str(d / "results"),
            deadline=120.0,
            kind=kind,
            project=kw.pop("project", self.path("proj")),
            ops=ops,
            pid_dir=str(pid_dir),
            storage_options=self.options,
            local_dir=str(d / "scratch"),
            **kw,
        )
        if crash:
            assert all(r.killed for r in run.results), run.describe()
            return []
        assert all(r.exitcode == 0 and r.error is None for r in run.results), run.describe()
        outs = [r.ok for r in run.results]
        assert all(o == outs[0] for o in outs[1:]) or kind == "stock", outs
        return outs[0]


@pytest.fixture(params=[pytest.param(1, id="1proc"), pytest.param(2, marks=pytest.mark.distributed, id="2proc")])
def world(request):
    return request.param


@pytest.fixture(params=VARIANTS)
def runs(request, tmp_path, world):
    kind, where = request.param
    return Runs(tmp_path, kind, where, world, request)


@pytest.fixture
def local_runs(request, tmp_path, world):
    """TransactionalAccelerator jobs on a local disk (for behaviour stock has too)."""
    return Runs(tmp_path, "txckpt", "local", world, request)


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
    project = runs.path("out")  # out is the user's root: its step_N are one lineage's checkpoints
    out = runs(ops, auto=False, project=project)
    assert all(isinstance(p, str) for p in out[1::2]), out
    runs(
        [["load", runs.path("out/step_3")], ["train", 54], ["save", runs.path("out/step_4")]],
        auto=False,
        project=project,
        crash=True,
        crash_file="optimizer.bin",
    )
    after = runs([["load", runs.path("out/step_4")], ["load", runs.path("out/step_3")]], auto=False, project=project)
    assert isinstance(after[0], dict) and after[0].get("error") == "CheckpointNotFoundError", after[0]
    _loaded(after[1], 13)


def test_load_state_without_a_path_resumes_the_newest_checkpoint_of_project_dir(runs):
    """Automatic naming off, save_state(f"{project_dir}/step_{n}"): a restart's load_state()
    loads the newest committed checkpoint of project_dir's current lineage (stock raises "No
    input_dir provided and automatic checkpoint naming is disabled")."""
    project = runs.path("out")
    ops = []
    for i in range(1, 4):
        ops += [["train", 10 + i], ["save", runs.path(f"out/step_{i}")]]
    runs(ops, auto=False, project=project)
    restart = runs([["load", None]], auto=False, project=project)
    _loaded(restart[0], 13)
    # After a rollback to step_1, the restart follows the new lineage, not the highest name.
    runs(
        [["load", runs.path("out/step_1")], ["train", 21], ["save", runs.path("out/step_2")]],
        auto=False,
        project=project,
    )
    again = runs([["load", None]], auto=False, project=project)
    _loaded(again[0], 21)


def _txckpt_entries(base: str) -> list[str]:
    """Every name txckpt owns under ``base``: ``.txckpt`` and private ``.<name>.txckpt-<hex>``."""
    return sorted(
        os.path.relpath(os.path.join(d, n), base)
        for d, dirs, files in os.walk(base)
        for n in dirs + files
        if n == ".txckpt" or ".txckpt-" in n
    )


def test_save_state_into_directories_of_their_own_never_makes_a_root_outside_project_dir(local_runs):
    """accelerate's idioms: save_state("initial") (relative), a tempfile.mkdtemp() directory
    whose name ends in digits, nested directories, a re-save into the same directory. Each loads
    back what was saved into it (by TransactionalAccelerator and by stock Accelerator), and no
    directory other than project_dir ever receives .txckpt (or any txckpt file but the
    checkpoint's own txckpt-manifest.json and, of a 2-process save, its txckpt-parts/)."""
    runs = local_runs
    base = runs.base
    cwd, tmp = os.path.join(base, "cwd"), os.path.join(base, "tmp")
    os.makedirs(cwd)
    os.makedirs(tmp)
    digits = tempfile.mkdtemp(dir=tmp, suffix="12")  # like tempfile.mkdtemp(): the dir exists, empty
    nested = os.path.join(base, "a", "b", "state")
    saves = [
        ["chdir", cwd],
        ["train", 11],
        ["save", "initial"],
        ["train", 12],
        ["save", digits],
        ["train", 13],
        ["save", nested],
        ["train", 14],
        ["save", "initial"],
    ]
    out = runs(saves, auto=False, project=None)
    assert out[2] == out[8] == os.path.join(cwd, "initial") and out[4] == digits and out[6] == nested, out
    for kind in ("txckpt", "stock"):
        loads = runs(
            [["chdir", cwd], ["load", "initial"], ["load", digits], ["load", nested]],
            auto=False,
            project=None,
            kind=kind,
        )
        _loaded(loads[1], 14)
        _loaded(loads[2], 12)
        _loaded(loads[3], 13)
    assert _txckpt_entries(base) == [], _txckpt_entries(base)
    assert sorted(os.listdir(tmp)) == [os.path.basename(digits)]
    # With a project_dir, only it becomes a root: its step_N are checkpoints of one lineage;
    # a step-named directory elsewhere and a name without a step inside it are directories of their own.
    project = os.path.join(base, "proj")
    elsewhere = tempfile.mkdtemp(dir=tmp, prefix="step_", suffix="7")
    out = runs(
        [
            ["train", 21],
            ["save", os.path.join(project, "step_1")],
            ["train", 22],
            ["save", os.path.join(project, "final")],
            ["train", 23],
            ["save", elsewhere],
            ["train", 24],
            ["save", os.path.join(base, "other", "step_5")],
        ],
        auto=False,
        project=project,
    )
    assert all(isinstance(p, str) for p in out[1::2]), out
    assert _txckpt_entries(base) == ["proj/.txckpt"], _txckpt_entries(base)
    loads = runs(
        [["load", None], ["load", os.path.join(project, "final")], ["load", elsewhere]], auto=False, project=project
    )
    _loaded(loads[0], 21)
    _loaded(loads[1], 22)
    _loaded(loads[2], 23)


def test_crash_mid_save_of_a_directory_of_its_own_leaves_its_previous_content_whole(local_runs):
    """SIGKILL while save_state("state") writes optimizer.bin over a committed "state": the
    directory still holds the previous save, whole (stock: the new model beside the old
    optimizer); a first save killed the same way leaves no directory at all. The next save
    deletes what the killed one left."""
    runs = local_runs
    state, fresh = runs.path("state"), runs.path("fresh")
    runs([["train", 11], ["save", state]], auto=False, project=None)
    runs([["train", 22], ["save", state]], auto=False, project=None, crash=True, crash_file="optimizer.bin")
    runs([["train", 33], ["save", fresh]], auto=False, project=None, crash=True, crash_file="optimizer.bin")
    assert not os.path.exists(fresh)
    for kind in ("txckpt", "stock"):
        after = runs([["load", state]], auto=False, project=None, kind=kind)
        _loaded(after[0], 11)
    out = runs(
        [["train", 44], ["save", state], ["save", fresh], ["load", state], ["load", fresh]], auto=False, project=None
    )
    _loaded(out[3], 44)
    _loaded(out[4], 44)
    assert sorted(os.listdir(runs.base)) == ["fresh", "state"], os.listdir(runs.base)
