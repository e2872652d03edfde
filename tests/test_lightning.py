"""TransactionalCheckpointIO with the real Lightning Trainer and Fabric, in-process (CPU, a
linear model, a few steps): every published name loads with stock tools, "last" and an explicit
path resume, a flipped byte raises IntegrityError, save_top_k rotation retires only the current
lineage's checkpoints, Fabric saves and loads; async saves snapshot the state before returning;
ckpt_path="last" on memory:// and s3:// roots reads the log."""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import txckpt  # noqa: E402
from tests.children.lightning_run import TinyModule, data, fit  # noqa: E402
from txckpt._async.asyncsave import step_gate  # noqa: E402
from txckpt.errors import IntegrityError, InvalidArgumentError  # noqa: E402
from txckpt._async.snapshot import SnapshotPool  # noqa: E402
from txckpt.integrations.lightning import TransactionalCheckpointIO  # noqa: E402

pytestmark = [pytest.mark.trainer, pytest.mark.lightning]


def _ckpts(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".ckpt"))


def test_round_trip_names_resume_and_verification(tmp_path):
    d = str(tmp_path / "run")
    a = fit(
        d,
        seed=0,
        max_steps=20,
        ckpt_path=None,
        plugins=[TransactionalCheckpointIO()],
        monitor="train_loss",
        save_top_k=2,
    )
    names = _ckpts(d)
    assert "last.ckpt" in names and len(names) == 3, names  # top 2 by train_loss, and last
    for name in names:  # stock tools read every published name
        state = torch.load(os.path.join(d, name), weights_only=False)
        assert state["global_step"] in (5, 10, 15, 20)
        TinyModule.load_from_checkpoint(os.path.join(d, name))
    assert torch.load(a["last"], weights_only=False)["global_step"] == 20
    assert os.path.samefile(a["last"], os.path.join(txckpt.get_last_checkpoint(d), "epoch=0-step=20.ckpt"))
    assert TinyModule.load_from_checkpoint(a["best"]).layer.weight.shape == (1, 4)
    # Rotation retired what top-k let go (the current lineage's own): 2 best + the newest stay.
    kept = {c.step for c in txckpt.open_root(d).checkpoints()}
    assert len(kept) <= 3 and 20 in kept

    b = fit(d, seed=0, max_steps=25, ckpt_path="last", plugins=[TransactionalCheckpointIO()])
    assert b["resumed"] == 20 and b["global_step"] == 25
    c = fit(
        d,
        seed=0,
        max_steps=25,
        ckpt_path=a["best"],
        plugins=[TransactionalCheckpointIO()],
        monitor="train_loss",
        save_top_k=1,
    )
    assert c["resumed"] == torch.load(a["best"], weights_only=False)["global_step"]

    # A flipped byte in the committed file (every name is the same inode) fails the load, typed.
    newest = txckpt.get_last_checkpoint(d)
    (file,) = txckpt.read_manifest(newest).files  # run c's name, a "-v1" version of run b's
    victim = os.path.join(newest, file)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        TransactionalCheckpointIO().load_checkpoint(os.path.join(d, "last.ckpt"))


def test_rotation_never_retires_another_lineages_checkpoint(tmp_path, caplog):
    d = str(tmp_path / "run")
    fit(d, seed=0, max_steps=20, ckpt_path=None, plugins=[TransactionalCheckpointIO()])
    a_names = _ckpts(d)
    a_steps = {c.txid: c.step for c in txckpt.open_root(d).checkpoints()}
    # Run B rolls back to step 10 and keeps only its best (save_top_k=1): its rotation retires its
    # own checkpoints as it goes, in the dirpath that holds A's; none of A's checkpoints or names goes.
    removed = []
    io = TransactionalCheckpointIO()
    real = io.remove_checkpoint
    io.remove_checkpoint = lambda path: (removed.append(path), real(path))[1]  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="txckpt"):
        fit(
            d,
            seed=1,
            max_steps=30,
            ckpt_path=os.path.join(d, "epoch=0-step=10.ckpt"),
            plugins=[io],
            save_top_k=1,
            monitor="train_loss",
        )
    assert "rolling back to step 10" in caplog.text and "abandons 2 checkpoint(s)" in caplog.text
    assert removed, "B's rotation removed checkpoints"
    history = txckpt.open_root(d).history()
    assert history.retired, "B's rotation retired its own checkpoints through txckpt"
    for txid in a_steps:
        assert txid in history.checkpoints and txid not in history.retired, a_steps[txid]
    for name in a_names:
        if name != "last.ckpt":
            assert os.path.exists(os.path.join(d, name)), name


