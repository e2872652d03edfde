"""Crash sweep over the DCP path on 2 real gloo ranks: SIGKILL either rank before and after each of
its file operations during a dcp.save through TransactionalWriter; a fresh process then checks
that a restart sees the previous checkpoint or the new one (never a mix, nothing before its
commit), loads it verified, and can save on.

CI samples the points (tests/harness/sampling.py): of rank 0, every point around the manifest, the
commit entry and the publication, its first and last, and 4 drawn from the others; of rank 1, its
first and last and a drawn 40% of the others. The draw is seeded (the seed is in the summary line,
``TXCKPT_SWEEP_SEED=<seed>`` repeats it) and varies per run, so runs together reach every point;
``TXCKPT_DCP_FULL_SWEEP=1`` or ``TXCKPT_FULL_SWEEP=1`` runs every point of both ranks."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from tests import conftest
from tests.children import dcp_workers as cw
from tests.children import dist_workers as dw
from tests.harness import launcher, sampling

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]

FULL = os.environ.get("TXCKPT_DCP_FULL_SWEEP") == "1" or sampling.FULL
#: Rank 0's points in CI besides the commit-critical ones (drawn from its other operations).
SAMPLED = 4
#: The ops around which the outcome flips: the manifest, the commit entry, the publication.
CRITICAL = ("link(<root>/.txckpt/tx/<id>/checkpoint-2/txckpt-manifest", "link(<root>/.txckpt/log/", "rename_noreplace(")


def _count(tmp_path, base: str, victim: int) -> list[str]:
    root = str(tmp_path / f"count-{victim}")
    shutil.copytree(base, root, symlinks=True)
    ops_file = str(tmp_path / f"ops-{victim}.json")
    run = launcher.launch(
        2,
        cw.crash_save,
        str(tmp_path / f"res-count-{victim}"),
        deadline=180,
        root=root,
        step=2,
        victim=victim,
        kill_at=None,
        when="before",
        ops_file=ops_file,
    )
    assert all(r.exitcode == 0 for r in run.results), run.describe()
    return json.load(open(ops_file))


def _committed_by(hit: dict) -> bool:
    """Rank 0 commits by linking the log entry: committed iff it died after that link."""
    return any(op.startswith("link(<root>/.txckpt/log/") for op in hit["done"])


def _crash_once(tmp_path, base: str, victim: int, point: tuple[str, int], when: str, tag: str) -> dict:
    for attempt in range(3):
        t = f"{tag}-{attempt}"
        root = str(tmp_path / f"root-{t}")
        shutil.copytree(base, root, symlinks=True)
        label = str(tmp_path / f"label-{t}.json")
        run = launcher.launch(
            2,
            cw.crash_save,
            str(tmp_path / f"res-{t}"),
            deadline=90,
            root=root,
            step=2,
            victim=victim,
            kill_at=point,
            when=when,
            label_file=label,
        )
        hit = json.load(open(label)) if os.path.exists(label) else None
        if hit is not None or not all(r.exitcode == 0 for r in run.results):
            break
        shutil.rmtree(root, ignore_errors=True)  # the op did not occur in this run: try again
    else:
        return {"problems": [], "unreached": True, "committed": None}
    problems = []
    if not run[victim].killed or hit is None:
        problems.append(f"victim not killed at its op: {run.describe()}")
    survivor = run[1 - victim]
    if survivor.hung:
        problems.append(f"rank {survivor.rank} hung")
    elif survivor.error_type is None:
        problems.append(f"rank {survivor.rank} returned {survivor.ok!r} although rank {victim} died")
    verdict = launcher.run_in_fresh_process(cw.check_after_crash, root, 1, 2, timeout=120)
    problems += verdict["violations"]
    if victim == 1 and verdict["committed"]:
        problems.append("committed although rank 1 died before its report reached the coordinator")
    if victim == 0 and hit is not None and verdict["committed"] != _committed_by(hit):
        problems.append(
            f"committed={verdict['committed']}, but rank 0 had "
            f"{'' if _committed_by(hit) else 'not '}linked the commit entry"
        )
    shutil.rmtree(root, ignore_errors=True)
    return {
        "problems": problems,
        "unreached": False,
        "committed": verdict["committed"],
        "survivor_s": survivor.elapsed or 0.0,
    }


def _chosen(ops: list[str], victim: int) -> list[tuple[tuple[str, int], str]]:
    points = dw.occurrences(ops)
    if victim == 1:  # nothing rank 1 does commits: no point of its is critical
        chosen = sampling.sample("DCP rank 1", points, full=FULL)
    else:
        chosen = sampling.sample(
            "DCP rank 0", points, lambda p: p[0].startswith(CRITICAL), full=FULL, share=0, at_least=SAMPLED
        )
    return [(p, w) for p in chosen for w in ("before", "after")]


def test_dcp_crash_sweep_two_ranks(tmp_path):
    base = str(tmp_path / "base")
    run = launcher.launch(2, cw.baseline, str(tmp_path / "res-base"), root=base, step=1)
    assert all(r.exitcode == 0 for r in run.results), run.describe()
    t0 = time.monotonic()
    points = unreached = commits = 0
    slowest = 0.0
    violations: list[str] = []
    counted = {}
    tried = total = 0
    for victim in (1, 0):
        ops = _count(tmp_path, base, victim)
        counted[victim] = len(ops)
        assert ops, "the counting run saw no file operation"
        chosen = _chosen(ops, victim)
        tried, total = tried + len(chosen), total + 2 * len(dw.occurrences(ops))
        for i, (point, when) in enumerate(chosen):
            out = _crash_once(tmp_path, base, victim, point, when, f"{victim}-{i}-{when}")
            if out["unreached"]:
                unreached += 1
                continue
            points += 1
            commits += bool(out["committed"])
            slowest = max(slowest, out["survivor_s"])
            violations += [f"rank {victim} {when} {point[0]} #{point[1]}: {p}" for p in out["problems"]]
    line = (
        f"DCP crash sweep, 2 ranks ({sampling.describe(tried, total, full=FULL)}): rank 1 {counted[1]} ops, rank 0 "
        f"{counted[0]} ops; {points} crash points ({unreached} not reached in 3 runs), {commits} left the "
        f"new checkpoint committed, {len(violations)} violations, slowest survivor error {slowest:.1f} s, "
        f"{time.monotonic() - t0:.0f} s"
    )
    print(line)
    conftest.SUMMARY_LINES.append(line)
    assert not violations, "\n".join(violations[:20])
    assert unreached == 0, line
    assert commits > 0, line  # rank 0 dying after its commit entry leaves the new checkpoint
