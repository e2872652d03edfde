"""Incremental DCP saves (issue 30, tensors): ``TransactionalWriter(..., incremental=True)`` on 2
real gloo ranks shares each unchanged tensor's file with the committed checkpoint that holds its
bytes; every checkpoint stays whole, verifies, loads bit-exact at any world size (through
TransactionalReader and a stock FileSystemReader), survives the retention of the checkpoint that
first held the bytes, and a damaged shared file fails every checkpoint that holds it (`txckpt
verify` names each; a fallback resume skips them all, onto a full save before them)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import txckpt
from tests.children import dcp_workers as cw
from tests.harness import launcher
from txckpt.integrations._dcp.incremental import ITEMS_NAME

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS = [1, 2, 3]
SHAPES = cw.frozen_layout(12, 4)  # the workers' default: per rank 4 base tensors of 1.5 MiB, 2 adapter of 1 MiB
BASE = [n for n in SHAPES if n.startswith("base.")]
#: Raw bytes of the base, and of what changes every step (the adapter and Adam's two moments), both ranks
BASE_BYTES = sum(4 * 2 * SHAPES[n][0] * SHAPES[n][1] for n in BASE)
CHANGED_BYTES = sum(4 * 2 * SHAPES[n][0] * SHAPES[n][1] * 3 for n in SHAPES if n.startswith("adapter."))


def test_a_tensor_key_follows_every_property_that_decides_the_saved_bytes():
    import torch

    from txckpt.integrations._dcp.incremental import tensor_key

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    key = tensor_key(t)
    assert key == tensor_key(t.clone()) == tensor_key(torch.nn.Parameter(t.clone()))  # saved detached
    assert key == tensor_key(torch.arange(24, dtype=torch.float32).reshape(6, 4)[:3])  # DCP saves a minimal copy
    changed = t.clone()
    changed[2, 3] += 1
    others = [changed, t.double(), t.reshape(4, 3), t.t().contiguous().t(), t.to(torch.bfloat16)]
    assert len({key} | {tensor_key(o) for o in others}) == 1 + len(others)
    assert tensor_key(t.to_sparse()) is None
    # A prefix key is the minimal copy's, made or not (a contiguous view of a larger storage).
    from txckpt.integrations._dcp import incremental as di

    big = torch.randn(3 << 18)
    for view in (big[1000 : 1000 + (1 << 18)], big[:600_000].reshape(600, 1000), big[:1000].reshape(10, 100).t()):
        copy = view.clone()
        assert copy.untyped_storage().size() == copy.nbytes
        assert di.prefix_key(view) == di.prefix_key(copy) == di._digest(di._keyable(view), di.PREFIX_BYTES)
    assert di.prefix_key(big) != di.prefix_key(big + 1) and di.prefix_key(t.to_sparse()) is None


_ok = launcher.Run.oks  # every rank exited 0: their results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1..3 of a frozen base + a changing adapter and its Adam state, saved incrementally
    through DCP by 2 ranks."""
    tmp = tmp_path_factory.mktemp("dcpinc")
    root = str(tmp / "root")
    paths = _ok(launcher.launch(2, cw.frozen_saves, str(tmp / "save"), root=root, steps=STEPS))[0]
    return {"root": root, "paths": paths, "tmp": tmp}


def _inodes(path: str) -> dict[str, int]:
    return {n: os.stat(os.path.join(path, n)).st_ino for n in txckpt.read_manifest(path).files}


def _new_bytes(paths: list[str], i: int) -> tuple[int, list[str]]:
    """Bytes (and names) of checkpoint ``i``'s files whose inode no earlier checkpoint holds."""
    earlier = {ino for p in paths[:i] for ino in _inodes(p).values()}
    m = txckpt.read_manifest(paths[i])
    new = sorted(n for n, ino in _inodes(paths[i]).items() if ino not in earlier)
    return sum(m.files[n].size for n in new), new