def test_validate_from_an_older_checkpoint_changes_no_lineage_and_a_fresh_run_starts_one(tmp_path, caplog):
    from tests.children.lightning_run import data, trainer

    d = str(tmp_path / "run")
    fit(d, seed=0, max_steps=20, ckpt_path=None, plugins=[TransactionalCheckpointIO()])
    root = txckpt.open_root(d)
    before = root.state()
    t, _ = trainer(d, 20, [TransactionalCheckpointIO()])
    t.validate(TinyModule(), data(0), ckpt_path=os.path.join(d, "epoch=0-step=10.ckpt"))
    after = root.state()
    assert (after.head, after.head_tip) == (before.head, before.head_tip), "a load alone forks nothing"
    # fit with no ckpt_path into the same dirpath: a run from scratch, a new lineage (logged);
    # "last" is then that run's newest, and A's checkpoints all stay.
    with caplog.at_level("WARNING", logger="txckpt"):
        fit(d, seed=1, max_steps=10, ckpt_path=None, plugins=[TransactionalCheckpointIO()])
    assert "starts a new lineage" in caplog.text
    fresh = root.state()
    assert fresh.head != before.head and fresh.head_tip.step == 10
    assert {c.step for c in root.checkpoints(lineage=before.head)} == {5, 10, 15, 20}
    assert fit(d, seed=1, max_steps=12, ckpt_path="last", plugins=[TransactionalCheckpointIO()])["resumed"] == 10


def test_fabric_save_and_load(tmp_path):
    d = str(tmp_path / "fabric")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[TransactionalCheckpointIO()])
    model = torch.nn.Linear(4, 2)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        fabric.save(os.path.join(d, "state.ckpt"), {"model": model, "step": step})
    assert [c.step for c in txckpt.open_root(d).checkpoints()] == [1, 2]
    assert torch.load(os.path.join(d, "state.ckpt"), weights_only=False)["step"] == 2
    fresh = torch.nn.Linear(4, 2)
    rest = fabric.load(os.path.join(d, "state.ckpt"), {"model": fresh})
    assert rest == {"step": 2} and torch.equal(fresh.weight, torch.full((2, 4), 2.0))


@pytest.mark.parametrize("mode", [True, "lazy"])
def test_async_saves_snapshot_before_returning(tmp_path, mode):
    """Weights mutated in place right after save_checkpoint returns: every one of 32 committed
    checkpoints equals the state at its save (0 torn). Lazy: the weights are the Trainer's
    optimizer's parameter, mutated by its step (which waits for the background's copy: each of
    the 32 steps had one to wait for)."""
    d = str(tmp_path / "async")
    io = TransactionalCheckpointIO(async_save=mode)
    weights = torch.nn.Parameter(torch.zeros(256, 64))
    opt = torch.optim.SGD([weights], lr=1.0)
    for step in range(1, 33):
        with torch.no_grad():
            weights.fill_(float(step))
        if mode == "lazy":
            io.trainer_optimizers = [opt]  # what the Trainer's dump_checkpoint does
        io.save_checkpoint(
            {"state_dict": {"w": weights.detach()}, "global_step": step, "epoch": 0},
            os.path.join(d, f"step={step}.ckpt"),
        )
        if mode == "lazy":
            weights.grad = torch.full((256, 64), -1000.0)
            opt.step()  # in place, += 1000, once the background has copied
        else:
            with torch.no_grad():
                weights.add_(1000.0)  # in place, while the background may still be writing
    io.teardown()
    if mode == "lazy":
        assert len(step_gate(opt).waits) == 32, "every step after a lazy save waited for its copy"
    reader = TransactionalCheckpointIO()
    for step in range(1, 33):
        state = reader.load_checkpoint(os.path.join(d, f"step={step}.ckpt"))
        assert state["global_step"] == step and torch.equal(
            state["state_dict"]["w"], torch.full((256, 64), float(step))
        )
        assert torch.equal(
            torch.load(os.path.join(d, f"step={step}.ckpt"))["state_dict"]["w"], torch.full((256, 64), float(step))
        )


