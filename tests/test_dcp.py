"""txckpt under torch.distributed.checkpoint: FSDP2 (``fully_shard``) state saved by dcp.save
through TransactionalWriter and loaded by dcp.load through TransactionalReader, on real gloo
ranks (tests/harness/launcher.py; nothing of torch.distributed is mocked)."""

from __future__ import annotations


import os

import pytest

import txckpt
from tests.children import dcp_workers as cw
from tests.harness import launcher

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


_ok = launcher.Run.oks  # every rank exited 0: their results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One FSDP2 model + Adam saved through DCP on 2 ranks (step 5), and its full state."""
    tmp = tmp_path_factory.mktemp("dcp")
    root, ref = str(tmp / "root"), str(tmp / "ref.pt")
    out = _ok(launcher.launch(2, cw.save, str(tmp / "save"), root=root, step=5, ref_file=ref))
    return {"root": root, "ref": ref, "out": out, "tmp": tmp}


def test_save_commits_one_checkpoint_with_each_shard_attributed_to_its_rank(saved):
    out = saved["out"]
    path = out[0]["path"]
    assert path and txckpt.get_last_checkpoint(saved["root"]) == path
    assert [o["returned"] for o in out] == [path, path]  # dcp.save's Metadata names it on every rank
    m = txckpt.read_manifest(path)
    assert m.step == 5 and m.world_size == 2 and m.metadata == {"by": "dcp"}
    assert {n: e.rank for n, e in m.files.items()} == {"__0_0.distcp": 0, "__1_0.distcp": 1, ".metadata": 0}
    txckpt.verify_checkpoint(path)


@pytest.mark.parametrize("world", [1, 4])
def test_load_reshards_to_equal_tensors(saved, world):
    path = saved["out"][0]["path"]
    got = _ok(launcher.launch(world, cw.load, str(saved["tmp"] / f"load{world}"), path=path, ref_file=saved["ref"]))
    for g in got:
        assert g["tensors"] > 8 and g["different"] == [], g


def test_the_tensor_index_lists_each_ranks_chunks_with_their_offsets(saved):
    """Protocol §3b "DCP items": each rank's FSDP2 chunk of a parameter is a record of that rank's
    file (read from its part of the manifest), named by the chunk's slice, with its FQN and
    offsets; the chunks cover the tensor, and each loads (verified) equal to that slice."""
    import torch

    path = saved["out"][0]["path"]
    ref = torch.load(saved["ref"], weights_only=True)
    infos = txckpt.inspect_checkpoint(path).tensors
    records = {r.name: r for e in txckpt.read_manifest(path).files.values() if e.index for r in e.index.tensors or ()}
    chunks = [r for r in records.values() if r.fqn == "model.0.weight"]
    assert sorted((r.chunk_offsets, r.shape) for r in chunks) == [((0, 0), (32, 16)), ((32, 0), (32, 16))]
    assert {records[t.name].fqn for t in infos} >= {"model.0.weight", "model.0.bias", "model.2.weight"}
    assert {t.file for t in infos if t.name.startswith("model.0.weight[")} == {"__0_0.distcp", "__1_0.distcp"}
    for r in chunks:
        (lo, _), (n, _) = r.chunk_offsets, r.shape
        assert r.name == f"model.0.weight[{lo}:{lo + n},0:16]" and r.encoding == "torch_save"
        got = txckpt.load_tensors(path, [r.name])[r.name]
        assert torch.equal(got, ref["model/0.weight"][lo : lo + n])


def test_plain_dcp_reader_still_reads_a_committed_checkpoint(saved):
    """The files are DCP's own format: FileSystemReader loads them too (unverified)."""
    import torch
    import torch.distributed.checkpoint as dcp

    m = cw.model(0)
    sd = {"model": m.state_dict()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(saved["out"][0]["path"]), no_dist=True)
    ref = torch.load(saved["ref"], weights_only=True)
    assert all(torch.equal(sd["model"][k], ref[f"model/{k}"]) for k in sd["model"])


