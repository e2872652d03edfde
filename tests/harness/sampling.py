"""Seeded sampling of the exhaustive crash sweeps (issue 46: CI under 45 minutes with room to grow).

A sweep that kills a save before and after each of its operations tries every point when asked
(``TXCKPT_FULL_SWEEP=1``, or a sweep's own older switch such as ``TXCKPT_DCP_FULL_SWEEP=1``). In
CI it tries the points its test names as critical (the ones around which the outcome flips: the
manifest, the commit entry, the publication) and a seeded random share of the others. The seed
varies per run (from the clock) unless ``TXCKPT_SWEEP_SEED`` fixes it, and every sweep prints it
in its summary line, so:

- coverage accumulates across CI runs: over runs, every point is drawn (none is left out for good);
- a failing draw is reproduced exactly with ``TXCKPT_SWEEP_SEED=<the printed seed>``: a sweep's
  draw depends only on the seed and the sweep's name, not on which other tests ran before it;
- ``TXCKPT_FULL_SWEEP=1 pytest --tier campaign tests/test_crash_sweep.py ...`` runs them whole.
"""

from __future__ import annotations

import os
import random
import time
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

#: Every point of every sweep (the whole, offline run; README's tier table).
FULL = os.environ.get("TXCKPT_FULL_SWEEP") == "1"
#: Of the points no test marks critical, the share a sampled sweep tries (each is drawn with about
#: this probability in a run, so ~8 CI runs try a given point at least once with 98% odds).
SHARE = 0.4

_seed: int | None = None


def sweep_seed() -> int:
    """This run's seed: ``TXCKPT_SWEEP_SEED`` if set, else one drawn from the clock once per process."""
    global _seed
    if _seed is None:
        given = os.environ.get("TXCKPT_SWEEP_SEED", "").strip()
        _seed = int(given) if given else time.time_ns() % 1_000_000
    return _seed


def sample(
    name: str,
    points: Sequence[T],
    critical: Callable[[T], bool] = lambda p: False,
    *,
    full: bool = False,
    share: float = SHARE,
    at_least: int = 2,
    ends: bool = True,
) -> list[T]:
    """The points of sweep ``name`` to try, in their order: all of them under ``TXCKPT_FULL_SWEEP=1``
    or ``full``; else every point ``critical`` accepts, the first and the last (unless ``ends`` is
    false: then they are drawn like the rest), and a draw of ``share`` of the rest (at least
    ``at_least`` of them) seeded by :func:`sweep_seed` and ``name``."""
    if full or FULL or not points:
        return list(points)
    keep = {i for i, p in enumerate(points) if critical(p)} | ({0, len(points) - 1} if ends else set())
    rest = [i for i in range(len(points)) if i not in keep]
    want = min(len(rest), max(at_least, round(share * len(rest))))
    rnd = random.Random(f"{sweep_seed()}:{name}")
    return [points[i] for i in sorted(keep | set(rnd.sample(rest, want)))]


def draw_cells(name: str, cells: Sequence[T], k: int) -> list[T]:
    """The ``k`` cells of matrix ``name`` a campaign run tries (all of them under
    ``TXCKPT_FULL_SWEEP=1``), drawn by :func:`sweep_seed`: runs with other seeds cover the rest."""
    if FULL or k >= len(cells):
        return list(cells)
    rnd = random.Random(f"{sweep_seed()}:{name}")
    return [cells[i] for i in sorted(rnd.sample(range(len(cells)), k))]


def skip_unless_drawn(name: str, cells: Sequence[T], cell: T, k: int) -> None:
    """Skip (pytest) a cell of matrix ``name`` that this run's draw of ``k`` does not include,
    saying which ones it does and how to run them all."""
    import pytest

    drawn = draw_cells(name, cells, k)
    if cell not in drawn:
        pytest.skip(
            f"seed {sweep_seed()} draws {k} of the {len(cells)} cells of {name} this run ({drawn}); "
            f"TXCKPT_SWEEP_SEED=N picks another draw, TXCKPT_FULL_SWEEP=1 runs them all"
        )


def describe(tried: int, total: int, *, full: bool = False) -> str:
    """How a sweep's summary line says what it tried and how to reproduce or widen it."""
    if full or FULL or tried == total:
        return f"all {total} points"
    return (
        f"{tried} of {total} points (seed {sweep_seed()}: TXCKPT_SWEEP_SEED={sweep_seed()} reproduces the draw, "
        f"TXCKPT_FULL_SWEEP=1 tries all)"
    )
