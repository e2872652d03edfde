"""Adoption of legacy roots ("Trust at the edges", items 1 and 2; docs/protocol.md §9).

1. Concurrent adopters: the one that loses entry 0 changes nothing anywhere; a committed manifest
   is never rewritten; gc never deletes legacy bytes a committed adopted checkpoint references.
2. Zero-padded names (``checkpoint-00500``) are adopted at the name they have; a checkpoint with
   no files is never committed; two names for one step are a typed error naming both.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

import txckpt
from txckpt.errors import AdoptionInProgressError, AmbiguousCheckpointNameError
from txckpt._maintenance.gc import collect_garbage
from txckpt._maintenance.intents import intent_record
from txckpt._base.layout import MANIFEST_NAME
from txckpt._manifest.manifest import Manifest
from txckpt._base.layout import INTENTS_DIR
from txckpt._root.root import CheckpointRoot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def assert_adopted_intact(root: str, legacy: dict[str, bytes], steps: list[int]) -> None:
    """Every adopted checkpoint is where the log says, its manifest is the committed one, and the
    legacy bytes are unchanged; lookup returns the highest step; verify passes."""
    txckpt.forget_roots()
    r = CheckpointRoot(root)
    hist = r.history()
    adopted = sorted((c for c in hist.checkpoints.values() if c.adopted), key=lambda c: c.step)
    assert [c.step for c in adopted] == steps
    for c in adopted:
        key = r.publication.locate(c.ref)
        assert key is not None, f"adopted step {c.step} (txid {c.txid}): data missing"
        m = txckpt.verify_checkpoint(r.storage.full_path(key))
        assert m.digest == c.digest
    for rel, data in legacy.items():
        assert open(os.path.join(root, rel), "rb").read() == data, rel
    last = txckpt.get_last_checkpoint(root)
    assert last is not None and txckpt.read_manifest(last).step == steps[-1]
    assert txckpt.load_checkpoint(last)["w.bin"]["w"].shape == (4,)
    p = subprocess.run(
        [sys.executable, "-m", "txckpt", "verify", root], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr


# ----- item 1: concurrent adoption ---------------------------------------------------------------
def _run_first_when_b_writes_a_manifest(b: CheckpointRoot, first) -> list:
    """Deterministic interleaving: the first time ``b`` writes a manifest (create or replace),
    ``first()`` runs to completion before that write goes ahead."""
    done: list = []
    for method in ("create_exclusive", "replace"):
        real = getattr(b.storage, method)

        def hooked(key, *args, _real=real, **kwargs):
            if key.endswith(MANIFEST_NAME) and not done:
                done.append(first())
            return _real(key, *args, **kwargs)

        setattr(b.storage, method, hooked)
    return done


def test_the_losing_adopter_changes_nothing(tmp_path):
    """A commits entry 0 between B's hashing and B's manifest writes (the race two `txckpt adopt`
    or two first saves run). Before the fix B replaced every committed manifest with its own, never
    committed one: lookup then found no data ("starting from scratch") and verify failed."""
    root = str(tmp_path / "out")
    legacy = make_legacy(root)
    a, b = CheckpointRoot(root), CheckpointRoot(root)
    names = ("checkpoint-10", "checkpoint-20", "checkpoint-30")

    def manifests():
        return {n: open(os.path.join(root, n, MANIFEST_NAME), "rb").read() for n in names}

    # B has read the (empty) state and hashed the directories when A runs its whole adoption.
    done = _run_first_when_b_writes_a_manifest(b, lambda: (a.adopt(), manifests()))
    assert b.adopt() is None  # B lost entry 0 and knows it
    assert done and done[0][0] is not None  # A adopted
    assert manifests() == done[0][1]  # A's committed manifests, byte for byte
    assert_adopted_intact(root, legacy, [10, 20, 30])
    assert not os.listdir(os.path.join(root, INTENTS_DIR))


def test_the_losing_first_save_continues_against_the_winners_state(tmp_path):
    """save_checkpoint(out, 40) launched twice: the adopter that loses entry 0 goes on as an
    ordinary writer, and exactly one of the two saves of step 40 commits."""
    root = str(tmp_path / "out")
    legacy = make_legacy(root)
    a, b = CheckpointRoot(root), CheckpointRoot(root)
    done = _run_first_when_b_writes_a_manifest(b, lambda: a.save(40, {"w.bin": torch.ones(4)}))
    with pytest.raises(
        (txckpt.errors.StaleLineageError, txckpt.errors.ConcurrentWriterError, txckpt.errors.StepConflictError)
    ):
        b.save(40, {"w.bin": torch.zeros(4)})
    assert done
    hist = CheckpointRoot(root).history()
    assert sorted(c.step for c in hist.checkpoints.values()) == [10, 20, 30, 40]
    assert_adopted_intact_with_tip(root, legacy, 40)


def assert_adopted_intact_with_tip(root, legacy, tip):
    txckpt.forget_roots()
    r = CheckpointRoot(root)
    for c in r.history().checkpoints.values():
        key = r.publication.locate(c.ref)
        assert key is not None, c.txid
        assert txckpt.verify_checkpoint(r.storage.full_path(key)).digest == c.digest
    assert txckpt.read_manifest(txckpt.get_last_checkpoint(root)).step == tip
    for rel, data in legacy.items():
        assert open(os.path.join(root, rel), "rb").read() == data, rel


def _adopt_in_child(root: str, go, mode: str) -> None:
    txckpt.forget_roots()
    go.wait(60)
    if mode == "adopt":
        CheckpointRoot(root).adopt()
    else:
        try:
            txckpt.save_checkpoint(root, 40, {"w.bin": torch.ones(4)})
        except (txckpt.errors.ConcurrentWriterError, txckpt.errors.StepConflictError):
            pass  # the same job launched twice: one copy's save is refused


@pytest.mark.parametrize("modes", [("adopt", "adopt"), ("save", "save"), ("adopt", "save")])
def test_adopters_released_together(tmp_path, modes):
    """Real processes released together by one event, a few rounds: every round leaves the
    adopted checkpoints intact (before the fix most rounds lost them)."""
    ctx = multiprocessing.get_context("fork")
    for i in range(3):
        root = str(tmp_path / f"out{i}")
        legacy = make_legacy(root)
        go = ctx.Event()
        procs = [ctx.Process(target=_adopt_in_child, args=(root, go, m)) for m in modes]
        for p in procs:
            p.start()
        go.set()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        txckpt.forget_roots()
        tip = 40 if "save" in modes else 30
        assert_adopted_intact_with_tip(root, legacy, tip)


def _foreign_manifest(root: str, name: str, lineage: str) -> bytes:
    """An adoption manifest of other bytes (the files changed since it was written)."""
    m = Manifest(f"adopted-10-{lineage}", lineage, 10, None, {}, 0.0, adopted=True)
    data = m.encode()
    with open(os.path.join(root, name, MANIFEST_NAME), "wb") as f:
        f.write(data)
    return data


def test_a_live_adopter_of_other_bytes_is_never_overwritten(tmp_path):
    root = str(tmp_path / "out")
    make_legacy(root)
    data = _foreign_manifest(root, "checkpoint-10", "0badf00d")
    # The other adopter is alive (this process) and announced itself.
    r = CheckpointRoot(root)
    plan = {"txid": "adopt-0badf00d.x", "step": 30, "lineage": "0badf00d"}
    r.storage.replace(f"{INTENTS_DIR}/adopt-0badf00d.x.json", json.dumps(intent_record(plan, 1)).encode())
    with pytest.raises(AdoptionInProgressError) as e:
        r.adopt()
    assert e.value.paths == [os.path.join(root, "checkpoint-10")]
    assert open(os.path.join(root, "checkpoint-10", MANIFEST_NAME), "rb").read() == data
    assert r.state().seq < 0
    assert os.listdir(os.path.join(root, INTENTS_DIR)) == ["adopt-0badf00d.x.json"]  # ours is gone


def test_a_crashed_adopters_manifest_is_replaced(tmp_path, txlog):
    """No live adopter and no log: an uncommitted manifest of other bytes can be committed by
    nobody, so it is replaced (and one of the same bytes is reused as it is)."""
    root = str(tmp_path / "out")
    legacy = make_legacy(root)
    _foreign_manifest(root, "checkpoint-10", "0badf00d")
    assert CheckpointRoot(root).adopt() is not None
    assert "replacing the uncommitted manifest" in txlog.text
    assert_adopted_intact(root, legacy, [10, 20, 30])


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


# ----- item 2: names as they are -----------------------------------------------------------------
def test_zero_padded_names_are_adopted_where_they_are(tmp_path):
    root = str(tmp_path / "out")
    legacy = make_legacy(root, ("checkpoint-00500", "checkpoint-01000"))
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-01000")
    path = txckpt.resume(root, step=500)  # adopts, then forks at 500
    assert path == os.path.join(root, "checkpoint-00500")
    assert txckpt.load_checkpoint(path)["w.bin"]["w"].tolist() == [0.0] * 4
    assert not os.path.exists(os.path.join(root, "checkpoint-500"))
    hist = CheckpointRoot(root).history()
    assert {c.step: (c.key, c.files) for c in hist.checkpoints.values()} == {
        500: ("checkpoint-00500", 2),
        1000: ("checkpoint-01000", 2),
    }
    for rel, data in legacy.items():
        if rel.startswith("checkpoint-00500/"):
            assert open(os.path.join(root, rel), "rb").read() == data
    # The fork abandoned step 1000: moved to its home, intact.
    r = CheckpointRoot(root)
    c = next(c for c in r.history().checkpoints.values() if c.step == 1000)
    assert r.publication.locate(c.ref) == f".txckpt/tx/{c.txid}/checkpoint-1000"
    assert txckpt.verify_checkpoint(r.locate(c.ref)).digest == c.digest


def test_zero_padded_names_lookup_and_load_after_adoption(tmp_path):
    root = str(tmp_path / "out")
    make_legacy(root, ("checkpoint-00500", "checkpoint-01000"))
    CheckpointRoot(root).adopt()
    last = txckpt.get_last_checkpoint(root)
    assert last == os.path.join(root, "checkpoint-01000")
    assert txckpt.load_checkpoint(last)["w.bin"]["w"].tolist() == [1.0] * 4
    p = subprocess.run(
        [sys.executable, "-m", "txckpt", "verify", root], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_two_names_for_one_step_are_a_typed_error(tmp_path):
    root = str(tmp_path / "out")
    make_legacy(root, ("checkpoint-500", "checkpoint-0500", "checkpoint-600"))
    both = [os.path.join(root, "checkpoint-0500"), os.path.join(root, "checkpoint-500")]
    for attempt in (
        lambda: CheckpointRoot(root).adopt(),
        lambda: txckpt.save_checkpoint(root, 700, {"w.bin": torch.ones(1)}),
        lambda: txckpt.get_last_checkpoint(root),
    ):
        txckpt.forget_roots()
        with pytest.raises(AmbiguousCheckpointNameError) as e:
            attempt()
        assert e.value.step == 500 and e.value.paths == both
        assert all(p in str(e.value) for p in both)
    assert not os.path.exists(os.path.join(root, ".txckpt", "log"))
    assert not any(os.path.exists(os.path.join(root, n, MANIFEST_NAME)) for n in os.listdir(root))


def test_an_empty_legacy_directory_is_never_committed(tmp_path, txlog):
    root = str(tmp_path / "out")
    make_legacy(root, ("checkpoint-10",))
    os.makedirs(os.path.join(root, "checkpoint-20"))
    CheckpointRoot(root).adopt()
    hist = CheckpointRoot(root).history()
    assert [(c.step, c.files) for c in hist.checkpoints.values()] == [(10, 2)]
    assert "holds no files" in txlog.text
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-10")


def test_zero_padded_names_on_every_backend(any_root):
    """Object stores keep an adopted checkpoint at the key it was found at: the padded name."""
    from txckpt._storage import open_storage

    url, opts = any_root
    storage = open_storage(url, opts)
    for name, step in (("checkpoint-00500", 500), ("checkpoint-01000", 1000)):
        with storage.open_write(f"{name}/trainer_state.json", durable=False) as f:
            f.write(b'{"global_step": %d}' % step)
    assert txckpt.get_last_checkpoint(url, storage_options=opts).rstrip("/").endswith("checkpoint-01000")
    txckpt.save_checkpoint(url, 1500, {"w.bin": torch.ones(2)}, storage_options=opts)  # adopts first
    txckpt.forget_roots()
    r = CheckpointRoot(url, opts)
    got = {c.step: c for c in r.checkpoints("all")}
    assert sorted(got) == [500, 1000, 1500]
    assert got[500].path.rstrip("/").endswith("checkpoint-00500") and got[500].files == 1
    assert txckpt.load_checkpoint(got[1000].path, storage_options=opts)["trainer_state.json"] == {"global_step": 1000}
    assert not storage.exists("checkpoint-500") and not storage.exists("checkpoint-1000")