# ---------------------------------------------------------------------------------------------
# Bad input: every damage is a typed error naming the file, on every rank, before bytes are used


def _damaged(saved, tag: str, damage) -> str:
    """A copy of the saved root whose checkpoint ``damage(path)`` changed; its path."""
    import shutil

    root = str(saved["tmp"] / f"bad-{tag}")
    shutil.copytree(saved["root"], root, symlinks=True)
    path = os.path.join(root, "checkpoint-5")
    damage(path)
    return path


def _flip(name: str, where: float = 0.5):
    def damage(path: str) -> None:
        f = os.path.join(path, name)
        with open(f, "r+b") as fh:
            at = int(os.path.getsize(f) * where)
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ 0x40]))

    return damage


def _truncate(name: str):
    def damage(path: str) -> None:
        f = os.path.join(path, name)
        os.truncate(f, os.path.getsize(f) - 7)

    return damage


def _remove(name: str):
    return lambda path: os.remove(os.path.join(path, name))


def _load_errors(saved, path: str, tag: str, world: int = 2, verify: str = "full") -> dict:
    got = _ok(
        launcher.launch(
            world, cw.load, str(saved["tmp"] / f"load-{tag}"), path=path, ref_file=saved["ref"], verify=verify
        )
    )
    for g in got:
        assert "errors" in g, f"{tag}: loaded without an error: {g}"
    assert all(g == got[0] for g in got), got  # every rank sees the same failures
    return got[0]["errors"]


@pytest.mark.parametrize(
    "case",
    [
        ("flip0", _flip("__0_0.distcp"), "__0_0.distcp", "IntegrityError"),
        ("flip1", _flip("__1_0.distcp", 0.9), "__1_0.distcp", "IntegrityError"),
        ("truncated", _truncate("__1_0.distcp"), "__1_0.distcp", "IntegrityError"),
        ("missing", _remove("__0_0.distcp"), "__0_0.distcp", "IntegrityError"),
    ],
    ids=lambda c: c[0],
)
def test_damaged_shard_is_an_integrity_error_on_every_rank(saved, case):
    tag, damage, name, kind = case
    path = _damaged(saved, tag, damage)
    errs = _load_errors(saved, path, tag)
    assert errs, errs
    for _rank, (etype, message, epath) in errs.items():
        assert etype == kind and name in message and epath == f"{path}/{name}", errs


def _part(path: str, rank: int) -> dict:
    import json

    with open(os.path.join(path, "txckpt-parts", f"{rank}.json")) as f:
        return json.load(f)


