"""SIGKILL a real process before and after every file operation of a save, a commit, a publish,
a fork and an adoption; after each crash a fresh process checks the invariants of
docs/protocol.md section 12.

In the campaign each sweep tries every point around an operation that flips what a reader sees
(a manifest, log entry or `latest` put in place, a publication) and a seeded 40% of the others;
the seed is in the summary line (`TXCKPT_SWEEP_SEED=<seed>` repeats a draw) and varies per run,
so the runs cover every point between them; `TXCKPT_FULL_SWEEP=1` tries every point
(tests/harness/sampling.py)."""

import os

import pytest
import torch

import txckpt
from tests.harness.crash_sweep import report, sweep

pytestmark = pytest.mark.slow


def files(tag: str, step: int):
    """A three-file checkpoint whose every file carries ``tag``, so a mix is detectable."""
    return {
        "model.safetensors": {
            "w": torch.full((64,), float(step)),
            "tag": torch.tensor(list(tag.encode()), dtype=torch.uint8),
        },
        "optimizer.pt": {"state": torch.full((32,), float(step)), "tag": tag},
        "trainer_state.json": {"global_step": step, "tag": tag},
    }


def tags_of(path: str) -> set[str]:
    if not os.path.exists(os.path.join(path, txckpt.MANIFEST_NAME)):
        # A legacy checkpoint (no txckpt manifest yet): read it as a stock Trainer would.
        import json

        from safetensors.torch import load_file

        data = {
            "model.safetensors": load_file(os.path.join(path, "model.safetensors")),
            "optimizer.pt": torch.load(os.path.join(path, "optimizer.pt")),
            "trainer_state.json": json.load(open(os.path.join(path, "trainer_state.json"))),
        }
    else:
        data = txckpt.load_checkpoint(path)  # verifies sizes and checksums of every file
    return {
        bytes(data["model.safetensors"]["tag"].tolist()).decode(),
        data["optimizer.pt"]["tag"],
        data["trainer_state.json"]["tag"],
    }


def snapshot(root: str) -> dict[str, str]:
    """txid -> manifest digest of every committed checkpoint (all lineages)."""
    return {c.txid: txckpt.read_manifest(c.path).digest for c in txckpt.CheckpointRoot(root).checkpoints("all")}


def make_checker(allowed: set, before: dict[str, str], restart_tag: str, legacy: dict | None = None):
    """``allowed``: the (tag) values lookup may return after a crash (None: no checkpoint)."""

    def check(root: str, k: int, when: str) -> list[str]:
        v: list[str] = []
        txckpt.forget_roots()
        last = txckpt.get_last_checkpoint(root)
        if last is None:
            if None not in allowed:
                v.append("lookup returned None")
        else:
            tags = tags_of(last)
            if len(tags) != 1:
                v.append(f"{last} mixes files of {sorted(tags)}")
            elif tags.pop() not in allowed:
                v.append(f"lookup returned {last} with an unexpected tag")
            if "/.txckpt/tx/" in last and txckpt.read_manifest(last).txid not in {
                c.txid for c in txckpt.CheckpointRoot(root).checkpoints("all")
            }:
                v.append(f"lookup returned uncommitted staging {last}")
        if before:
            now = {c.txid: c for c in txckpt.CheckpointRoot(root).checkpoints("all")}
            for txid, digest in before.items():
                c = now.get(txid)
                if c is None or c.path is None:
                    v.append(f"committed checkpoint {txid} is gone")
                    continue
                if txckpt.read_manifest(c.path).digest != digest:
                    v.append(f"committed checkpoint {txid} changed its manifest")
                txckpt.verify_checkpoint(c.path)
        if legacy:
            for rel, content in legacy.items():
                with open(os.path.join(root, rel), "rb") as f:
                    if f.read() != content:
                        v.append(f"legacy file {rel} changed")
        # A restart continues: resume the current lineage and save past it.
        txckpt.forget_roots()
        r = txckpt.CheckpointRoot(root)
        resumed = r.resume()
        step = 100 if resumed is None else txckpt.read_manifest(resumed).step + 1 if r.state().seq >= 0 else 100
        path = r.save(step, files(restart_tag, step))
        if tags_of(txckpt.get_last_checkpoint(root)) != {restart_tag} or txckpt.get_last_checkpoint(root) != path:
            v.append("the restart's save is not what lookup returns")
        return v

    return check


def test_sweep_three_file_save(tmp_path):
    template = str(tmp_path / "template")
    txckpt.save_checkpoint(template, 2, files("A-2", 2))
    before = snapshot(template)
    result = sweep(
        "save",
        template,
        str(tmp_path / "work"),
        lambda root: txckpt.save_checkpoint(root, 4, files("A-4", 4)),
        make_checker({"A-2", "A-4"}, before, "R"),
        sampled=True,
    )
    assert len(result.ops) >= 20  # three files, fsyncs, manifest, log entry, publication
    report(result)


def test_sweep_fork_and_resave(tmp_path):
    """The seed report's torn case: roll back to 2 and re-save 4 over run A's checkpoint-4."""
    template = str(tmp_path / "template")
    for s in (2, 4, 6):
        txckpt.save_checkpoint(template, s, files(f"A-{s}", s))
    txckpt.forget_roots()
    before = snapshot(template)

    def scenario(root):
        txckpt.resume(root, step=2)
        txckpt.save_checkpoint(root, 4, files("B-4", 4))

    result = sweep(
        "fork + re-save + publish over another lineage",
        template,
        str(tmp_path / "work"),
        scenario,
        make_checker({"A-6", "A-2", "B-4"}, before, "R"),
        sampled=True,
    )
    report(result)


