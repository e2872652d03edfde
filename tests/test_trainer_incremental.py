"""The Trainer's ``txckpt_incremental=True`` (issue 30): a model with a frozen base saved in shards
(what ``save_pretrained`` does with any model past ``max_shard_size``) writes its frozen shards
once. On a local root every later checkpoint holds them as hard links of the first, and stock
transformers loads each published ``checkpoint-N/`` (from_pretrained and a stock resume); on an
object store they are copied on the server and only the changed files are uploaded."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback

import txckpt
from tests.harness.tiny import Data, TinyConfig, make_args
from txckpt.integrations.transformers import TransactionalTrainer

pytestmark = pytest.mark.trainer


class FrozenBaseModel(PreTrainedModel):
    """A 2 MiB frozen "base" (two 1 MiB blocks) and a trainable 8 -> 1 head."""

    config_class = TinyConfig
    main_input_name = "x"

    def __init__(self, config):
        super().__init__(config)
        self.base_a = nn.Linear(512, 512, bias=False)
        self.base_b = nn.Linear(512, 512, bias=False)
        self.head = nn.Linear(8, 1)
        for p in (*self.base_a.parameters(), *self.base_b.parameters()):
            p.requires_grad_(False)
        self.post_init()

    def forward(self, x=None, labels=None):
        z = self.base_a.weight[:8, :8] @ x.T  # uses the base without training it
        out = self.head(x + 0 * z.T).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    def save_pretrained(self, *args, **kwargs):
        # A big model's save: shards of at most 1 MB (upstream's default is 5 GB / 50 GB).
        kwargs.setdefault("max_shard_size", "1MB")
        return super().save_pretrained(*args, **kwargs)


class Sizes(TrainerCallback):
    """Bytes uploaded to the S3 server by the time each save's on_save runs (after its commit)."""

    def __init__(self, counter):
        self.counter, self.at = counter, {}

    def on_save(self, args, state, control, **kwargs):
        self.at[state.global_step] = self.counter.uploaded_bytes