def test_a_later_save_writes_only_the_files_of_changed_tensors(saved):
    paths = saved["paths"]
    first = txckpt.read_manifest(paths[0])
    big = {n: e for n, e in first.files.items() if n.endswith(".distcp") and not n.endswith("_0.distcp")}
    # Each tensor item of >= 1 MiB has a file of its own, per rank: 4 base + 2 adapter + 4 moments.
    assert len(big) == 2 * 10 and {e.rank for e in big.values()} == {0, 1}, sorted(big)
    assert ITEMS_NAME in first.files
    changed, base = CHANGED_BYTES, BASE_BYTES
    for i in (1, 2):
        written, names = _new_bytes(paths, i)
        shared = set(_inodes(paths[i])) - set(names)
        assert len(shared) == 2 * len(BASE), (i, sorted(shared))  # every base shard, both ranks
        # The changed tensors (their torch.save headers), the packed small items, DCP's metadata.
        assert changed < written < changed * 1.05 + 64 * 1024, (i, written, changed, names)
        assert txckpt.read_manifest(paths[i]).total_bytes - written > base  # the base, not written again
        # Every file's range digests are in its rank's part; a shared file's one range is the whole
        # file, its digest the committed one's (TransactionalReader(verify="ranges") checks it).
        m = txckpt.read_manifest(paths[i])
        assert "txckpt-dcp-ranges.json" not in m.files
        for rank in range(2):
            with open(os.path.join(paths[i], "txckpt-parts", f"{rank}.json")) as f:
                part = json.load(f)
            assert set(part["ranges"]) == set(part["files"]), rank
            for name in shared & set(part["files"]):
                assert part["ranges"][name] == {"0": [m.files[name].size, m.files[name].checksum]}, name
    # A file's name and its bytes agree with the first save's: shared by inode, not by copy.
    one, three = _inodes(paths[0]), _inodes(paths[2])
    assert sum(one[n] == three[n] for n in one if n in three) == 2 * len(BASE)
    readers = os.path.join(saved["root"], ".txckpt", "readers")
    assert not os.path.isdir(readers) or os.listdir(readers) == []  # every lease went back


def test_every_checkpoint_verifies_and_loads_bit_exact_at_world_1_and_2(saved):
    paths = saved["paths"]
    for p in paths:
        txckpt.verify_checkpoint(p)
    for verify in ("full", "ranges"):
        got = _ok(launcher.launch(2, cw.frozen_load, str(saved["tmp"] / f"load2-{verify}"), paths=paths, verify=verify))
        for per_rank in got:
            assert all(r == {"different": []} for r in per_rank.values()), per_rank
    one = cw.frozen_load(0, 1, paths=paths)
    assert all(r == {"different": []} for r in one.values()), one


def test_a_stock_filesystem_reader_loads_an_incremental_checkpoint(saved):
    import torch
    import torch.distributed.checkpoint as dcp

    path = saved["paths"][-1]
    want = cw.frozen_state(STEPS[-1], SHAPES, 1, 0)
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0) for k, v in want.items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


def test_retiring_the_checkpoint_that_first_held_the_bytes_leaves_the_later_ones_whole(saved):
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention
    from txckpt._root.root import CheckpointRoot

    root = str(saved["tmp"] / "retained")
    subprocess.run(["cp", "-a", saved["root"], root], check=True)  # -a keeps the hard links
    paths = [os.path.join(root, os.path.basename(p)) for p in saved["paths"]]
    txckpt.forget_roots()
    apply_retention(CheckpointRoot(root), RetentionPolicy(keep_last=1))
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    txckpt.verify_checkpoint(paths[2])
    got = cw.frozen_load(0, 1, paths=[paths[2]])
    assert got == {paths[2]: {"different": []}}, got
    # The next save still shares with what is left.
    four = _ok(launcher.launch(2, cw.frozen_saves, str(saved["tmp"] / "retained-4"), root=root, steps=[4]))[0][0]
    assert sum(_inodes(four)[n] == _inodes(paths[2]).get(n) for n in _inodes(four)) == 2 * len(BASE)


def test_a_damaged_shared_file_fails_every_checkpoint_that_holds_it(saved, capsys):
    from txckpt._cli import app

    root = str(saved["tmp"] / "damaged")
    subprocess.run(["cp", "-a", saved["root"], root], check=True)
    paths = [os.path.join(root, os.path.basename(p)) for p in saved["paths"]]
    shard = os.path.join(paths[0], "__1_1.distcp")  # rank 1's first base tensor, shared by all three
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    txckpt.forget_roots()
    assert app.main(["verify", root]) == 1
    out = capsys.readouterr()
    for p in paths:
        assert os.path.join(os.path.basename(p), "__1_1.distcp") in out.out + out.err, out
    got = cw.frozen_load(0, 1, paths=paths)
    for p in paths:
        ((etype, message),) = {tuple(e) for e in got[p]["errors"].values()}
        assert etype == "IntegrityError" and "__1_1.distcp" in message, got[p]