def test_sweep_first_save_on_new_root(tmp_path):
    template = str(tmp_path / "template")
    os.makedirs(template)
    result = sweep(
        "first save on an empty root",
        template,
        str(tmp_path / "work"),
        lambda root: txckpt.save_checkpoint(root, 2, files("A-2", 2)),
        make_checker({None, "A-2"}, {}, "R"),
        sampled=True,
    )
    report(result)


def test_sweep_adoption_of_a_legacy_root(tmp_path):
    template = str(tmp_path / "template")
    legacy = {}
    for s in (2, 4):
        d = os.path.join(template, f"checkpoint-{s}")
        os.makedirs(d)
        # A stock Trainer's checkpoint, written without txckpt.
        from safetensors.torch import save_file

        t = files(f"L-{s}", s)
        save_file(t["model.safetensors"], os.path.join(d, "model.safetensors"))
        torch.save(t["optimizer.pt"], os.path.join(d, "optimizer.pt"))
        import json

        with open(os.path.join(d, "trainer_state.json"), "w") as f:
            json.dump(t["trainer_state.json"], f)
        for name in os.listdir(d):
            legacy[f"checkpoint-{s}/{name}"] = open(os.path.join(d, name), "rb").read()

    result = sweep(
        "adoption of a legacy root + save",
        template,
        str(tmp_path / "work"),
        lambda root: txckpt.save_checkpoint(root, 6, files("A-6", 6)),
        make_checker({"L-4", "A-6"}, {}, "R", legacy=legacy),
        sampled=True,
    )
    report(result)


def test_sweep_incremental_save_that_shares_a_file(tmp_path):
    """An incremental save (docs/incremental.md) that shares a committed file (a hard link to
    step 2's) and writes the changed ones: after a SIGKILL at any point, step 2 still verifies
    (its shared file was never opened for writing) and lookup returns step 2 or step 4, whole."""
    frozen = {"frozen.safetensors": {"w": torch.arange(1 << 19, dtype=torch.float32)}}  # 2 MiB
    template = str(tmp_path / "template")
    txckpt.save_checkpoint(template, 2, {**files("A-2", 2), **frozen}, incremental=True)
    txckpt.forget_roots()
    before = snapshot(template)
    result = sweep(
        "incremental save sharing a file",
        template,
        str(tmp_path / "work"),
        lambda root: txckpt.save_checkpoint(root, 4, {**files("A-4", 4), **frozen}, incremental=True),
        make_checker({"A-2", "A-4"}, before, "R"),
        sampled=True,
    )
    assert any(op.startswith("link") for op in result.ops), result.ops  # the share is one of them
    report(result)


def test_sweep_grouped_incremental_save_sharing_a_frozen_shard(tmp_path):
    """Issue 47: an incremental save of one model.safetensors whose frozen tensor sits in a stock
    shard of its own (the grouped layout, docs/incremental.md): the shard is a hard link to step
    3's, the changed tensors and the index are written. After a SIGKILL at any point, lookup
    returns step 3 or step 4, whole (its shards loaded back as the one file), and step 3 verifies."""
    base = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB, never trained

    def grouped(tag: str, step: int) -> dict:
        out = files(tag, step)
        out["model.safetensors"] = {**out["model.safetensors"], "base": base}
        return out

    template = str(tmp_path / "template")
    for step, tag in ((2, "A-2"), (3, "A-3")):  # step 3 writes the frozen shard once
        txckpt.save_checkpoint(template, step, grouped(tag, step), incremental=True)
    assert os.path.exists(os.path.join(template, "checkpoint-3", "model-00001-of-00002.safetensors"))
    txckpt.forget_roots()
    before = snapshot(template)
    result = sweep(
        "grouped incremental save sharing a frozen shard",
        template,
        str(tmp_path / "work"),
        lambda root: txckpt.save_checkpoint(root, 4, grouped("A-4", 4), incremental=True),
        make_checker({"A-3", "A-4"}, before, "R"),
        sampled=True,
    )
    assert any(op.startswith("link") for op in result.ops), result.ops  # the frozen shard's share
    report(result)


def test_sweep_incremental_file_written_into_the_directory(tmp_path):
    """An incremental transaction whose unchanged file other code writes into tx.directory (a
    Trainer's save): it is written, hashed, then replaced by a hard link to step 2's file under a
    temp name and a rename. A SIGKILL at any point leaves step 2 whole and lookup returning step 2
    or step 4, whole."""
    from txckpt._save.serialization import write_object

    frozen = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB

    def save(root, step, tag):
        with txckpt.transaction(root, step, incremental=True) as tx:
            for name, obj in {**files(tag, step), "frozen.safetensors": frozen}.items():
                with open(os.path.join(tx.directory, name), "wb") as f:
                    write_object(name, obj, f)
        return tx.path

    template = str(tmp_path / "template")
    save(template, 2, "A-2")
    txckpt.forget_roots()
    before = snapshot(template)
    result = sweep(
        "incremental save of a file written into tx.directory",
        template,
        str(tmp_path / "work"),
        lambda root: save(root, 4, "A-4"),
        make_checker({"A-2", "A-4"}, before, "R"),
        sampled=True,
    )
    assert any(op.startswith("link") for op in result.ops), result.ops  # the share is one of them
    report(result)