def test_two_ranks_write_format_2_with_each_ranks_range_digests_in_its_part(saved):
    """Protocol §3a: each rank's files and their range digests are in its part (the coordinator
    receives neither); the manifest lists only the coordinator's own .metadata: no
    txckpt-dcp-ranges.json, whose size grew with the ranks."""
    from txckpt._base.layout import MANIFEST_NAME
    from txckpt._manifest.manifest import Manifest

    path = saved["out"][0]["path"]
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        m = Manifest.decode(f.read())
    assert m.parts is not None and m.parts.count == 2 and set(m.files) == {".metadata"}
    assert not os.path.exists(os.path.join(path, "txckpt-dcp-ranges.json"))
    for rank in range(2):
        part, name = _part(path, rank), f"__{rank}_0.distcp"
        assert set(part["ranges"]) == set(part["files"]) == {name}, part
        # The items' ranges tile the shard: each starts where the one before it ended.
        spans = sorted((int(o), n) for o, (n, _digest) in part["ranges"][name].items())
        assert len(spans) > 1 and [o for o, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
        assert sum(n for _, n in spans) == part["files"][name]["size"]


def _rewrite_range_digest(path: str) -> None:
    """Rank 1's part, well-formed, with one range digest replaced (its leaf then differs)."""
    import json

    part = _part(path, 1)
    table = part["ranges"]["__1_0.distcp"]
    table[min(table, key=int)][1] = "0" * 32
    with open(os.path.join(path, "txckpt-parts", "1.json"), "w") as f:
        json.dump(part, f, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize(
    "case",
    [("part1", _flip("txckpt-parts/1.json", 0.3), "full"), ("part1-range", _rewrite_range_digest, "ranges")],
    ids=lambda c: c[0],
)
def test_a_damaged_part_fails_the_load_naming_its_rank(saved, case):
    """A flipped byte of a part, or a rewritten range digest in it (the part still well-formed):
    its leaf no longer fits the Merkle root, and both loading ranks name rank 1's part."""
    tag, damage, verify = case
    bad = _damaged(saved, tag, damage)
    errs = _load_errors(saved, bad, tag, verify=verify)
    for _rank, (etype, message, epath) in errs.items():
        assert etype == "ManifestError" and "rank 1's part" in message and epath == f"{bad}/txckpt-parts/1.json", errs


def _old_layout(saved, tag: str, ranges_file: bool = True) -> str:
    """The saved checkpoint committed again, into a root of its own, as txckpt wrote /2 DCP
    checkpoints before the range digests moved into the parts: parts of files only, and every
    rank's digests in the coordinator's txckpt-dcp-ranges.json (listed by the manifest). The
    real commit code, fed what that writer's finish fed it; ``ranges_file=False``: without it."""
    import json
    import shutil

    from txckpt._manifest import rankparts
    from txckpt._base.checksum import digest_bytes
    from txckpt._manifest.manifest import kind_for_name

    src = saved["out"][0]["path"]
    root = txckpt.CheckpointRoot(str(saved["tmp"] / f"old-{tag}"))
    tx = root.transaction(5)
    plan = tx.begin_external(2)
    staging = root.storage.local_path(plan.key)
    records, ranges = [], {}
    for rank in range(2):
        part = _part(src, rank)
        ranges.update(part["ranges"])
        for name in part["files"]:
            shutil.copyfile(os.path.join(src, name), os.path.join(staging, name))
        records.append(
            rankparts.write_part(
                root.storage, plan.key, rank, plan.txid, part["files"], durable=root.durable, directory=False
            ).encode()
        )
    own = {".metadata": open(os.path.join(src, ".metadata"), "rb").read()}
    if ranges_file:
        own["txckpt-dcp-ranges.json"] = json.dumps(ranges, sort_keys=True).encode()
    for name, data in own.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    files = {
        n: {"size": len(d), "xxh3_128": digest_bytes(d), "kind": kind_for_name(n), "rank": 0} for n, d in own.items()
    }
    return tx.commit_reports([{"rank": 0, "files": files}], records)


def test_a_checkpoint_of_the_old_layout_with_one_ranges_file_still_loads_with_verify_ranges(saved):
    path = _old_layout(saved, "ranges-file")
    m = txckpt.read_manifest(path)
    assert m.parts is not None and set(m.own_files or {}) == {".metadata", "txckpt-dcp-ranges.json"}
    assert all("ranges" not in _part(path, r) for r in range(2))
    got = _ok(
        launcher.launch(
            2, cw.load, str(saved["tmp"] / "load-old-layout"), path=path, ref_file=saved["ref"], verify="ranges"
        )
    )
    assert all(g["tensors"] > 8 and g["different"] == [] for g in got), got
    # Neither the parts nor a ranges file: verify="ranges" says where it looked, not only the file.
    bare = _old_layout(saved, "no-ranges", ranges_file=False)
    errs = _load_errors(saved, bare, "no-ranges", world=1, verify="ranges")
    ((etype, message, _epath),) = {tuple(v) for v in errs.values()}
    assert etype == "IntegrityError" and "no recorded range digests" in message, errs
    assert "part of the manifest (txckpt-parts/0.json)" in message and 'verify="full"' in message, message


def test_metadata_from_another_checkpoint_is_refused(saved):
    other = _ok(
        launcher.launch(2, cw.save, str(saved["tmp"] / "save-other"), root=str(saved["tmp"] / "other"), step=5, seed=77)
    )[0]["path"]

    def swap(path: str) -> None:
        import shutil

        shutil.copyfile(os.path.join(other, ".metadata"), os.path.join(path, ".metadata"))

    path = _damaged(saved, "metadata", swap)
    errs = _load_errors(saved, path, "metadata", world=1)
    assert {e[0] for e in errs.values()} == {"IntegrityError"} and all(".metadata" in e[1] for e in errs.values())


@pytest.mark.parametrize("verify", ["full", "ranges"])
def test_ranged_reads_check_what_they_read(saved, verify):
    """verify="ranges" reads only the ranges DCP asks for and checks each against the digest the
    writer recorded for it: a loaded range that changed is refused; "full" refuses it too."""
    path = _damaged(saved, f"ranges-{verify}", _flip("__1_0.distcp", 0.9))
    errs = _load_errors(saved, path, f"ranges-{verify}", world=1, verify=verify)
    assert [e[0] for e in errs.values()] == ["IntegrityError"] and "__1_0.distcp" in list(errs.values())[0][1]
    if verify == "ranges":  # "full" reshards intact checkpoints in test_load_reshards_to_equal_tensors
        intact = _ok(
            launcher.launch(
                4,
                cw.load,
                str(saved["tmp"] / "load-ranges-ok"),
                path=saved["out"][0]["path"],
                ref_file=saved["ref"],
                verify=verify,
            )
        )
        assert all(g["different"] == [] for g in intact), intact


# ---------------------------------------------------------------------------------------------
# txckpt's semantics through the writer


def test_step_conflict_and_rollback_fork_through_the_writer(saved):
    import shutil

    root = str(saved["tmp"] / "lineage")
    shutil.copytree(saved["root"], root, symlinks=True)
    txckpt.forget_roots()
    # Step 5 is committed: saving it again is refused on every rank, and nothing is left staged.
    errs = _ok(launcher.launch(2, cw.expect_error, str(saved["tmp"] / "conflict"), root=root, step=5))
    for e in errs:
        assert e and {v[0] for v in e.values()} == {"StepConflictError"}, errs
    intents = os.path.join(root, ".txckpt", "intents")
    assert not os.path.isdir(intents) or os.listdir(intents) == []
    seven = _ok(launcher.launch(2, cw.save, str(saved["tmp"] / "seven"), root=root, step=7))[0]["path"]
    m7 = txckpt.read_manifest(seven)
    # Roll back to 5 and save 6: a new lineage, one warning naming what it abandons.
    out = _ok(launcher.launch(2, cw.save, str(saved["tmp"] / "fork"), root=root, step=6, resume_step=5))
    six = out[0]["path"]
    assert txckpt.get_last_checkpoint(root) == six
    m6 = txckpt.read_manifest(six)
    assert m6.lineage != m7.lineage and m6.parent.step == 5
    assert any("abandon" in w for w in out[0]["warned"]), out[0]["warned"]
    # The abandoned lineage's checkpoint is kept intact (moved to its home: the name is 6's lineage's).
    kept = [c for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.txid == m7.txid]
    assert len(kept) == 1 and kept[0].path != seven
    txckpt.verify_checkpoint(kept[0].path)


def _staged(root: str) -> tuple[list[str], list[str]]:
    """The intents and the transaction homes (``.txckpt/tx/<txid>``) under ``root``."""

    def ls(d: str) -> list[str]:
        d = os.path.join(root, ".txckpt", d)
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    return ls("intents"), ls("tx")


@pytest.mark.parametrize("what", ["step", "step-planner-drops-storage-data", "root", "lineage"])
def test_dcp_ranks_that_disagree_on_the_step_root_or_lineage_commit_nothing(saved, what):
    """``TransactionalWriter(root, 6 if rank == 0 else 7)`` (also through a planner that does not
    pass the local plans' storage_data on), another root on rank 1, or rank 1 holding a lineage
    that rank 0's later fork superseded: as with save_checkpoint, every rank raises the same
    typed error, nothing is committed or left staged in either root, and the next save on which
    the ranks agree commits."""
    import shutil

    root, other = str(saved["tmp"] / f"disagree-{what}"), str(saved["tmp"] / f"disagree-{what}-other")
    shutil.copytree(saved["root"], root, symlinks=True)
    txckpt.forget_roots()
    kw: dict = {
        "roots": [root, other] if what == "root" else [root, root],
        "steps": [6, 7] if what.startswith("step") else [6, 6],
    }
    if what == "step-planner-drops-storage-data":
        kw["planner"] = "drops-storage-data"
    if what == "lineage":  # rank 1 starts a lineage, then rank 0 does: the head is rank 0's
        kw["new_lineages"] = (1, 0)
    errs = _ok(launcher.launch(2, cw.expect_error_per_rank, str(saved["tmp"] / f"disagree-{what}-run"), seed=6, **kw))
    assert errs[0] is not None and errs[1] is not None, f"both ranks returned: {errs}"
    assert errs[0] == errs[1], errs  # the same failures, on every rank
    ((etype, message),) = {tuple(v) for v in errs[0].values()}
    assert etype == "TransactionAbortedError", errs
    assert f"ranks disagree on the {what.split('-')[0]}" in message and "rank 1" in message, message
    if what.startswith("step"):
        assert "step 7" in message and "step 6" in message, message
    if what == "root":
        assert other in message and root in message, message
    txckpt.forget_roots()
    last = txckpt.get_last_checkpoint(root)  # a new lineage holds nothing yet
    assert (last is None) if what == "lineage" else txckpt.read_manifest(last).step == 5, last
    ever = txckpt.CheckpointRoot(root).checkpoints("all")
    assert [c.step for c in ever] == [5], ever  # nothing committed; step 5 kept (abandoned, for a lineage)
    intents, homes = _staged(root)
    assert intents == [] and set(homes) <= {c.txid for c in ever}, (intents, homes)
    if what != "lineage":
        assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == ["checkpoint-5"]
    if os.path.isdir(other):
        assert not [n for n in os.listdir(other) if n.startswith("checkpoint-")]
        assert _staged(other) == ([], [])
    out = _ok(launcher.launch(2, cw.save, str(saved["tmp"] / f"disagree-{what}-after"), root=root, step=6))
    assert [o["returned"] for o in out] == [os.path.join(root, "checkpoint-6")] * 2
    m = txckpt.verify_checkpoint(out[0]["path"])
    assert m.step == 6 and {n: e.rank for n, e in m.files.items() if n.endswith(".distcp")} == {
        "__0_0.distcp": 0,
        "__1_0.distcp": 1,
    }


def test_a_planner_replaying_a_cached_plan_is_refused_before_anything_is_staged(tmp_path):
    """DCP's plan caching hands every rank its cached plan of the previous save, which names that
    save's staging: it was written into (a stray shard left in a committed checkpoint's home) and
    the commit failed as "files vanished". It is refused up front, naming the cause."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from txckpt.errors import InvalidArgumentError
    from txckpt.integrations.dcp import TransactionalWriter

    class Cached(DefaultSavePlanner):  # its own key in DCP's class-level plan cache
        pass

    class Replays(DefaultSavePlanner):
        """Caches on its own: every save gets the first save's finished plan, said usable."""

        kept: list = []

        def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
            self.kept.append(new_plan)
            return super().finish_plan(self.kept[0])

    root = str(tmp_path / "root")
    first = TransactionalWriter(root, 1)
    dcp.save({"w": torch.ones(4)}, storage_writer=first, planner=Cached(enable_plan_caching=True), no_dist=True)
    dcp.save(
        {"w": torch.ones(4)},
        storage_writer=TransactionalWriter(str(tmp_path / "other"), 1),
        planner=Replays(),
        no_dist=True,
    )  # the plan Replays keeps
    for planner, says in ((Cached(enable_plan_caching=True), "plan caching"), (Replays(), "an earlier save")):
        with pytest.raises(CheckpointException) as got:
            dcp.save(
                {"w": torch.full((4,), 2.0)}, storage_writer=TransactionalWriter(root, 2), planner=planner, no_dist=True
            )
        ((err, _tb),) = got.value.failures.values()
        assert isinstance(err, InvalidArgumentError) and says in str(err), err
        stray = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, ".txckpt", "tx")) for f in fs]
        assert _staged(root)[0] == [] and stray == [], stray
    second = TransactionalWriter(root, 2)
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=second, no_dist=True)
    assert [c.step for c in txckpt.CheckpointRoot(root).checkpoints()] == [1, 2] and first.path != second.path
    m = txckpt.verify_checkpoint(second.path)
    assert m.parts is None and "txckpt-dcp-ranges.json" in m.files  # one rank: format /1, the ranges in one file


