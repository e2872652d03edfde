"""The seed report (shared/seed/000_...: transformers #50677) through TransactionalTrainer.

Each run is a real subprocess; run B dies by os._exit(137) or SIGKILL exactly where the report
kills it. Expected (issue 3): run A's checkpoints are never touched, the restart with
resume_from_checkpoint=True continues run B's lineage from step 2, and the rollback warns and
names the checkpoints it abandons.
"""

import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import txckpt  # noqa: E402

HERE = Path(__file__).parent / "children"
from tests.harness.tiny import digests  # noqa: E402
from tests.harness.zygote import run_python  # noqa: E402

pytestmark = pytest.mark.trainer


def run(*args, expect_rc=0):
    env = dict(os.environ, TXCKPT_COORDINATION_TIMEOUT="120", PYTHONUNBUFFERED="1")
    p = run_python([str(HERE / "trainer_rollback.py"), *map(str, args)], timeout=300, env=env, cwd=str(HERE))
    if expect_rc is not None and p.returncode != expect_rc:
        raise AssertionError(
            f"{args}: rc {p.returncode} (expected {expect_rc})\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-6000:]}"
        )
    return p


def begins_at(p):
    lines = [l for l in p.stdout.splitlines() if "training begins at global_step=" in l]
    assert len(lines) == 1, p.stdout
    return int(lines[0].rsplit("=", 1)[1])


def committed(out, lineage="current"):
    txckpt.forget_roots()
    return {(c.step, c.txid): c for c in txckpt.CheckpointRoot(out).checkpoints(lineage=lineage)}


def by_txid(out, txid):
    return next(c for c in committed(out, "all").values() if c.txid == txid)


def uncommitted_staging(out):
    txckpt.forget_roots()
    return set(os.listdir(out / ".txckpt" / "tx")) - set(txckpt.CheckpointRoot(out).history().checkpoints)


def rollback_warning(stderr):
    """Each rollback warning in stderr: its first line and the indented lines under it."""
    out: list[str] = []
    inside = False
    for line in stderr.splitlines():
        if "rolling back" in line and "abandons" in line:
            out.append(line)
            inside = True
        elif inside and line.startswith("  "):
            out[-1] += "\n" + line
        else:
            inside = False
    return out


def assert_holds_exactly_its_manifest(path):
    """Every file of the directory is in its manifest and matches it, and nothing else is there."""
    manifest = txckpt.verify_checkpoint(path)
    on_disk = {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}
    assert on_disk == set(manifest.files) | {txckpt.MANIFEST_NAME}
    return manifest


@pytest.mark.parametrize("crash", ["exit", "kill"])
def test_torn(tmp_path, crash):
    out = tmp_path / "out"
    p = run("run-a", out, 4)
    assert begins_at(p) == 0
    a = {c.step: c for c in committed(out).values()}
    assert sorted(a) == [2, 4]
    a4_before = digests(a[4].path)

    p = run("run-b", out, "torn", 4, crash, expect_rc=137 if crash == "exit" else -9)
    assert begins_at(p) == 2
    warning = rollback_warning(p.stderr)
    assert len(warning) == 1, p.stderr
    assert "checkpoint-4" in warning[0] and a[4].txid in warning[0]

    # After the crash: run A's checkpoint-4 is unchanged (wherever it lives now) and intact;
    # the current lineage is run B's, whose newest checkpoint is the fork point.
    a4 = by_txid(out, a[4].txid)
    assert a4.state == "abandoned"
    assert digests(a4.path) == a4_before
    assert_holds_exactly_its_manifest(a4.path)
    txckpt.forget_roots()
    assert os.path.basename(txckpt.get_last_checkpoint(out)) == "checkpoint-2"
    # The killed save left its staging (and its intent) behind.
    (dead,) = uncommitted_staging(out)
    assert os.listdir(out / ".txckpt" / "intents") == [f"{dead}.json"]

    p = run("restart", out)
    assert begins_at(p) == 2
    # The restarted job's first save reclaimed it (protocol §8 step 12), without `txckpt gc`.
    assert uncommitted_staging(out) == set()
    assert os.listdir(out / ".txckpt" / "intents") == []

    # checkpoint-4 now holds run B's files only; run A's checkpoint-4 still exists, intact.
    current = {c.step: c for c in committed(out).values()}
    assert sorted(current) == [2, 4, 6, 8]
    assert current[2].txid == a[2].txid  # the fork point is shared
    b4 = current[4]
    assert b4.txid != a[4].txid
    assert os.path.realpath(b4.path) == os.path.realpath(out / "checkpoint-4")
    manifest = assert_holds_exactly_its_manifest(out / "checkpoint-4")
    assert manifest.txid == b4.txid and manifest.lineage == b4.lineage != a[4].lineage
    b4_digests = digests(out / "checkpoint-4")
    for f in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert b4_digests[f] != a4_before[f], f
    a4 = by_txid(out, a[4].txid)
    assert os.path.realpath(a4.path) != os.path.realpath(out / "checkpoint-4")
    assert digests(a4.path) == a4_before
    assert_holds_exactly_its_manifest(a4.path)


@pytest.mark.parametrize("crash", ["exit", "kill"])
def test_abandoned(tmp_path, crash):
    out = tmp_path / "out"
    run("run-a", out, 6)
    a = {c.step: c for c in committed(out).values()}
    assert sorted(a) == [2, 4, 6]
    before = {s: digests(a[s].path) for s in a}

    p = run("run-b", out, "abandoned", 6, crash, expect_rc=137 if crash == "exit" else -9)
    assert begins_at(p) == 2
    warning = rollback_warning(p.stderr)
    assert len(warning) == 1, p.stderr
    for s in (4, 6):
        assert f"checkpoint-{s}" in warning[0] and a[s].txid in warning[0]

    p = run("restart", out)
    assert begins_at(p) == 2  # not 6: the abandoned run is not resumed

    for s in (4, 6):
        old = by_txid(out, a[s].txid)
        assert old.state == "abandoned"
        assert digests(old.path) == before[s]
        assert_holds_exactly_its_manifest(old.path)
    current = {c.step: c for c in committed(out).values()}
    assert sorted(current) == [2, 4, 6, 8]
    assert {current[s].txid for s in (4, 6)}.isdisjoint({a[4].txid, a[6].txid})
