"""Per-root naming (txckpt/_base/naming.py, protocol §2/§7/§9): a root records how its checkpoints
are named (``checkpoint_N`` for accelerate) and publication, lookup, legacy detection, gc and
path reads follow it; ``checkpoint-N`` stays the default."""

from __future__ import annotations

import json
import os

import pytest

import txckpt
from txckpt.errors import IntegrityError, InvalidArgumentError, NamingConflictError
from txckpt._base.layout import NAMING_KEY
from txckpt._base.naming import DEFAULT, Naming, record_naming, split_name


def _named_root(path: str, prefix: str = "checkpoint_") -> txckpt.CheckpointRoot:
    r = txckpt.open_root(path)
    os.makedirs(path, exist_ok=True)
    record_naming(r.storage, Naming(prefix), durable=True)
    return r


def test_publication_lookup_and_fork_follow_the_roots_naming(root, txlog):
    _named_root(root)
    for step in (1, 2, 3):
        p = txckpt.save_checkpoint(root, step, {"a.json": {"step": step}})
        assert p == os.path.join(root, f"checkpoint_{step}")
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "checkpoint_1",
        "checkpoint_2",
        "checkpoint_3",
    ]
    assert json.loads(open(os.path.join(root, NAMING_KEY)).read())["prefix"] == "checkpoint_"
    txckpt.forget_roots()  # a fresh process reads the naming from the root
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint_3")
    txckpt.resume(root, step=2)
    assert "    checkpoint_3  (lineage" in txlog.text  # the fork's warning names it as published
    assert not os.path.exists(os.path.join(root, "checkpoint_3"))  # abandoned: back to its home
    assert txckpt.save_checkpoint(root, 3, {"a.json": {"step": 33}}) == os.path.join(root, "checkpoint_3")
    assert txckpt.load_checkpoint(os.path.join(root, "checkpoint_3"))["a.json"] == {"step": 33}
    assert [c.published for c in txckpt.CheckpointRoot(root).checkpoints()] == [True, True, True]


def test_gc_completes_publication_under_the_roots_naming(root):
    r = _named_root(root)
    txckpt.save_checkpoint(root, 1, {"a.json": 1})
    c = r.checkpoints()[0]
    os.rename(os.path.join(root, "checkpoint_1"), os.path.join(root, ".txckpt", "tx", c.txid, "checkpoint-1"))
    txckpt.forget_roots()
    txckpt.collect_garbage(txckpt.CheckpointRoot(root))
    assert os.path.isdir(os.path.join(root, "checkpoint_1"))


def test_a_path_under_the_roots_naming_is_checked_against_the_log(root):
    """A ``checkpoint_N`` path is a checkpoint inside its root (§6a): an edited, re-digested
    manifest is caught by the log's digest, as for ``checkpoint-N``."""
    _named_root(root)
    path = txckpt.save_checkpoint(root, 1, {"a.json": {"v": 1}})
    manifest_path = os.path.join(path, txckpt.MANIFEST_NAME)
    with open(manifest_path, "rb") as f:
        edited = txckpt.Manifest.decode(f.read())
    edited.metadata = {"edited": "after the commit"}
    with open(manifest_path, "wb") as f:
        f.write(edited.encode())  # self-consistent (re-digested), not the manifest the log committed
    txckpt.forget_roots()
    with pytest.raises(IntegrityError, match="not the manifest the log committed"):
        txckpt.verify_checkpoint(path)


def test_legacy_directories_under_the_roots_naming_are_adopted(root):
    """A stock accelerate project (``checkpoint_<i>`` directories, no log) is legacy for a root
    named ``checkpoint_``: lookup returns its newest, the first save adopts them."""
    for i in (0, 1):
        os.makedirs(os.path.join(root, f"checkpoint_{i}"))
        open(os.path.join(root, f"checkpoint_{i}", "model.bin"), "wb").write(bytes([i]))
    _named_root(root)
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint_1")
    p = txckpt.save_checkpoint(root, 2, {"a.json": 2})
    assert p == os.path.join(root, "checkpoint_2")
    assert [c.step for c in txckpt.CheckpointRoot(root).checkpoints()] == [0, 1, 2]


def test_one_root_has_one_naming(root):
    _named_root(root, "checkpoint_")
    r = txckpt.open_root(root)
    with pytest.raises(NamingConflictError) as e:
        record_naming(r.storage, Naming("step_"), durable=True)
    assert (e.value.recorded, e.value.requested) == ("checkpoint_", "step_")
    other = os.path.join(os.path.dirname(root), "plain")
    txckpt.save_checkpoint(other, 1, {"a.json": 1})  # a default root: checkpoint-N for good
    with pytest.raises(NamingConflictError, match="checkpoint-N"):
        record_naming(txckpt.open_root(other).storage, Naming("checkpoint_"), durable=True)
    assert record_naming(txckpt.open_root(other).storage, DEFAULT, durable=True) == DEFAULT
    assert not os.path.exists(os.path.join(other, NAMING_KEY))