def train(out, max_steps, resume=None, cls=TransactionalTrainer, callbacks=(), **kw):
    torch.manual_seed(0)
    trainer = cls(
        model=FrozenBaseModel(TinyConfig()),
        args=make_args(str(out), max_steps),
        train_dataset=Data(0),
        callbacks=list(callbacks),
        **kw,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def gpt2(n_layer: int = 2, n_embd: int = 32):
    """A small GPT-2, everything frozen but the last block and ``ln_f`` (the issue's new user)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(cfg)
    model.requires_grad_(False)
    model.transformer.h[-1].requires_grad_(True)
    model.transformer.ln_f.requires_grad_(True)
    return model


def shards(path: str) -> dict[str, int]:
    return {n: os.stat(os.path.join(path, n)).st_ino for n in os.listdir(path) if n.endswith(".safetensors")}


@pytest.mark.parametrize("async_save", [False, True])
def test_frozen_shards_are_kept_once_and_stock_transformers_loads_every_checkpoint(tmp_path, async_save):
    out = tmp_path / "out"
    t = train(out, 6, txckpt_incremental=True, txckpt_async_save=async_save)
    paths = [str(out / f"checkpoint-{s}") for s in (2, 4, 6)]
    first, *later = [shards(p) for p in paths]
    assert len(first) >= 3, first  # two frozen shards and the head's
    # Each frozen shard is one inode in every checkpoint; the head's shard changes every save.
    frozen = {n for n in first if all(s[n] == first[n] for s in later)}
    assert len(frozen) == len(first) - 1, (first, later)
    # Disk: the base once, plus each checkpoint's own files.
    seen, on_disk, apparent = set(), 0, 0
    for p in paths:
        txckpt.verify_checkpoint(p)
        for name in os.listdir(p):
            st = os.stat(os.path.join(p, name))
            apparent += st.st_size
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                on_disk += st.st_size
    base = sum(os.path.getsize(os.path.join(paths[0], n)) for n in frozen)
    assert on_disk <= apparent - 2 * base, (on_disk, apparent, base)
    # Stock transformers reads every published checkpoint as it is.
    loaded = FrozenBaseModel.from_pretrained(paths[-1])
    for k, v in t.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    for p in paths[:-1]:
        assert torch.equal(FrozenBaseModel.from_pretrained(p).base_b.weight, t.model.base_b.weight)
    stock = train(tmp_path / "stock", 8, resume=paths[1], cls=Trainer)
    assert stock.state.global_step == 8


@pytest.mark.s3
def test_s3_uploads_only_the_changed_files(tmp_path, s3_root, s3_requests):
    url, so = s3_root
    sizes = Sizes(s3_requests)
    train(tmp_path / "out", 4, callbacks=[sizes], txckpt_incremental=True, txckpt_root=url, txckpt_storage_options=so)
    txckpt.forget_roots()
    cps = {c.step: c for c in txckpt.CheckpointRoot(url, storage_options=so).checkpoints()}
    before = txckpt.verify_checkpoint(cps[2].path, storage_options=so).files
    after = txckpt.verify_checkpoint(cps[4].path, storage_options=so).files
    changed = sum(e.size for n, e in after.items() if n not in before or before[n].checksum != e.checksum)
    unchanged = sum(e.size for n, e in after.items() if n in before and before[n].checksum == e.checksum)
    uploaded = sizes.at[4] - sizes.at[2]
    assert unchanged >= 2 << 20  # the frozen shards
    # The changed files, the manifest (which names every file), the log entry and the intent.
    manifest = len(txckpt.read_manifest(cps[4].path, storage_options=so).encode())
    print(f"save 2: uploaded {uploaded} B; changed files {changed} B, manifest {manifest} B, shared {unchanged} B")
    assert uploaded <= 1.05 * changed + manifest + 8192, (uploaded, changed, manifest)


def test_one_model_safetensors_gets_its_frozen_tensors_a_shard_of_their_own(tmp_path):
    """Issue 47: a small GPT-2 below ``max_shard_size`` (one ``model.safetensors``), everything
    frozen but the last block and ``ln_f``: with ``txckpt_incremental=True`` its frozen tensors go
    in a stock shard of their own from the first save, shared by every later one; stock
    ``from_pretrained`` of each checkpoint is the model as saved, tied ``lm_head`` included, and a
    stock Trainer resumes."""
    from transformers import GPT2LMHeadModel

    class Snapshots(TrainerCallback):
        def __init__(self):
            self.at = {}

        def on_save(self, args, state, control, model=None, **kwargs):
            self.at[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}

    ids = torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "labels": i} for i in ids]
    snaps = Snapshots()
    out = tmp_path / "out"
    TransactionalTrainer(
        model=gpt2(), args=make_args(str(out), 6), train_dataset=data, callbacks=[snaps], txckpt_incremental=True
    ).train()
    paths = [str(out / f"checkpoint-{s}") for s in (2, 4, 6)]
    layouts = [shards(p) for p in paths]
    assert [sorted(s) for s in layouts] == [
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    ] * 3
    frozen_ino = {s["model-00001-of-00002.safetensors"] for s in layouts}
    assert len(frozen_ino) == 1  # written once, shared by the later saves
    assert len({s["model-00002-of-00002.safetensors"] for s in layouts}) == 3  # the trained block, new each time
    with open(os.path.join(paths[0], "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert "lm_head.weight" not in weight_map  # tied to wte: written once, as save_pretrained does
    assert {k for k, v in weight_map.items() if v == "model-00002-of-00002.safetensors"} == {
        k for k, _ in gpt2().named_parameters() if k.startswith(("transformer.h.1.", "transformer.ln_f."))
    }
    for step, path in zip((2, 4, 6), paths):
        txckpt.verify_checkpoint(path)
        loaded = GPT2LMHeadModel.from_pretrained(path).state_dict()
        for k, v in snaps.at[step].items():
            assert torch.equal(loaded[k], v), (step, k)
    stock = Trainer(model=gpt2(), args=make_args(str(tmp_path / "stock"), 8), train_dataset=data)
    stock.train(resume_from_checkpoint=paths[1])
    assert stock.state.global_step == 8
    # txckpt's resume reads it too, and its next save shares the frozen shard again.
    resumed = TransactionalTrainer(
        model=gpt2(), args=make_args(str(out), 8), train_dataset=data, txckpt_incremental=True
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 8
    assert shards(str(out / "checkpoint-8"))["model-00001-of-00002.safetensors"] in frozen_ino


class AtSave(TrainerCallback):
    """The model's state at each save, taken when the step decides to save (on_step_end, after
    the default flow callback set should_save): an async save's on_save runs only after its
    commit, when training has moved on."""

    def __init__(self):
        self.at = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if control.should_save:
            self.at[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def disk_usage(root) -> int:
    """The bytes of every file under ``root``, a hard-linked inode counted once."""
    seen, total = set(), 0
    for d, _, names in os.walk(root):
        for n in names:
            st = os.stat(os.path.join(d, n))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


@pytest.mark.parametrize("mode", ["lazy", "copy"])
def test_async_saves_keep_the_frozen_base_once_too(tmp_path, mode):
    """Issue 47: ``txckpt_async_save`` (lazy and copy-first) with ``txckpt_incremental=True`` saves
    the model's one ``model.safetensors`` grouped as the synchronous save does: the frozen
    tensors in a stock shard written once (one inode in every checkpoint), so the root grows per
    save by the trained tensors, the optimizer and the small files only; stock
    ``from_pretrained`` of each checkpoint is the model at that save."""
    from transformers import GPT2LMHeadModel

    class Growth(TrainerCallback):
        """The root's disk usage when each save's on_save runs (after its commit)."""

        def __init__(self):
            self.at = {}

        def on_save(self, args, state, control, **kwargs):
            self.at[state.global_step] = disk_usage(out)

    ids = torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "labels": i} for i in ids]
    at_save, growth = AtSave(), Growth()
    out = tmp_path / "out"
    TransactionalTrainer(
        model=gpt2(n_layer=4, n_embd=64),
        args=make_args(str(out), 6),
        train_dataset=data,
        callbacks=[at_save, growth],
        txckpt_incremental=True,
        txckpt_async_save=mode,
    ).train()
    paths = [str(out / f"checkpoint-{s}") for s in (2, 4, 6)]
    layouts = [shards(p) for p in paths]
    frozen_shard = "model-00001-of-00002.safetensors"
    assert [sorted(s) for s in layouts] == [[frozen_shard, "model-00002-of-00002.safetensors"]] * 3
    assert len({s[frozen_shard] for s in layouts}) == 1  # written once, shared by the later saves
    frozen_size = os.path.getsize(os.path.join(paths[0], frozen_shard))
    for before, step, path in zip((2, 4), (4, 6), paths[1:]):
        # This checkpoint's own bytes: every file but the shared frozen shard (the trained
        # tensors' shard, the optimizer, scheduler, RNG state, JSON files), and its manifest.
        own = sum(
            os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names if n != frozen_shard
        )
        manifest = len(txckpt.read_manifest(path).encode())
        grown = growth.at[step] - growth.at[before]
        assert grown <= own + manifest + (16 << 10), (step, grown, own, manifest, frozen_size)
    assert frozen_size > 16 * (16 << 10)  # so a base written again could not pass the bound above
    for step, path in zip((2, 4, 6), paths):
        txckpt.verify_checkpoint(path)
        loaded = GPT2LMHeadModel.from_pretrained(path).state_dict()
        for k, v in at_save.at[step].items():
            assert torch.equal(loaded[k], v), (step, k)
    stock = Trainer(model=gpt2(n_layer=4, n_embd=64), args=make_args(str(tmp_path / "stock"), 8), train_dataset=data)
    stock.train(resume_from_checkpoint=paths[1])
    assert stock.state.global_step == 8