def test_async_saves_inside_a_process_group_never_coordinate_and_raise_a_background_failure(tmp_path, monkeypatch):
    """Under DDP Lightning calls save_checkpoint on global rank 0 alone: its background save must
    not touch the process group (txckpt.async_save's gloo group is created collectively: the
    other ranks would never join). Seen from rank 0 of two here; the async engine's group would
    need a real default group, which this process has not. A background failure is raised by the
    next save (which waits for it), once, and the last save's by the teardown."""
    import torch.distributed as dist

    import txckpt._save.transactions as transactions

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    real = transactions.append_commit

    def append_commit(root, manifest, *args, **kwargs):
        if manifest.step in (2, 4):
            raise OSError(28, f"No space left on device (step {manifest.step})")
        return real(root, manifest, *args, **kwargs)

    monkeypatch.setattr(transactions, "append_commit", append_commit)
    d = str(tmp_path / "ddp")
    io = TransactionalCheckpointIO(async_save=True)

    def save(step: int) -> None:
        io.save_checkpoint(
            {"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step, "epoch": 0}, f"{d}/s{step}.ckpt"
        )

    save(1)
    save(2)  # fails in the background
    with pytest.raises(OSError, match="step 2"):
        save(3)
    save(3)  # reported once: the run may save again
    save(4)  # fails in the background
    with pytest.raises(OSError, match="step 4"):
        io.teardown()
    io.teardown()
    txckpt.forget_roots()
    history = txckpt.open_root(d).history()
    assert sorted(c.step for c in history.checkpoints.values()) == [1, 3]
    assert _ckpts(d) == ["s1.ckpt", "s3.ckpt"]


class _Recorded(L.Callback):
    """Changes the weights through ``.data`` (not the optimizer) after each step, then records
    them: ModelCheckpoint's save of that step follows (checkpoint callbacks run last)."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        module.layer.weight.data.add_(1.0)
        self.weights[trainer.global_step] = module.layer.weight.detach().clone()


def test_lazy_trainer_saves_equal_the_state_at_each_save_and_the_step_waits_after_its_closure(tmp_path):
    """The Trainer's lazy async saves: each of 12 checkpoints equals the weights at its save,
    including a change made through ``.data`` between the step and the save; each step that
    followed a save waited for its copy, inside its closure (after forward and backward)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = str(tmp_path / "lazy")
    recorded = _Recorded()
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=12,
        callbacks=[ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=-1), recorded],
        plugins=[TransactionalCheckpointIO(async_save="lazy")],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    model = TinyModule()
    trainer.fit(model, data(0))
    (opt,) = trainer.optimizers
    assert len(step_gate(opt).waits) == 11, "steps 2..12 each followed a lazy save"
    reader = TransactionalCheckpointIO()
    for step in range(1, 13):
        state = reader.load_checkpoint(os.path.join(d, f"epoch=0-step={step}.ckpt"))
        assert torch.equal(state["state_dict"]["layer.weight"], recorded.weights[step])
        assert state["optimizer_states"][0]["state"] == {}  # SGD without momentum: no state to copy


class _CountedEvent(threading.Event):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order
        self.set()

    def wait(self, timeout=None):  # type: ignore[override]
        self.order.append("wait")
        return super().wait(timeout)