@pytest.mark.parametrize("bad", ["", ".hidden_", "a/b_", "step4", "x\n"])
def test_bad_prefixes_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        Naming(bad)


def test_split_name():
    assert split_name("step_4") == (Naming("step_"), 4)
    assert split_name("checkpoint-00500") == (DEFAULT, 500)
    with pytest.raises(InvalidArgumentError, match="step number"):
        split_name("final")


def test_layout_parses_checkpoint_names_one_way():
    """layout.parse_checkpoint_name is the one parse of ``checkpoint-N`` (gc, lookup, retention,
    naming): zero padding gives the step; a number no step can be (>= 2**63, or thousands of
    digits) is no checkpoint name, and is not parsed into a huge int."""
    from txckpt._base.layout import is_url, parse_checkpoint_name

    assert parse_checkpoint_name("checkpoint-500") == 500
    assert parse_checkpoint_name("checkpoint-00500") == 500
    assert parse_checkpoint_name("checkpoint-0") == 0
    assert parse_checkpoint_name(f"checkpoint-{2**63 - 1}") == 2**63 - 1
    assert parse_checkpoint_name(f"checkpoint-{2**63}") is None
    assert parse_checkpoint_name("checkpoint-" + "9" * 5000) is None
    assert parse_checkpoint_name("checkpoint-" + "0" * 30 + "7") == 7
    for bad in ("checkpoint-", "checkpoint--1", "checkpoint-1a", "checkpoint-\u0663", "checkpoint_5", "x-5"):
        assert parse_checkpoint_name(bad) is None, bad
    assert parse_checkpoint_name("checkpoint_5", "checkpoint_") == 5
    assert DEFAULT.step_of("checkpoint-" + "9" * 5000) is None
    assert Naming("checkpoint_").step_of("checkpoint_0012") == 12
    # One answer to "is this a URL" (a :: chain is one, with or without ://).
    for url in ("s3://b/x", "file:///tmp/x", "simplecache::s3://b/x", "memory::x"):
        assert is_url(url), url
    for local in ("/tmp/x", "out/checkpoint-3", "a:b"):
        assert not is_url(local), local


def test_split_public_is_the_parse_of_a_name_of_unknown_prefix():
    """naming.split_public: what reader.parse (a path's shape) and split_name (accelerate's
    save_state(output_dir)) parse, with layout.parse_step's steps (issue 28: one parse)."""
    from txckpt._base.naming import split_public

    assert split_public("step_4") == ("step_", 4)
    assert split_public("checkpoint-00500") == ("checkpoint-", 500)
    assert split_public("checkpoint_" + "0" * 30 + "7") == ("checkpoint_", 7)
    for bad in ("final", "4", "checkpoint-", f"checkpoint-{2**63}", "step_" + "9" * 5000):
        assert split_public(bad) is None, bad
    with pytest.raises(InvalidArgumentError, match="step number"):
        split_name(f"step_{2**63}")  # no step can be 2**63 (it was parsed into an int before)


def test_path_shapes_follow_the_one_parse():
    from txckpt._read.reader import parse

    assert parse("/r/checkpoint_4") == parse("/r/checkpoint_4/")
    where = parse("/r/checkpoint-0012")
    assert (where.root, where.key, where.step, where.txid) == ("/r", "checkpoint-0012", 12, None)
    assert parse("/r/.hidden4") is None and parse("/checkpoint-4") is None
    assert parse(f"/r/checkpoint-{2**63}") is None and parse("/r/final") is None


def test_trainer_names_are_parsed_by_the_core():
    """integrations/trainer/paths keeps upstream's PREFIX_CHECKPOINT_DIR but parses through the
    core's naming: a number no step can be is no step (it was an int of 5000 digits)."""
    from txckpt.integrations._trainer import paths as tp

    assert tp.TRAINER_NAMING.public(7) == "checkpoint-7" == f"{tp.PREFIX_CHECKPOINT_DIR}-7"
    assert tp.checkpoint_name_step("/out/checkpoint-00500/") == 500
    assert tp.named_step("/out/checkpoint-3", "/out") == 3 and tp.named_step("/out/checkpoint_3", "/out") is None
    huge = "checkpoint-" + "9" * 5000
    assert tp.checkpoint_name_step(f"/out/{huge}") is None and tp.named_step(f"/out/{huge}", "/out") is None
    assert tp.step_of(f"/nonexistent/{huge}") is None and tp.step_of("/nonexistent/checkpoint-9") == 9


def test_trainer_messages_name_a_step_by_the_roots_naming(root):
    from txckpt.integrations._trainer.paths import public_name

    assert public_name(root, None, 5) == "checkpoint-5"
    other = os.path.join(root, "named")
    _named_root(other, "step_")
    txckpt.forget_roots()
    assert public_name(other, None, 5) == "step_5"
