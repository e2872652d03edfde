"""Errors keep their fields across process boundaries: pickling (worker pools, spawn) and the
cross-rank codec (txckpt.errors.encode_error / decode_error, what decide_on_rank0 and a
transaction's outcome broadcast carry). Every class of txckpt.errors is covered, so a class
added later is too."""

from __future__ import annotations

import errno
import os
import pickle

import pytest

import txckpt
from txckpt import errors
from txckpt._base.coordination import Coordinator, SingleProcess, decide_on_rank0, raise_if_any_failed

ERROR_CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.TxckptError)),
    key=lambda c: c.__name__,
)

#: A value per field name (by what the field holds); any other field gets a string.
_VALUES = {
    "damaged": [{"step": 4, "txid": "t4", "path": "/r/checkpoint-4/a.pt", "error": "checksum"}],
    "known": ["lin-a", "lin-b"],
    "paths": ["/r/checkpoint-500", "/r/checkpoint-0500"],
    "step": 500,
    "attempts": 7,
    "seconds": 1.5,
}


def _instance(cls: type) -> errors.TxckptError:
    fields = {name: _VALUES.get(name, f"{name} of {cls.__name__}") for name in cls.fields}
    return cls(f"what happened to {cls.__name__}", **fields)


def _same(a: BaseException, b: BaseException) -> None:
    assert type(b) is type(a)
    assert str(b) == str(a)
    assert b.args == a.args
    for name in type(a).fields:
        assert getattr(b, name) == getattr(a, name), name
    assert vars(b) == vars(a)
    if isinstance(a, OSError):
        assert (b.errno, b.strerror, b.filename) == (a.errno, a.strerror, a.filename)


def test_every_class_declares_the_fields_it_documents():
    assert errors.NoIntactCheckpointError.fields == ("path", "root", "damaged")
    assert errors.CoordinationTimeoutError.fields == ("phase",)
    assert "step" in errors.AdoptionError.fields and "path" in errors.AdoptionError.fields
    assert len(ERROR_CLASSES) >= 29
    with pytest.raises(TypeError, match="no field"):
        errors.IntegrityError("m", nonsense=1)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_pickle_round_trip_keeps_class_message_and_fields(cls):
    e = _instance(cls)
    assert all(getattr(e, name) is not None for name in cls.fields)
    _same(e, pickle.loads(pickle.dumps(e)))


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_codec_round_trip_keeps_class_message_and_fields(cls):
    e = _instance(cls)
    d = errors.encode_error(e, rank=3)
    assert d["type"] == cls.__name__ and d["rank"] == 3 and errors.is_txckpt_error(d)
    pickle.loads(pickle.dumps(d))  # what an object collective does with it
    _same(e, errors.decode_error(d))
    # A reworded copy (a transaction's outcome names the failing rank) keeps class and fields.
    back = errors.decode_error(errors.reworded(d, f"rank 3: {d['message']}"))
    assert type(back) is cls and str(back) == f"rank 3: {d['message']}"
    assert all(getattr(back, n) == getattr(e, n) for n in cls.fields)


def test_oserror_based_errors_keep_errno_and_file_name():
    e = errors.storage_error(OSError(errno.ENOSPC, "No space left on device", "/r/a.pt"), "write 'a.pt'")
    assert isinstance(e, errors.StorageError) and e.filename == "/r/a.pt"
    _same(e, pickle.loads(pickle.dumps(e)))
    _same(e, errors.decode_error(errors.encode_error(e)))
    gone = errors.RootNotFoundError("no such root", root="/nope", bucket=None)
    _same(gone, errors.decode_error(errors.encode_error(gone)))
    assert str(gone) == "no such root" and gone.filename == "/nope"


def test_other_errors_travel_as_their_nearest_builtin_class():
    back = errors.decode_error(errors.encode_error(FileNotFoundError(2, "No such file", "/x")))
    assert type(back) is FileNotFoundError and back.filename == "/x" and back.errno == 2

    class LibraryError(ValueError):
        pass

    d = errors.encode_error(LibraryError("bad value"))
    assert not errors.is_txckpt_error(d)
    back = errors.decode_error(d)
    assert type(back) is ValueError and str(back) == "bad value"

    class Odd(Exception):
        pass

    back = errors.decode_error(errors.encode_error(Odd("odd")))
    assert type(back) is RuntimeError and str(back) == "odd"
    assert type(errors.decode_error({"type": "NoSuchClass", "message": "m"})) is RuntimeError


def test_a_field_that_cannot_travel_leaves_the_message():
    e = errors.IntegrityError("m", path="/p")
    e.handle = lambda: None  # not picklable
    d = errors.encode_error(e)
    back = errors.decode_error(d)
    assert type(back) is errors.IntegrityError and str(back) == "m"


class _FakeRank(Coordinator):
    """A rank of a 2-rank group whose broadcast hands out ``delivered`` (what rank 0 sent)."""

    world_size = 2

    def __init__(self, rank: int, delivered=None):
        self.rank = rank
        self.delivered = delivered
        self.sent = None
        self.phases: list = []

    def broadcast(self, obj):
        self.phases.append(self.phase)
        self.sent = obj
        return obj if self.rank == 0 else self.delivered

    def gather(self, obj):
        self.phases.append(self.phase)
        return [obj, self.delivered] if self.rank == 0 else None

    def barrier(self):  # pragma: no cover - not used
        raise AssertionError


