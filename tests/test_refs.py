"""The typed refs and the save plan keep the wire forms of protocol §1 ("Ref") and §8 step 2."""

import pickle

import pytest

from txckpt._base.refs import ExternalParent, Ref, parent_from_json, parent_to_json, same_ref
from txckpt._base.saveplan import SavePlan


def test_a_ref_is_written_as_the_dict_of_protocol_1_key_and_digest_only_when_set():
    assert Ref("ab12cd34", 3, "3-ab12cd34-00").to_json() == {"lineage": "ab12cd34", "step": 3, "txid": "3-ab12cd34-00"}
    full = {"lineage": "l", "step": 3, "txid": "t", "key": "checkpoint-3", "digest": "d"}
    assert Ref.from_json(full).to_json() == full
    assert Ref.from_json(full) == Ref("l", 3, "t", "checkpoint-3", "d")


def test_a_parent_is_a_ref_an_external_path_or_none():
    assert parent_from_json(None) is None and parent_to_json(None) is None
    assert parent_from_json({"external": "/x/checkpoint-2"}) == ExternalParent("/x/checkpoint-2")
    assert parent_to_json(ExternalParent("/x")) == {"external": "/x"}
    assert parent_from_json({"lineage": "l", "step": 1, "txid": "t"}) == Ref("l", 1, "t")
    with pytest.raises(ValueError):
        parent_from_json({"neither": 1})
    with pytest.raises(TypeError):  # the callers word these as LogCorruptError / ManifestError
        parent_from_json("a txid")


def test_same_ref_compares_lineage_step_and_txid_only():
    assert same_ref(Ref("l", 1, "t", digest="a"), Ref("l", 1, "t", key="k"))
    assert not same_ref(Ref("l", 1, "t"), Ref("l", 2, "t"))
    assert same_ref(None, None) and not same_ref(Ref("l", 1, "t"), None)
    assert not same_ref(ExternalParent("/x"), Ref("l", 1, "t"))


def test_the_plan_pickles_for_the_ranks_and_gives_the_intent_its_fields():
    plan = SavePlan("5-l-00", "l", 5, Ref("l", 4, "4-l-00", digest="d"), ".txckpt/tx/5-l-00/checkpoint-5", "s")
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert list(plan.to_json().items()) == [("txid", "5-l-00"), ("step", 5), ("lineage", "l")]