def test_async_save_commits(saved):
    root = str(saved["tmp"] / "async")
    ref = str(saved["tmp"] / "ref-async.pt")
    out = _ok(
        launcher.launch(2, cw.save, str(saved["tmp"] / "async-save"), root=root, step=3, ref_file=ref, mode="async")
    )
    path = out[0]["path"]
    assert path and txckpt.get_last_checkpoint(root) == path and out[1]["returned"] == path
    got = _ok(launcher.launch(1, cw.load, str(saved["tmp"] / "async-load"), path=path, ref_file=ref))
    assert got[0]["different"] == []


def test_process_based_async_save_commits_each_save_in_order(saved):
    """dcp.async_save(async_checkpointer_type=PROCESS): the writer is pickled into DCP's background
    process (one per rank, spawned once, serving both saves) and plans, writes and commits there
    over that process's own gloo group. Ranks come from torchrun: the test's forkserver ranks are
    daemonic and may not start processes."""
    import json

    from tests.harness.procs import torchrun

    root, refs = str(saved["tmp"] / "async-process"), saved["tmp"] / "async-process-refs"
    refs.mkdir()
    script = os.path.join(os.path.dirname(__file__), "children", "dcp_async_process.py")
    p = torchrun(script, root, "3,4", refs, timeout=600)
    results = [json.loads(line.split(" ", 2)[2]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["step"], r["path"]) for r in results) == sorted(
        (s, os.path.join(root, f"checkpoint-{s}")) for s in (3, 4) for _rank in range(2)
    ), p.stdout
    txckpt.forget_roots()
    assert [c.step for c in txckpt.CheckpointRoot(root).checkpoints()] == [3, 4]
    for step in (3, 4):
        path = os.path.join(root, f"checkpoint-{step}")
        m = txckpt.verify_checkpoint(path)
        assert {n: e.rank for n, e in m.files.items() if n.endswith(".distcp")} == {
            "__0_0.distcp": 0,
            "__1_0.distcp": 1,
        }
        got = _ok(
            launcher.launch(
                1,
                cw.load,
                str(saved["tmp"] / f"async-process-load-{step}"),
                path=path,
                ref_file=str(refs / f"ref-{step}.pt"),
            )
        )
        assert got[0]["different"] == []