@pytest.mark.parametrize("closure_given", ["positional", "keyword", None])
def test_a_copy_held_after_closure_is_waited_for_after_the_steps_closure(closure_given):
    """Lightning's automatic optimization runs forward and backward inside ``step(closure)``: the
    lazy mode's wait comes after them, before the update; a step without a closure waits first."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    order: list[str] = []
    step_gate(opt).hold(_CountedEvent(order), after_closure=True)

    def closure():
        order.append("closure")
        p.grad = torch.ones(3)
        return torch.zeros(())

    if closure_given == "positional":
        opt.step(closure)
        assert order == ["closure", "wait"]
    elif closure_given == "keyword":
        opt.step(closure=closure)
        assert order == ["closure", "wait"]
    else:
        closure()
        order.clear()
        opt.step()
        assert order == ["wait"]
    assert torch.equal(p.detach(), torch.full((3,), -1.0))


def test_lazy_a_change_not_through_the_step_before_the_copy_is_not_covered(tmp_path, monkeypatch):
    """Documented limit of async_save="lazy" (docs/lightning.md): between a save and the next
    optimizer step, the background may not have copied the weights yet; a change through
    ``.data`` then reaches the checkpoint unnoticed, one visible to autograd fails the save."""
    go = threading.Event()
    real = SnapshotPool.snapshot

    def held(self, files, live=frozenset(), only=None):
        if only is not None:  # the lazy half, in the background: waits until the test says
            go.wait()
        return real(self, files, live, only)

    monkeypatch.setattr(SnapshotPool, "snapshot", held)
    d = str(tmp_path / "lazy")
    io = TransactionalCheckpointIO(async_save="lazy")
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)

    def save(step: int) -> None:
        io.trainer_optimizers = [opt]
        io.save_checkpoint({"state_dict": {"w": w.detach()}, "global_step": step}, os.path.join(d, f"{step}.ckpt"))

    save(1)
    w.data.add_(1.0)  # not through the step, before the copy
    go.set()
    io.wait()
    assert torch.equal(io.load_checkpoint(os.path.join(d, "1.ckpt"))["state_dict"]["w"], torch.ones(4))
    go.clear()
    save(2)
    with torch.no_grad():
        w.add_(1.0)  # the version counter sees this one
    go.set()
    with pytest.raises(InvalidArgumentError, match="changed in place"):
        io.wait()


def test_async_save_takes_true_false_or_lazy():
    with pytest.raises(InvalidArgumentError, match="lazy"):
        TransactionalCheckpointIO(async_save="copy")


def _last_on(root: str, storage_options, tmp_path) -> None:
    local = str(tmp_path / "names")  # the ModelCheckpoint's dirpath: names only, the root is remote
    io = lambda: TransactionalCheckpointIO(root, storage_options=storage_options)  # noqa: E731
    fit(local, seed=0, max_steps=10, ckpt_path=None, plugins=[io()])
    fit(local, seed=0, max_steps=20, ckpt_path="last", plugins=[io()])
    c = fit(local, seed=0, max_steps=25, ckpt_path="last", plugins=[io()])
    assert c["resumed"] == 20 and "/.txckpt/tx/" in c["ckpt_path"], "the committed file, at its home"
    assert c["ckpt_path"].endswith("/checkpoint-20/epoch=0-step=20.ckpt")
    # Nothing local at all: no copy, no symlink; the names live in the log.
    assert not os.path.exists(local) or os.listdir(local) == []
    # Any name resolves through the log, with no file behind it.
    state = io().load_checkpoint(os.path.join(local, "epoch=0-step=10.ckpt"))
    assert state["global_step"] == 10


def test_last_on_memory_root(tmp_path, memory_root):
    url, options = memory_root
    _last_on(url, options or None, tmp_path)


@pytest.mark.s3
def test_last_on_s3_root(tmp_path, s3_root):
    url, options = s3_root
    _last_on(url, options, tmp_path)


def _standalone_module(pl):
    """A one-layer LightningModule of the standalone ``pytorch_lightning`` package; its loss is
    against the batch's second tensor where it has one."""

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            out = self.layer(batch[0])
            return (out - batch[1] if len(batch) > 1 else out).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Tiny


