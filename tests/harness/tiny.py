"""The seed report's tiny model and data, shared by the Trainer test scripts (tests/children/trainer_*.py)
and the tests (a library).

Works with transformers 4.57 (PretrainedConfig) and 5.x (PreTrainedConfig).
"""

import hashlib
import json
import os

import torch
from torch import nn
from transformers import PreTrainedModel, TrainerCallback, TrainingArguments

try:
    from transformers import PreTrainedConfig as _Config
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as _Config

FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")


class TinyConfig(_Config):
    model_type = "tiny"


class TinyModel(PreTrainedModel):
    config_class = TinyConfig
    main_input_name = "x"

    def __init__(self, config):
        super().__init__(config)
        self.fc = nn.Linear(8, 1)
        self.post_init()

    def forward(self, x=None, labels=None):
        out = self.fc(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, seed, n=64):
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, generator=g)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Start(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"  training begins at global_step={state.global_step}", flush=True)


def make_args(out, max_steps, **overrides):
    kw = dict(
        output_dir=out,
        max_steps=max_steps,
        save_steps=2,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def digests(ckpt, files=FILES):
    out = {}
    for f in files:
        with open(os.path.join(ckpt, f), "rb") as fh:
            out[f] = hashlib.sha1(fh.read()).hexdigest()
    return out


def root_kwargs():
    """The Trainer keywords the test asked for: the txckpt root ``TXCKPT_TEST_ROOT`` (a URL; output_dir stays local)
    with ``TXCKPT_TEST_STORAGE_OPTIONS`` (JSON), as constructor keywords of the Trainer; none
    (the root is output_dir) when unset."""
    # TXCKPT_TEST_ASYNC=1: the same run with txckpt_async_save=True (tests/test_trainer_async.py).
    kw = {"txckpt_async_save": True} if os.environ.get("TXCKPT_TEST_ASYNC") == "1" else {}
    root = os.environ.get("TXCKPT_TEST_ROOT")
    if not root:
        return kw
    return {
        **kw,
        "txckpt_root": root,
        "txckpt_storage_options": json.loads(os.environ.get("TXCKPT_TEST_STORAGE_OPTIONS") or "{}"),
    }
