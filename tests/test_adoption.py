"""Adoption of legacy roots ("Trust at the edges", items 1 and 2; docs/protocol.md §9).

1. Concurrent adopters: the one that loses entry 0 changes nothing anywhere; a committed manifest
   is never rewritten; gc never deletes legacy bytes a committed adopted checkpoint references.
2. Zero-padded names (``checkpoint-00500``) are adopted at the name they have; a checkpoint with
   no files is never committed; two names for one step are a typed error naming both.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import txckpt
from txckpt.gc import collect_garbage
from txckpt.manifest import MANIFEST_NAME, Manifest
from txckpt.root import CheckpointRoot

def make_legacy(root: str, names=("checkpoint-10", "checkpoint-20", "checkpoint-30")) -> dict[str, bytes]:
    """Stock-Trainer-style directories (no txckpt manifest); returns {relative path: bytes}."""
    out = {}
    for i, name in enumerate(names):
        d = os.path.join(root, name)
        os.makedirs(d)
        torch.save({"w": torch.full((4,), float(i))}, os.path.join(d, "w.bin"))
        with open(os.path.join(d, "trainer_state.json"), "w") as f:
            json.dump({"global_step": i}, f)
        for n in os.listdir(d):
            out[f"{name}/{n}"] = open(os.path.join(d, n), "rb").read()
    return out


def _foreign_manifest(root: str, name: str, lineage: str) -> bytes:
    """An adoption manifest of other bytes (the files changed since it was written)."""
    m = Manifest(f"adopted-10-{lineage}", lineage, 10, None, {}, 0.0, adopted=True)
    data = m.encode()
    with open(os.path.join(root, name, MANIFEST_NAME), "wb") as f:
        f.write(data)
    return data


def test_gc_keeps_legacy_data_moved_under_an_uncommitted_adopted_txid(tmp_path):
    """The end of the chain the old race started: checkpoint-10 held a manifest no log committed
    (the losing adopter's), a new save of step 10 moved it to that txid's home, and gc deleted it
    as uncommitted staging: the only copy of committed adopted step 10."""
    root = str(tmp_path / "out")
    legacy = make_legacy(root)
    r = CheckpointRoot(root)
    r.adopt()
    # What the old losing adopter left in checkpoint-10: its own manifest over the committed one.
    _foreign_manifest(root, "checkpoint-10", "0badf00d")
    txckpt.forget_roots()
    txckpt.new_lineage(root)
    txckpt.save_checkpoint(root, 10, {"w.bin": torch.ones(4)})
    moved = os.path.join(root, ".txckpt", "tx", "adopted-10-0badf00d", "checkpoint-10")
    assert os.path.isdir(moved)
    rep = collect_garbage(CheckpointRoot(root), grace_seconds=0.0)
    assert os.path.isdir(moved)
    assert not [i for i in rep.of("staging") if "adopted-10" in i.key]
    assert any("adopted-10-0badf00d" in k.key for k in rep.kept)
    for rel, data in legacy.items():
        if rel.startswith("checkpoint-10/"):
            assert open(os.path.join(moved, rel.split("/", 1)[1]), "rb").read() == data


