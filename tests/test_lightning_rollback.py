"""The seed report's story in Lightning, with txckpt and with stock Lightning side by side:
run A saves steps 5..20; run B resumes A's step 10 (``ckpt_path=<path>``, a rollback) into the
same dirpath on other data and is SIGKILLed while saving step 15; run C resumes
``ckpt_path="last"``. Stock Lightning resumes A's step 20 (the abandoned run: last.ckpt is A's
newest file); txckpt resumes B's lineage at its newest committed checkpoint, step 10, and warns.
Also: a SIGKILL inside a save, synchronous and async, leaves 0 torn checkpoints and a restart
that resumes only committed ones."""

from __future__ import annotations

import logging
import os
import signal

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import txckpt  # noqa: E402
from tests.children.lightning_run import die_committing, fit  # noqa: E402
from tests.harness.procs import run_child  # noqa: E402
from txckpt.integrations.lightning import TransactionalCheckpointIO  # noqa: E402
from txckpt.integrations._lightning.names import resolve  # noqa: E402

pytestmark = [pytest.mark.trainer, pytest.mark.lightning, pytest.mark.process]


def _stock_die_writing(step: int) -> None:
    """Stock Lightning killed while writing step ``step``'s file: half of it on disk."""
    import io

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    real = TorchCheckpointIO.save_checkpoint

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if checkpoint.get("global_step") == step:
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, checkpoint, path, storage_options)

    TorchCheckpointIO.save_checkpoint = save_checkpoint


def _plugins(kind: str) -> list:
    return [] if kind == "stock" else [TransactionalCheckpointIO(async_save=(kind == "async"))]


def _story(dirpath: str, kind: str, caplog) -> dict:
    a = run_child(lambda: fit(dirpath, seed=0, max_steps=20, ckpt_path=None, plugins=_plugins(kind)), timeout=240)
    assert a[0] == 0, a
    assert a[1]["ok"]["global_step"] == 20

    step10 = os.path.join(dirpath, "epoch=0-step=10.ckpt")

    def run_b() -> None:
        if kind == "stock":
            _stock_die_writing(15)
        else:
            die_committing(15)
        fit(dirpath, seed=1, max_steps=20, ckpt_path=step10, plugins=_plugins(kind))

    code, _ = run_child(run_b, timeout=240)
    assert code == -signal.SIGKILL, f"run B was to die by SIGKILL inside the save of step 15, got {code}"
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        c = fit(dirpath, seed=1, max_steps=25, ckpt_path="last", plugins=_plugins(kind))
    return c


def test_stock_lightning_resumes_the_abandoned_run(tmp_path, caplog):
    c = _story(str(tmp_path / "stock"), "stock", caplog)
    # The difference this integration fixes: stock "last" is A's step 20, the abandoned run.
    assert c["ckpt_path"].endswith("last.ckpt")
    assert c["resumed"] == 20


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_txckpt_resumes_the_rollbacks_lineage(tmp_path, caplog, kind):
    dirpath = str(tmp_path / kind)
    c = _story(dirpath, kind, caplog)
    assert c["resumed"] == 10, "last must be B's lineage's newest committed checkpoint: step 10"
    assert (
        'ckpt_path="last" resumes step 10' in caplog.text
        and "a rollback or a run from scratch abandoned it" in caplog.text
    )
    # Nothing uncommitted resumed or published: B's step 15 never committed, so no name has it.
    history = txckpt.open_root(dirpath).history()
    by_step = {}
    for x in history.checkpoints.values():
        by_step.setdefault(x.step, set()).add(x.lineage)
    (a_lineage,) = by_step[5]  # only A saved step 5
    assert by_step[25] == {history.state.head} != {a_lineage}, "C continued B's fork, not A"
    assert by_step[15] == {a_lineage, history.state.head}, "A's step 15 and C's; B's died before its commit"
    root = txckpt.open_root(dirpath)
    for x in history.checkpoints.values():  # 0 torn: every committed checkpoint verifies
        assert txckpt.verify_checkpoint(root.locate(x.ref)).txid == x.txid
    for name in os.listdir(dirpath):  # every published name is a link to committed bytes, whole
        if name.endswith(".ckpt"):
            found = resolve(os.path.join(dirpath, name), None, None)
            assert found is not None and found.record.txid in history.checkpoints, name
            assert os.path.samefile(os.path.join(dirpath, name), os.path.join(found.checkpoint, found.file))
            assert torch.load(os.path.join(dirpath, name), weights_only=False)["global_step"] == found.record.step
    # A's step 20 is still there, whole, under its name: the rollback lost nothing.
    assert torch.load(os.path.join(dirpath, "epoch=0-step=20.ckpt"), weights_only=False)["global_step"] == 20
    assert txckpt.verify_checkpoint(txckpt.get_last_checkpoint(dirpath)).step == 25
    assert not [p for p in _walk(dirpath) if os.path.islink(p)], "no symlinks"


