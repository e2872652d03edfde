"""SIGKILL a real Lightning ``fit`` before and after the operations of its save through
TransactionalCheckpointIO (synchronous and async_save=True; a local root, where an operation is a
file operation, and an S3 root on moto, where it is a mutating request) (issue 48). The scenario
resumes a template run's step 2 with ``fit(ckpt_path="last")`` and saves step 4 (ModelCheckpoint
every 2 steps, ``save_last=True``: a top-k name and ``last.ckpt``). After each crash a fresh
process checks: every committed checkpoint verifies and holds exactly the state of the uncrashed
run at its step (0 torn); on the local root every ``*.ckpt`` name in the dirpath is a committed
file (no name points at uncommitted bytes), on S3 the dirpath holds no file at all (no copy, no
link); ``ckpt_path="last"`` resolves to the newest committed checkpoint (0 uncommitted resumes)
and the plugin loads it, verified, as ``fit(ckpt_path="last")`` does. The points are sampled as
the project's sweeps are (tests/harness/sampling.py: every point around an operation that flips
what a reader sees, the first and the last, and two seeded others, of which a run tries a
seeded 8 (local) or 4 (S3); the seed is printed,
``TXCKPT_FULL_SWEEP=1`` tries them all). Each point starts a Trainer (~2 s), so a campaign run
sweeps one of the four (sync, async) x (local, S3) cases, the one its seed draws: the runs cover
them all; ``TXCKPT_FULL_SWEEP=1`` sweeps all four, whole. Campaign tier."""

from __future__ import annotations

import filecmp
import os
import shutil
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import txckpt  # noqa: E402
from tests.harness import sampling  # noqa: E402
from tests.harness.crash_sweep import report, s3_request_sweep, sweep  # noqa: E402
from tests.harness.procs import run_child  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.lightning]

#: Crash points a sweep tries per campaign run (drawn from its sampled points by the seed).
LOCAL_POINTS, S3_POINTS = 8, 4
CASES = [("sync", "local"), ("async", "local"), ("sync", "s3"), ("async", "s3")]


def _drawn(case: tuple[str, str]) -> None:
    chosen = CASES[sampling.sweep_seed() % len(CASES)]
    if not sampling.FULL and case != chosen:
        pytest.skip(f"seed {sampling.sweep_seed()} draws the {'-'.join(chosen)} sweep this run")


def _fit(dirpath: str, max_steps: int, async_save: bool, url: str | None = None, so: Any = None) -> dict:
    """The run: resume ``"last"``, train to ``max_steps`` saving every 2 steps into ``url`` (None:
    the dirpath); the weights at each step it saved (the state each save must hold)."""
    import lightning as L

    from tests.children.lightning_run import TinyModule, data, trainer
    from txckpt.integrations.lightning import TransactionalCheckpointIO

    saved: dict[int, list[float]] = {}

    class Record(L.Callback):
        def on_save_checkpoint(self, t, module, checkpoint) -> None:
            saved[t.global_step] = module.layer.weight.detach().flatten().tolist() + module.layer.bias.tolist()

    torch.manual_seed(0)
    io = TransactionalCheckpointIO(url, storage_options=so, async_save=async_save)
    t, _ = trainer(dirpath, max_steps, [io], every_n_train_steps=2)
    t.callbacks.append(Record())
    t.fit(TinyModule(), data(0), ckpt_path="last")
    return saved


def _state(checkpoint: str, so: Any = None) -> tuple[int, list[float]]:
    (name,) = txckpt.read_manifest(checkpoint, storage_options=so).files
    state = txckpt.load_checkpoint(checkpoint, files=[name], weights_only=False, storage_options=so)[name]
    sd = state["state_dict"]  # (the load verified every byte)
    return int(state["global_step"]), sd["layer.weight"].flatten().tolist() + sd["layer.bias"].tolist()


