"""Consolidate a committed ZeRO-3 checkpoint into a loadable model, as docs/distributed.md says:

  trainer_zero_consolidate.py CHECKPOINT DEST

Verifies CHECKPOINT, shows that from_pretrained cannot read it (no weights file), rebuilds the
fp32 weights with DeepSpeed's get_fp32_state_dict_from_zero_checkpoint, saves them to DEST with
save_pretrained and loads DEST back with from_pretrained. Prints one JSON line of findings.
"""

import json
import os
import sys

import torch

import txckpt

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repository: tests.harness
from tests.harness.tiny import TinyConfig, TinyModel

if __name__ == "__main__":
    ckpt, dest = sys.argv[1], sys.argv[2]
    txckpt.verify_checkpoint(ckpt)
    try:
        TinyModel.from_pretrained(ckpt)
        refused = None
    except OSError as e:
        refused = str(e)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    model = TinyModel(TinyConfig())
    model.load_state_dict(state, strict=True)
    model.save_pretrained(dest)
    back = TinyModel.from_pretrained(dest)
    same = all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    txckpt.verify_checkpoint(ckpt)  # consolidating read the checkpoint, wrote nothing into it
    print(json.dumps({"refused": refused, "keys": sorted(state), "round_trip": same}), flush=True)