def test_without_incremental_the_layout_is_unchanged(saved):
    root = str(saved["tmp"] / "full")
    paths = _ok(
        launcher.launch(2, cw.frozen_saves, str(saved["tmp"] / "full-save"), root=root, steps=[1, 2], incremental=False)
    )[0]
    for p in paths:
        assert sorted(n for n in txckpt.read_manifest(p).files if n.endswith(".distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        assert ITEMS_NAME not in txckpt.read_manifest(p).files
    # A first incremental save after full ones has no keys to look up: it writes everything.
    three = _ok(launcher.launch(2, cw.frozen_saves, str(saved["tmp"] / "full-3"), root=root, steps=[3]))[0][0]
    assert _new_bytes(paths + [three], 2)[0] == txckpt.read_manifest(three).total_bytes


@pytest.mark.s3
def test_s3_copies_unchanged_tensors_on_the_server(saved, s3_root, s3_requests):
    url, so = s3_root
    _ok(launcher.launch(2, cw.frozen_saves, str(saved["tmp"] / "s3-1"), root=url, steps=[1], storage_options=so))
    s3_requests.reset()
    two = _ok(launcher.launch(2, cw.frozen_saves, str(saved["tmp"] / "s3-2"), root=url, steps=[2], storage_options=so))[
        0
    ][0]
    assert s3_requests.ops["CopyObject"] == 2 * len(BASE), s3_requests.ops  # each base shard, on the server
    # Uploaded: the changed tensors' files, the packed small items, the metadata; no base byte.
    assert s3_requests.uploaded_bytes < CHANGED_BYTES * 1.05 + 64 * 1024, (s3_requests.uploaded_bytes, s3_requests.ops)
    got = _ok(launcher.launch(2, cw.frozen_load, str(saved["tmp"] / "s3-load"), paths=[two], storage_options=so))
    assert all(g == {two: {"different": []}} for g in got), got


def test_a_damaged_shared_file_is_reported_for_every_holder_and_fallback_skips_them_all(tmp_path, capsys):
    """Issue 30: a flipped byte in a tensor file that three incremental checkpoints share (one
    inode): `txckpt verify` names it in each of them and in no other checkpoint, and
    resume(on_damaged="fallback") skips all three and lands on the full save before them (which
    shares nothing: a full save records no item keys), which loads bit-exact."""
    import json

    from txckpt._cli import app

    root = str(tmp_path / "root")
    full = _ok(launcher.launch(2, cw.frozen_saves, str(tmp_path / "full"), root=root, steps=[1], incremental=False))[0][
        0
    ]
    shared = _ok(launcher.launch(2, cw.frozen_saves, str(tmp_path / "inc"), root=root, steps=[2, 3, 4]))[0]
    shard = os.path.join(shared[0], "__1_1.distcp")  # rank 1's first base tensor: written by step 2
    assert os.stat(shard).st_nlink == 3 and not os.path.exists(os.path.join(full, "__1_1.distcp"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    txckpt.forget_roots()
    assert app.main(["verify", "--json", root]) == 1
    report = json.loads(capsys.readouterr().out)
    assert len(report["checkpoints"]) == 4
    named = sorted(
        next(os.path.basename(p) for p in shared if os.path.basename(p) + "/" in problem)
        for problem in report["problems"]
    )
    assert named == sorted(os.path.basename(p) for p in shared), report["problems"]  # each holder, once
    assert all(
        "__1_1.distcp" in problem and os.path.basename(full) + "/" not in problem for problem in report["problems"]
    ), report["problems"]
    txckpt.forget_roots()
    resumed = txckpt.resume(root, on_damaged="fallback")
    warned = capsys.readouterr().err  # txckpt's warning, on stderr
    assert resumed == full, (resumed, warned)
    assert txckpt.get_last_checkpoint(root) == full
    assert all(f"{os.path.basename(p)}/__1_1.distcp failed" in warned for p in shared), warned  # each damaged one
    assert cw.frozen_load(0, 1, paths=[full]) == {full: {"different": []}}


def test_changed_tensors_are_packed_and_only_the_unchanged_are_hashed_whole(tmp_path, monkeypatch):
    """Every save records each large tensor's prefix key (the first MiB). A tensor whose prefix
    key no committed save recorded is changed: it is packed into the rank's file 0 (as a full
    save writes it: one file), with no whole-tensor hash. One whose first MiB matches is hashed
    whole, then shared or written alone, so that a tensor trained until now and frozen from now
    on is written alone once and shared after. The root's first incremental save gives every
    large tensor a file of its own, keyed from its write (no hash pass of its own). Every
    checkpoint loads bit-exact."""
    import torch
    import torch.distributed.checkpoint as dcp

    from txckpt.integrations._dcp import incremental as di
    from txckpt.integrations.dcp import TransactionalReader, TransactionalWriter

    whole = []
    digest = di._digest
    monkeypatch.setattr(
        di, "_digest", lambda t, limit: (whole.append(t.nbytes) if limit is None else None, digest(t, limit))[1]
    )
    g = torch.Generator().manual_seed(0)
    nbytes = 300_000 * 4  # 1.1 MiB: a file of its own when alone
    base = {f"base{i}": torch.randn(300_000, generator=g) for i in range(3)}
    root = str(tmp_path / "root")

    def save(step, state):
        whole.clear()
        dcp.save(state, storage_writer=TransactionalWriter(root, step, incremental=True), no_dist=True)
        path = txckpt.get_last_checkpoint(root)
        with open(os.path.join(path, ITEMS_NAME), "rb") as f:
            files, packed = di.decode_items(f.read())
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(got, storage_reader=TransactionalReader(path), no_dist=True)
        assert all(torch.equal(got[k], v) for k, v in state.items()), path
        txckpt.verify_checkpoint(path)
        return path, files, packed, sorted(whole)

    def alone(path):  # the one-item files of a checkpoint
        return {n for n in txckpt.read_manifest(path).files if n.endswith(".distcp") and not n.endswith("_0.distcp")}

    state = {**base, "adapter": torch.randn(300_000, generator=g)}
    first, files, packed, hashed = save(1, state)
    assert hashed == [] and packed == [] and len(files) == 4 == len(alone(first)), (hashed, files)
    assert {k for k, _p in files.values()} == {di.tensor_key(t) for t in state.values()}  # keyed as written

    state = {**base, "adapter": state["adapter"] + 1}
    path, files, packed, hashed = save(2, state)
    assert hashed == [nbytes] * 3, hashed  # the base only: the adapter's first MiB is new
    assert len(packed) == 1 and len(files) == 3 == len(alone(path)), (packed, files)  # the adapter in file 0
    shared = {n for n, ino in _inodes(path).items() if ino in set(_inodes(first).values())}
    assert shared == alone(path), shared  # the base's three files

    # A full fine-tune: every tensor changed, every one packed into file 0, none hashed whole.
    state = {k: v + 1 for k, v in state.items()}
    path, files, packed, hashed = save(3, state)
    assert hashed == [] and files == {} and len(packed) == 4 and alone(path) == set(), (hashed, files, packed)

    # Frozen from now on: hashed whole (their first MiB was recorded), no file has their key,
    # so each is written alone once; the next save shares them.
    path, files, packed, hashed = save(4, state)
    assert hashed == [nbytes] * 4 and len(files) == 4 and packed == [], (hashed, files, packed)
    path5, files, packed, hashed = save(5, state)
    assert hashed == [nbytes] * 4 and set(_inodes(path5).values()) >= set(_inodes(path)[n] for n in alone(path))

    # An older save's items (bare keys): no prefix rules a tensor out, so each is hashed whole.
    monkeypatch.setattr(
        di, "decode_items", lambda data: ({n: (k, None) for n, (k, _p) in json.loads(data)["files"].items()}, [])
    )
    di._ITEMS.clear()
    state = {**state, "adapter": state["adapter"] + 1}
    path, files, packed, hashed = save(6, state)
    assert hashed == [nbytes] * 4 and len(files) == 4 and packed == [], (hashed, files, packed)