def test_standalone_pytorch_lightning_package(tmp_path):
    """``pytorch_lightning`` (the same Trainer under its old package name) takes the plugin too."""
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    Tiny = _standalone_module(pl)

    d = str(tmp_path / "pl")
    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=2)

    def run(max_steps: int, ckpt_path):
        t = pl.Trainer(
            max_steps=max_steps,
            plugins=[TransactionalCheckpointIO()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            callbacks=[ModelCheckpoint(dirpath=d, every_n_train_steps=4, save_top_k=-1, save_last=True)],
        )
        t.fit(Tiny(), loader, ckpt_path=ckpt_path)
        return t

    run(8, None)
    assert [c.step for c in txckpt.open_root(d).checkpoints()] == [4, 8]
    t = run(12, "last")
    assert "/checkpoint-8/" in str(t.ckpt_path) and t.global_step == 12


def test_standalone_pytorch_lightning_preemption_and_exact_resume(tmp_path):
    """SaveOnPreemption and ExactResume in ``pytorch_lightning``'s Trainer, whose ModelCheckpoint
    (and SLURMEnvironment) are that package's classes: a SIGTERM after step 3 (mid-epoch,
    shuffled data) saves step 3 into the ModelCheckpoint's dirpath and leaves ``fit`` with
    SystemExit(143); ``fit(ckpt_path="last")`` resumes step 3 and ends with the weights of the
    run that was never stopped."""
    import signal

    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from txckpt import preemption
    from txckpt.integrations.lightning import ExactResume, SaveOnPreemption

    Tiny = _standalone_module(pl)

    class TermAfter(pl.Callback):
        def __init__(self, step: int | None) -> None:
            self.step, self.started = step, None

        def on_train_start(self, trainer, module) -> None:
            self.started = trainer.global_step

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == self.step:
                signal.raise_signal(signal.SIGTERM)  # recorded by txckpt's handler: acted on at this boundary

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))

    def run(d: str, stop: int | None, ckpt_path: str | None) -> tuple[Any, TermAfter]:
        torch.manual_seed(0)
        term = TermAfter(stop)
        t = pl.Trainer(
            max_steps=6,
            plugins=[TransactionalCheckpointIO()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            callbacks=[term, SaveOnPreemption(), ExactResume(), ModelCheckpoint(dirpath=d, every_n_train_steps=100)],
        )
        model = Tiny()
        try:
            t.fit(model, DataLoader(data, batch_size=2, shuffle=True), ckpt_path=ckpt_path)
        finally:
            preemption.uninstall()
        return model, term

    whole, _ = run(str(tmp_path / "whole"), None, None)
    d = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        run(d, 3, None)
    assert e.value.code == 128 + signal.SIGTERM
    assert [c.step for c in txckpt.open_root(d).checkpoints()] == [3]
    resumed, term = run(d, None, "last")
    assert term.started == 3
    assert torch.equal(resumed.layer.weight, whole.layer.weight) and torch.equal(resumed.layer.bias, whole.layer.bias)


def test_resume_from_last_equals_the_uninterrupted_run(tmp_path):
    """An epoch-boundary checkpoint resumed by ckpt_path="last" continues bit for bit: the final
    weights equal those of one uninterrupted run (32 steps an epoch, unshuffled data, SGD)."""
    straight = fit(
        str(tmp_path / "straight"),
        seed=0,
        max_steps=64,
        ckpt_path=None,
        plugins=[TransactionalCheckpointIO()],
        every_n_train_steps=32,
    )
    d = str(tmp_path / "resumed")
    fit(
        d,
        seed=0,
        max_steps=32,
        ckpt_path=None,
        plugins=[TransactionalCheckpointIO(async_save=True)],
        every_n_train_steps=32,
    )
    resumed = fit(
        d,
        seed=0,
        max_steps=64,
        ckpt_path="last",
        plugins=[TransactionalCheckpointIO(async_save=True)],
        every_n_train_steps=32,
    )
    assert resumed["resumed"] == 32
    assert resumed["weight"] == straight["weight"]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_rotation_keeps_the_best_and_the_newest(tmp_path, request, kind):
    """save_top_k=1 with save_last: what stock keeps (the best and last.ckpt) is what stays
    committed; the rest is retired through the log: top-k's removals, and the checkpoints saved
    under last.ckpt alone once a newer one took the name (stock overwrites that file)."""
    dirpath = str(tmp_path / "names")
    if kind == "memory":
        url, options = request.getfixturevalue("memory_root")
        io = TransactionalCheckpointIO(url, storage_options=options or None)
        root = txckpt.open_root(url, options or None)
    else:
        io = TransactionalCheckpointIO()
        root = txckpt.open_root(dirpath)
    fit(dirpath, seed=0, max_steps=30, ckpt_path=None, plugins=[io], monitor="train_loss", save_top_k=1)
    assert root.history().retired, "rotation retired what it let go"
    kept = root.checkpoints()
    assert 30 in {c.step for c in kept} and len(kept) <= 2, [c.step for c in kept]
    if kind == "local":
        names = _ckpts(dirpath)
        assert len(names) == 2 and "last.ckpt" in names, names
        for n in names:  # every name left is a committed checkpoint's
            assert torch.load(os.path.join(dirpath, n), weights_only=False)["global_step"] in {c.step for c in kept}


def test_a_file_txckpt_did_not_commit_loads_as_lightning_loads_it_with_a_warning(tmp_path, caplog):
    path = str(tmp_path / "stock.ckpt")
    torch.save({"global_step": 7, "state_dict": {"w": torch.ones(2)}}, path)
    with caplog.at_level("WARNING", logger="txckpt"):
        state = TransactionalCheckpointIO().load_checkpoint(path)
    assert state["global_step"] == 7 and "unverified" in caplog.text


def test_a_crashed_links_leftover_goes_with_the_next_link_and_teardown_retires_the_superseded_last(tmp_path):
    d = str(tmp_path / "run")
    io = TransactionalCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, os.path.join(d, "last.ckpt"))
    # What a crash between os.link and the rename leaves: a temp link of the same name.
    os.link(os.path.join(d, "last.ckpt"), os.path.join(d, ".last.ckpt.0123456789ab.tmp"))
    io.save_checkpoint({"global_step": 2, "w": torch.full((2,), 2.0)}, os.path.join(d, "last.ckpt"))
    assert sorted(n for n in os.listdir(d) if n.endswith(".tmp")) == []
    io.teardown()  # step 1 was saved under last.ckpt alone, and step 2 holds the name now
    assert [c.step for c in txckpt.open_root(d).checkpoints()] == [2]
    assert torch.equal(torch.load(os.path.join(d, "last.ckpt"))["w"], torch.full((2,), 2.0))