@pytest.mark.s3
def test_s3_root_round_trip(saved, s3_root):
    url, opts = s3_root
    ref = str(saved["tmp"] / "ref-s3.pt")
    out = _ok(
        launcher.launch(2, cw.save, str(saved["tmp"] / "s3-save"), root=url, step=4, ref_file=ref, storage_options=opts)
    )
    path = out[0]["path"]
    assert path.startswith("s3://") and "/.txckpt/tx/" in path  # an object store's home: no rename
    assert txckpt.get_last_checkpoint(url, storage_options=opts) == path
    m = txckpt.read_manifest(path, storage_options=opts)
    assert {n: e.rank for n, e in m.files.items() if n.endswith(".distcp")} == {"__0_0.distcp": 0, "__1_0.distcp": 1}
    for verify, world in (("full", 1), ("ranges", 2)):
        got = _ok(
            launcher.launch(
                world,
                cw.load,
                str(saved["tmp"] / f"s3-load-{verify}"),
                path=path,
                ref_file=ref,
                storage_options=opts,
                verify=verify,
            )
        )
        assert all(g["different"] == [] for g in got), got


# ---------------------------------------------------------------------------------------------
# torch's unpublished DCP names: one compat module, and a clear error the day one disappears


def test_every_unpublished_torch_name_the_dcp_integration_uses_resolves_on_this_torch():
    import importlib

    from txckpt.integrations._dcp import compat as dcp_compat

    assert dcp_compat.missing_names() == []
    for module, name in dcp_compat.PRIVATE_NAMES:  # the names the module binds are the listed ones
        assert getattr(dcp_compat, name) is getattr(importlib.import_module(module), name), name