def _walk(top: str):
    for base, dirs, files in os.walk(top):
        for n in dirs + files:
            yield os.path.join(base, n)


@pytest.mark.s3
def test_sigkill_inside_a_save_on_s3(tmp_path, s3_root, caplog):
    """The same story on an S3 root (moto): B is SIGKILLed inside its save of step 15, after its
    object and manifest were uploaded and before the commit entry; C's "last" is step 10 of B's
    lineage, and every committed checkpoint verifies."""
    url, options = s3_root
    dirpath = str(tmp_path / "names")

    def plugins() -> list:
        return [TransactionalCheckpointIO(url, storage_options=options)]

    a = run_child(lambda: fit(dirpath, seed=0, max_steps=20, ckpt_path=None, plugins=plugins()), timeout=240)
    assert a[0] == 0, a

    def run_b() -> None:
        die_committing(15)
        fit(dirpath, seed=1, max_steps=20, ckpt_path=os.path.join(dirpath, "epoch=0-step=10.ckpt"), plugins=plugins())

    code, _ = run_child(run_b, timeout=240)
    assert code == -signal.SIGKILL, code
    txckpt.forget_roots()  # what a fresh process knows of the root: nothing
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        c = fit(dirpath, seed=1, max_steps=25, ckpt_path="last", plugins=plugins())
    assert c["resumed"] == 10 and "/.txckpt/tx/" in c["ckpt_path"]
    assert "a rollback or a run from scratch abandoned it" in caplog.text
    root = txckpt.open_root(url, options)
    history = root.history()
    for x in history.checkpoints.values():
        assert txckpt.verify_checkpoint(root.locate(x.ref), storage_options=options).txid == x.txid


@pytest.mark.distributed
@pytest.mark.slow  # ~60 s on two cores (two spawned ranks, twice): the campaign tier
def test_ddp_two_ranks_save_from_rank0_and_resume_last(tmp_path):
    """Lightning's DDP (two CPU ranks, ddp_spawn): the plugin saves from global rank 0 alone
    (no collective of txckpt's to hang on), and both ranks resume ckpt_path="last" from the log."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.children.lightning_run import TinyModule, data

    d = str(tmp_path / "ddp")

    def run(steps: int, ckpt_path):
        cb = ModelCheckpoint(dirpath=d, every_n_train_steps=4, save_top_k=2, monitor="train_loss", save_last=True)
        t = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            devices=2,
            strategy="ddp_spawn",
            callbacks=[cb],
            plugins=[TransactionalCheckpointIO()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        t.fit(TinyModule(), data(0), ckpt_path=ckpt_path)
        return t

    run(8, None)
    run(12, "last")  # the ranks are spawned: the resume is read from the log below, not t.ckpt_path
    root = txckpt.open_root(d)
    steps = [c.step for c in root.checkpoints()]
    assert 12 in steps and set(steps) <= {4, 8, 12}, steps  # the top 2 by train_loss and the newest
    assert len({c.lineage for c in root.checkpoints()}) == 1, "the resume continued the lineage"
    assert torch.load(os.path.join(d, "last.ckpt"), weights_only=False)["global_step"] == 12
