"""The campaign's seeded sampling of crash sweeps (tests/harness/sampling.py, issue 46): a draw is
reproducible from its seed, keeps every critical point, changes with the seed so that runs
together reach every point, and ``TXCKPT_FULL_SWEEP=1`` keeps all. In-process, fast tier."""

import pytest

from tests.harness import sampling
from tests.harness.crash_sweep import flips_visibility

# The file operations of a three-file save on a root with one checkpoint (tests/test_crash_sweep.py's
# "save" sweep), abridged: the ones that flip what a reader sees, and writes and fsyncs around them.
OPS = [
    "open(.txckpt/intents/4-x.json.1.tmp, wb)",
    "replace(.txckpt/intents/4-x.json.1.tmp, .txckpt/intents/4-x.json)",
    "mkdir(.txckpt/tx/4-x, fd)",
    "open(4-x/checkpoint-4/model.safetensors, wb)",
    "write(4-x/checkpoint-4/model.safetensors, 387)",
    "fsync(fd)",
    "open(4-x/checkpoint-4/.txckpt-manifest.json.2.tmp, wb)",
    "link(4-x/checkpoint-4/.txckpt-manifest.json.2.tmp, 4-x/checkpoint-4/txckpt-manifest.json)",
    "unlink(4-x/checkpoint-4/.txckpt-manifest.json.2.tmp)",
    "link(.txckpt/log/.00000000000000000003.json.3.tmp, .txckpt/log/00000000000000000003.json)",
    "replace(count/.txckpt/latest.4.tmp, count/.txckpt/latest)",
    "rename_noreplace(tx/4-x/checkpoint-4, w/count/checkpoint-4)",
    "unlink(.txckpt/intents/4-x.json)",
]


def test_flips_visibility_names_the_manifest_commit_latest_and_publication_steps():
    flips = [op.split("(")[0] for op in OPS if flips_visibility(op)]
    assert flips == ["link", "link", "replace", "rename_noreplace"], flips
    assert not flips_visibility(OPS[1])  # the intent's replace: no reader looks there
    assert not flips_visibility(OPS[8])  # unlinking the manifest's temp name


@pytest.fixture
def seeded(monkeypatch):
    """Set this run's seed as TXCKPT_SWEEP_SEED would (the seed is read once per process)."""
    monkeypatch.setattr(sampling, "FULL", False)

    def use(seed):
        monkeypatch.setattr(sampling, "_seed", None)
        monkeypatch.setenv("TXCKPT_SWEEP_SEED", str(seed))
        assert sampling.sweep_seed() == seed

    return use


def _points():
    return [(k, when) for k in range(1, len(OPS) + 1) for when in ("before", "after")]


def _critical(p):
    return flips_visibility(OPS[p[0] - 1])


def test_a_draw_keeps_the_critical_points_and_a_share_of_the_rest_reproducibly(seeded):
    points = _points()
    seeded(1234)
    drawn = sampling.sample("save", points, _critical)
    assert drawn == sampling.sample("save", points, _critical)  # the seed and the name decide it
    assert drawn == sorted(drawn, key=points.index)  # tried in the sweep's order
    critical = [p for p in points if _critical(p)]
    assert set(critical) | {points[0], points[-1]} <= set(drawn)
    rest = len(points) - len(critical) - 2
    assert len(drawn) == len(critical) + 2 + round(sampling.SHARE * rest) < len(points)
    assert sampling.sample("another sweep", points, _critical) != drawn  # each sweep draws its own


def test_runs_with_other_seeds_reach_every_point(seeded):
    points = _points()
    draws = []
    for seed in range(12):
        seeded(seed)
        draws.append(sampling.sample("save", points, _critical))
    assert len({tuple(d) for d in draws}) > 1
    assert set().union(*draws) == set(points)  # nothing is left out for good


def test_the_summary_names_the_seed_and_how_to_try_every_point(seeded):
    seeded(77)
    line = sampling.describe(10, 26)
    assert "10 of 26 points" in line and "TXCKPT_SWEEP_SEED=77" in line and "TXCKPT_FULL_SWEEP=1" in line
    assert sampling.describe(26, 26) == "all 26 points"


def test_full_sweep_keeps_every_point(seeded, monkeypatch):
    seeded(5)
    points = _points()
    assert sampling.sample("save", points, _critical, full=True) == points
    monkeypatch.setattr(sampling, "FULL", True)  # what TXCKPT_FULL_SWEEP=1 sets at import
    assert sampling.sample("save", points, _critical) == points
    assert sampling.describe(len(points), len(points)) == f"all {len(points)} points"


def test_the_default_seed_comes_from_the_clock_once_per_process(monkeypatch):
    monkeypatch.delenv("TXCKPT_SWEEP_SEED", raising=False)
    monkeypatch.setattr(sampling, "_seed", None)
    monkeypatch.setattr(sampling.time, "time_ns", lambda: 1_765_000_123_456_789)
    assert sampling.sweep_seed() == 456_789
    monkeypatch.setattr(sampling.time, "time_ns", lambda: 1_765_000_999_000_001)
    assert sampling.sweep_seed() == 456_789  # drawn once: every sweep of a run prints the same seed


def test_a_draw_of_a_fixed_number_without_the_ends_reaches_every_point_over_runs(seeded):
    """The incremental DCP sweep's draw (a few points a run, each costing two rank launches): the
    critical points and exactly ``at_least`` others, the ends drawn like the rest; over runs with
    other seeds every point is tried."""
    points = _points()
    critical = [p for p in points if _critical(p)]
    draws = []
    for seed in range(120):
        seeded(seed)
        drawn = sampling.sample("dcp", points, _critical, share=0.0, at_least=1, ends=False)
        assert set(critical) <= set(drawn) and len(drawn) == len(critical) + 1
        draws.append(drawn)
    assert set().union(*draws) == set(points)


def test_a_matrix_draw_takes_k_cells_a_run_and_every_cell_over_runs(seeded, monkeypatch):
    """The campaign's equivalence matrices (each cell a few runs of a training loop) try k cells a
    run, drawn by the seed: the same cells for the same seed, every cell over runs, all of them
    under TXCKPT_FULL_SWEEP=1; a cell not drawn is skipped saying how to run it."""
    cells = [(r, w, s) for r in (1, 2) for w in (0, 2) for s in ("kill", "term")]
    seen = set()
    for seed in range(60):
        seeded(seed)
        drawn = sampling.draw_cells("m", cells, 3)
        assert len(drawn) == 3 == len(set(drawn)) and drawn == sampling.draw_cells("m", cells, 3)
        seen |= set(drawn)
    assert seen == set(cells)
    seeded(7)
    left_out = next(c for c in cells if c not in sampling.draw_cells("m", cells, 3))
    with pytest.raises(pytest.skip.Exception, match="TXCKPT_FULL_SWEEP=1 runs them all"):
        sampling.skip_unless_drawn("m", cells, left_out, 3)
    monkeypatch.setattr(sampling, "FULL", True)
    assert sampling.draw_cells("m", cells, 3) == cells
    sampling.skip_unless_drawn("m", cells, left_out, 3)  # runs