def test_decide_on_rank0_every_rank_returns_or_raises_rank_0s_outcome():
    assert decide_on_rank0(lambda: 5, phase="x", coordinator=SingleProcess()) == 5
    r0 = _FakeRank(0)
    assert decide_on_rank0(lambda: {"a": 1}, phase="resume", coordinator=r0) == {"a": 1}
    assert r0.phases == ["resume"] and r0.phase is None
    r1 = _FakeRank(1, delivered=r0.sent)
    assert decide_on_rank0(lambda: pytest.fail("rank 1 runs fn"), phase="resume", coordinator=r1) == {"a": 1}

    damaged = errors.NoIntactCheckpointError("all damaged", path="/r/c4/a.pt", root="/r", damaged=_VALUES["damaged"])

    def fail():
        raise damaged

    r0 = _FakeRank(0)
    with pytest.raises(errors.NoIntactCheckpointError) as own:
        decide_on_rank0(fail, phase="resume", coordinator=r0)
    assert own.value is damaged  # rank 0 raises its own exception
    r1 = _FakeRank(1, delivered=r0.sent)
    with pytest.raises(errors.NoIntactCheckpointError) as copy:
        decide_on_rank0(fail, phase="resume", coordinator=r1)
    assert str(copy.value) == "all damaged" and copy.value.damaged == damaged.damaged
    assert (copy.value.path, copy.value.root) == ("/r/c4/a.pt", "/r")
    assert any("rank 0" in n and "resume" in n for n in copy.value.__notes__)
    with pytest.raises(errors.TransactionAbortedError, match="instead of its resume decision"):
        decide_on_rank0(fail, phase="resume", coordinator=_FakeRank(1, delivered=None))


def test_raise_if_any_failed_raises_the_failed_ranks_error_everywhere():
    raise_if_any_failed(None, phase="fetch", coordinator=SingleProcess())
    with pytest.raises(KeyError):
        raise_if_any_failed(KeyError("k"), phase="fetch", coordinator=SingleProcess())
    quiet = _FakeRank(0, delivered=None)
    raise_if_any_failed(None, phase="fetch", coordinator=quiet)
    assert quiet.phases == ["fetch", "fetch"] and quiet.phase is None
    # Rank 1 failed: rank 0 gathers its report and raises the same error, fields kept.
    failed = errors.encode_error(errors.IntegrityError("bad copy", path="/c/a.pt"), rank=1)
    with pytest.raises(errors.IntegrityError) as e:
        raise_if_any_failed(None, phase="fetch", coordinator=_FakeRank(0, delivered=failed))
    assert e.value.path == "/c/a.pt" and any("rank 1" in n for n in e.value.__notes__)
    own = ValueError("mine")
    with pytest.raises(ValueError) as mine:
        raise_if_any_failed(own, phase="fetch", coordinator=_FakeRank(0, delivered=failed))
    assert mine.value is own


def test_a_failed_collective_says_its_phase():
    from txckpt._base.coordination import TorchDistributed

    coord = TorchDistributed.__new__(TorchDistributed)
    coord.rank, coord.world_size, coord.timeout_s, coord.group, coord._gathered = 1, 2, 5.0, None, False
    coord.phase = None
    e = coord._fail("gather", RuntimeError("Connection closed by peer"))
    assert isinstance(e, errors.CoordinationTimeoutError) and e.phase == "gather"
    coord.phase = "resume"
    e = coord._fail("broadcast", RuntimeError("Timed out waiting 5000ms"))
    assert e.phase == "resume" and "broadcast (resume) across 2 ranks" in str(e)
    assert pickle.loads(pickle.dumps(e)).phase == "resume"


# ----- real ranks -------------------------------------------------------------------------------
def resume_nothing_intact(rank: int, world: int, *, root: str):
    """Every rank restarts with resume(on_damaged="fallback") on a root whose only checkpoint is
    damaged: rank 0 raises NoIntactCheckpointError; each rank reports what it caught."""
    try:
        txckpt.resume(root, on_damaged="fallback")
    except errors.NoIntactCheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "path": e.path, "root": e.root, "damaged": e.damaged}
    return None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_rank_0s_no_intact_checkpoint_error_reaches_rank_1_with_its_fields(tmp_path):
    from tests.harness import launcher

    root = str(tmp_path / "out")
    path = txckpt.save_checkpoint(root, 4, {"a.bin": b"x" * 64})
    with open(os.path.join(path, "a.bin"), "r+b") as f:
        f.write(b"y")
    txckpt.forget_roots()
    run = launcher.launch(2, resume_nothing_intact, str(tmp_path / "res"), root=root)
    for r in run.results:
        assert r.exitcode == 0 and r.ok is not None, run.describe() + "\n" + (r.trace or "")
    zero, one = run.results[0].ok, run.results[1].ok
    assert zero["type"] == one["type"] == "NoIntactCheckpointError"
    assert one == zero
    assert len(one["damaged"]) == 1 and one["damaged"][0]["step"] == 4
    assert one["damaged"][0]["path"] == os.path.join(path, "a.bin") and one["path"] == os.path.join(path, "a.bin")