def _violations(dirpath: str, expected: dict[int, list[float]], url: str | None = None, so: Any = None) -> list[str]:
    from txckpt.integrations.lightning import TransactionalCheckpointIO

    v: list[str] = []
    txckpt.forget_roots()
    root = url or dirpath
    committed = {c.path.rstrip("/"): c for c in txckpt.open_root(root, so).checkpoints("all") if c.path}
    if not any(c.step == 2 for c in committed.values()):
        v.append("the template's committed step 2 is gone")
    files = {}
    for path, c in committed.items():
        step, weights = _state(path, so)
        if step != c.step or weights != expected.get(step):
            v.append(f"{path}: torn or mixed: step {step}, not the state of the run at step {c.step}")
        (name,) = txckpt.read_manifest(path, storage_options=so).files
        files[path] = os.path.join(path, name)
    names = [n for n in os.listdir(dirpath) if n.endswith(".ckpt")] if os.path.isdir(dirpath) else []
    if url is not None and names:
        v.append(f"an S3 root left files in the dirpath: {names}")
    for name in names if url is None else []:  # the sweep copies the root: links become files
        if not any(filecmp.cmp(os.path.join(dirpath, name), f, shallow=False) for f in files.values()):
            v.append(f"{name} names bytes no committed checkpoint holds")
    io = TransactionalCheckpointIO(url, storage_options=so)
    last = io.last_checkpoint_path([dirpath])
    newest = (txckpt.get_last_checkpoint(root, storage_options=so) or "").rstrip("/")
    if last is None or last.rsplit("/", 1)[0] != newest or newest not in committed:
        return v + [f'ckpt_path="last" resolves {last}, not the newest committed checkpoint {newest}']
    state = io.load_checkpoint(last, weights_only=False)  # what fit(ckpt_path="last") loads
    if int(state["global_step"]) != committed[newest].step:
        v.append(f'ckpt_path="last" loads step {state["global_step"]} from {last}')
    return v


def _expected(template: str, uncrashed: str, async_save: bool, url=None, uncrashed_url=None, so=None) -> dict:
    code, out = run_child(lambda: _fit(uncrashed, 4, async_save, uncrashed_url, so), timeout=300)
    assert code == 0 and sorted(out["ok"]) == ["4"], out
    expected = {int(s): w for s, w in out["ok"].items()}
    code, out = run_child(lambda: _state(txckpt.get_last_checkpoint(url or template, storage_options=so), so)[1])
    assert code == 0, out
    expected[2] = out["ok"]
    return expected


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_inside_lightning_saves_leaves_only_committed_checkpoints(tmp_path, mode):
    _drawn((mode, "local"))
    async_save = mode == "async"
    template = str(tmp_path / "template")
    code, out = run_child(lambda: _fit(template, 2, False), timeout=300)
    assert code == 0, out
    uncrashed = str(tmp_path / "uncrashed")
    shutil.copytree(template, uncrashed, symlinks=True)
    expected = _expected(template, uncrashed, async_save)
    result = sweep(
        f"lightning-{mode}",
        template,
        str(tmp_path / "work"),
        lambda root: _fit(root, 4, async_save),
        lambda root, k, when: _violations(root, expected),
        sampled=True,
        share=0.0,  # each point starts a Trainer: the critical points, the first and last, 2 more,
        limit=LOCAL_POINTS,  # and of those a seeded draw
    )
    report(result)


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_inside_lightning_saves_on_s3_leaves_only_committed_checkpoints(tmp_path, s3_server, mode):
    _drawn((mode, "s3"))
    from emulators.s3 import BUCKET
    from tests.reliability.s3 import copy_prefix

    async_save = mode == "async"
    s3_server.clear_failures()
    s3_server.reset()
    s3_server.create_bucket(BUCKET)
    so, client = s3_server.storage_options(), s3_server.boto3_client()
    base = f"lightning-sweep-{mode}"
    url = lambda prefix: f"s3://{BUCKET}/{base}/{prefix}"  # noqa: E731
    dirpath = lambda name: str(tmp_path / name)  # noqa: E731  (ModelCheckpoint's; no file lands there)

    # In children: the parent never starts s3fs's event loop before it forks.
    code, out = run_child(lambda: _fit(dirpath("template"), 2, False, url("template"), so), timeout=300)
    assert code == 0, out
    copy_prefix(client, BUCKET, f"{base}/template", f"{base}/uncrashed")
    expected = _expected(dirpath("template"), dirpath("uncrashed"), async_save, url("template"), url("uncrashed"), so)

    def fresh(name: str) -> str:
        copy_prefix(client, BUCKET, f"{base}/template", f"{base}/{name}")
        return name

    _, _, _, found = s3_request_sweep(
        f"lightning-{mode} on S3",
        base,
        fresh,
        lambda point: _fit(dirpath(point), 4, async_save, url(point), so),
        lambda point: _violations(dirpath(point), expected, url(point), so),
        share=0.0,
        limit=S3_POINTS,  # a point costs ~4 s here (a Trainer on s3fs): 4 of them, seeded, per run
    )
    assert not found, "\n".join(found[:20])