class _TwoRanks:
    """Two ranks of a sharded strategy as threads of this process: what the plugin's sharded
    save uses of ModelParallelStrategy (global_rank, broadcast from rank 0, barrier), exchanged
    through a real barrier, each object pickled as torch's broadcast_object_list sends it."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.sent: list[bytes] = []

    def rank(self, global_rank: int) -> Any:
        ranks = self

        class Strategy:
            def __init__(self) -> None:
                self.global_rank = global_rank

            def broadcast(self, obj: Any, src: int = 0) -> Any:
                if global_rank == 0:
                    ranks.sent.append(pickle.dumps(obj))
                ranks.barrier.wait()  # BrokenBarrierError once the test gives up on rank 0
                got = pickle.loads(ranks.sent[-1])
                ranks.barrier.wait()
                return obj if global_rank == 0 else got

            def barrier(self, name: str | None = None) -> None:
                ranks.barrier.wait()

        return Strategy()


def test_a_sharded_saves_failure_on_rank_0_before_dcp_is_raised_by_every_rank(tmp_path):
    """Global rank 0 alone decides the lineage and retires superseded checkpoints before the
    sharded save's collectives; when that fails (here: the lineage to resume is not in the log),
    every rank raises the same typed error, with its fields, at once instead of the others
    waiting for their collective timeout."""
    from txckpt.errors import LineageNotFoundError

    ranks = _TwoRanks()
    ios = [TransactionalCheckpointIO(), TransactionalCheckpointIO()]

    def choose_lineage(*args: Any) -> None:
        raise LineageNotFoundError("lineage L7 is not in this root's log", lineage="L7", known=["L1"])

    ios[0]._choose_lineage = choose_lineage  # type: ignore[method-assign]
    raised: list[BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            ios[rank]._save_sharded(ranks.rank(rank), {"global_step": 2}, str(tmp_path / "run" / "step=2.ckpt"))
        except BaseException as e:  # noqa: BLE001 - what each rank raised is the assertion
            raised[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    threads[0].join()
    ranks.barrier.abort()  # rank 0 is done: a rank still waiting for it would wait forever
    threads[1].join()
    assert type(raised[0]) is LineageNotFoundError, raised
    assert type(raised[1]) is LineageNotFoundError and str(raised[1]) == str(raised[0]), raised
    assert (raised[1].lineage, raised[1].known) == ("L7", ["L1"])  # type: ignore[union-attr]
    if sys.version_info >= (3, 11):  # exception notes
        assert "raised on global rank 0" in "".join(getattr(raised[1], "__notes__", []))


def test_a_crashed_directory_of_links_goes_with_the_next_publication_of_its_name(tmp_path):
    """A sharded checkpoint's name is a directory of links built under ``.<name>.<hex>.tmp``; a
    crash while it is built (or before the swapped-out one is removed) leaves that directory. The
    next publication of the name removes it; the committed files keep their bytes, and a
    directory of another name (or one holding a directory: not the plugin's) stays."""
    from txckpt.integrations._lightning.names import publish_dir

    committed = tmp_path / "checkpoint-4"
    committed.mkdir()
    for n, content in ((".metadata", b"m"), ("meta.pt", b"p"), ("__0_0.distcp", b"s0")):
        (committed / n).write_bytes(content)
    d = tmp_path / "run"
    d.mkdir()
    leftover = d / ".step=4.ckpt.0123456789ab.tmp"  # half built: one link made, then the crash
    leftover.mkdir()
    os.link(committed / ".metadata", leftover / ".metadata")
    other = d / ".step=40.ckpt.0123456789ab.tmp"  # another name's
    other.mkdir()
    nested = d / ".step=4.ckpt.ba9876543210.tmp"  # holds a directory: not made by publish_dir
    (nested / "sub").mkdir(parents=True)
    publish_dir(str(committed), str(d / "step=4.ckpt"), durable=False, aside=str(tmp_path / "aside"))
    assert sorted(os.listdir(d)) == [".step=4.ckpt.ba9876543210.tmp", ".step=40.ckpt.0123456789ab.tmp", "step=4.ckpt"]
    assert sorted(os.listdir(d / "step=4.ckpt")) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert (committed / ".metadata").read_bytes() == b"m" and os.stat(committed / ".metadata").st_nlink == 2
    assert not (tmp_path / "aside").exists()


def test_a_stock_checkpoint_at_a_name_the_plugin_publishes_is_moved_aside_not_overwritten(tmp_path, caplog):
    """A stock run left its checkpoints in dirpath, and ModelCheckpoint(enable_version_counter=
    False) gives the next run's the same names: publishing a name never replaces bytes txckpt
    did not commit. They go to the root's orphans, whole, with a warning."""
    d = str(tmp_path / "run")
    fit(d, seed=0, max_steps=5, ckpt_path=None, plugins=[], enable_version_counter=False)
    stock = {n: open(os.path.join(d, n), "rb").read() for n in _ckpts(d)}
    assert set(stock) == {"epoch=0-step=5.ckpt", "last.ckpt"}
    fit(d, seed=1, max_steps=5, ckpt_path=None, plugins=[TransactionalCheckpointIO()], enable_version_counter=False)
    committed = txckpt.get_last_checkpoint(d)
    for name in stock:
        assert os.path.samefile(os.path.join(d, name), os.path.join(committed, "epoch=0-step=5.ckpt"))
    orphans = os.path.join(d, ".txckpt", "orphans")
    kept = {n.split(".ckpt")[0] + ".ckpt": open(os.path.join(orphans, n), "rb").read() for n in os.listdir(orphans)}
    assert kept == stock
    assert "txckpt did not commit" in caplog.text