def _unpublished_torch_imports(path: str) -> list[str]:
    """``from torch.distributed... import X`` in ``path`` where the module is private (a part
    with a leading underscore) or X is (a leading underscore, or absent from the module's
    ``__all__``)."""
    import ast
    import importlib

    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [
                a.name
                for a in node.names
                if a.name.startswith("torch.distributed") and any(p.startswith("_") for p in a.name.split("."))
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            module = str(node.module)
            public = getattr(importlib.import_module(module), "__all__", None)
            for a in node.names:
                if (
                    any(p.startswith("_") for p in module.split("."))
                    or a.name.startswith("_")
                    or (public is not None and a.name not in public)
                ):
                    out.append(f"{module}.{a.name} (line {node.lineno})")
    return out


def test_torch_unpublished_dcp_names_are_imported_only_by_the_compat_module():
    import txckpt as pkg
    from txckpt.integrations._dcp import compat as dcp_compat

    base = os.path.dirname(pkg.__file__)
    found = {}
    for d, _dirs, files in os.walk(base):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and path != dcp_compat.__file__:
                hits = _unpublished_torch_imports(path)
                if hits:
                    found[os.path.relpath(path, base)] = hits
    assert found == {}, f"import these through txckpt/integrations/_dcp/compat.py (PRIVATE_NAMES): {found}"
    listed = {f"{m}.{n}" for m, n in dcp_compat.PRIVATE_NAMES}
    assert {h.split(" ")[0] for h in _unpublished_torch_imports(dcp_compat.__file__)} == listed


@pytest.mark.parametrize(
    "gone",
    [
        "torch.distributed.checkpoint.filesystem._write_files_from_queue",
        "torch.distributed._shard._utils.narrow_tensor_by_index",
        "torch.distributed.checkpoint.filesystem._split_by_size_and_type(bins, items)",
    ],
)
def test_a_torch_without_one_of_those_names_fails_the_import_naming_its_version_and_the_name(monkeypatch, gone):
    """A torch release that renamed or dropped a name, or changed a function's parameters
    (simulated: the attribute removed, its whole module unimportable, another function put in
    its place) fails ``import txckpt.integrations.dcp`` at once, with torch's
    version and the missing name, instead of an AttributeError in the middle of a save."""
    import importlib
    import sys

    import torch

    from txckpt.integrations import dcp as _dcp
    from txckpt.integrations._dcp import compat as dcp_compat  # imported the normal way: restored after

    assert _dcp.narrow_tensor_by_index is dcp_compat.narrow_tensor_by_index

    others = {f"{m}.{n}" for m, n in dcp_compat.PRIVATE_NAMES} - {gone.split("(")[0]}
    module, name = gone.split("(")[0].rsplit(".", 1)
    if module == "torch.distributed._shard._utils":
        monkeypatch.setitem(sys.modules, module, None)  # "import of ... halted; None in sys.modules"
    elif "(" in gone:  # still there, with other parameters
        monkeypatch.setattr(importlib.import_module(module), name, lambda items, bins, sizes: [])
    else:
        monkeypatch.delattr(importlib.import_module(module), name)
    for m in ("txckpt.integrations.dcp", "txckpt.integrations._dcp.compat"):
        monkeypatch.delitem(sys.modules, m)
    with pytest.raises(ImportError) as got:
        importlib.import_module("txckpt.integrations.dcp")
    message = str(got.value)
    assert f"torch {torch.__version__}" in message and gone in message, message
    assert not any(o in message for o in others), message  # only what is missing is named
