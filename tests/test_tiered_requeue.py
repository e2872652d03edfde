"""Tiered roots never resume older than their durable tier (issue 45 items 4-7, docs/tiered.md):
a job requeued A -> B -> A over node-local fast directories resumes B's newest checkpoint (or
follows B's rollback, with a warning), and nothing is ever committed on a stale fast tier; a
rollback on a new node forks from a durable-only step; the README idiom
``load_checkpoint(get_last_checkpoint(root))`` reads a tiered root's paths (repairs, new nodes)
and a remote root's paths (their storage options); an outage of the durable tier degrades
``pending()``, ``apply_retention()`` and the lag bound, and stops no save.
"Nodes" are separate fast directories of one process (every root object forgotten between them)."""

import contextlib
import logging
import os
import pickle

import pytest
import torch

import txckpt
from txckpt.errors import ReplicationError, StepConflictError
from txckpt._root.root import forget_roots
from txckpt._tiered.tiered import TieredRoot


def files(step: int, tag: int | None = None):
    return {
        "model.safetensors": {"w": torch.full((256,), float(step if tag is None else tag))},
        "trainer_state.json": {"global_step": step, "tag": tag},
    }


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def durable(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "durable"), {}
    return request.getfixturevalue("s3_root")


def node(tmp_path, name: str, durable, **kw) -> TieredRoot:
    """A job's process on node ``name``: a fresh process state over that node's fast directory."""
    forget_roots()
    url, options = durable
    return TieredRoot(str(tmp_path / name), url, options, **kw)


def run(root: TieredRoot, steps, tag=None) -> None:
    for step in steps:
        txckpt.save_checkpoint(root, step, files(step, tag))
    root.wait_durable()


def durable_steps(root: TieredRoot):
    d = txckpt.CheckpointRoot(root.durable, root.storage_options)
    return [c.step for c in d.checkpoints("current")], d.state().head


def test_a_requeue_onto_a_stale_fast_tier_resumes_the_durable_tiers_newest_checkpoint(tmp_path, durable):
    a = node(tmp_path, "a", durable)
    run(a, (1, 2, 3))
    b = node(tmp_path, "b", durable)  # requeued onto node B: an empty fast directory
    assert txckpt.load_checkpoint(txckpt.resume(b))["trainer_state.json"]["global_step"] == 3
    run(b, (4, 5, 6))

    a = node(tmp_path, "a", durable)  # requeued onto node A again: its fast tier stops at step 3
    last = txckpt.get_last_checkpoint(a)
    assert last is not None and not last.startswith(a.fast)  # the durable tier's step 6
    assert txckpt.resume(a) == last
    assert txckpt.load_checkpoint(txckpt.get_last_checkpoint(a))["trainer_state.json"]["global_step"] == 6
    fast_seq = a.fast_root.state().seq
    with pytest.raises(StepConflictError, match="step 6 is already committed") as e:
        txckpt.save_checkpoint(a, 4, files(4))  # retraining from the stale step 3
    assert "Nothing was written" in str(e.value)
    assert a.fast_root.state().seq == fast_seq  # 0 saves committed on the stale fast tier
    run(a, (7,))
    steps, head = durable_steps(a)
    assert steps == [1, 2, 3, 4, 5, 6, 7] and head == a.fast_root.state().head
    assert txckpt.get_last_checkpoint(a).startswith(a.fast)
    assert a.pending() == []


def test_a_requeue_after_a_rollback_on_another_node_follows_the_durable_fork_and_warns(tmp_path, durable, caplog):
    a = node(tmp_path, "a", durable)
    run(a, (1, 2, 3))
    a_lineage = a.fast_root.state().head
    b = node(tmp_path, "b", durable)
    txckpt.resume(b, step=2)  # a durable-only step on node B: forked on the durable tier
    run(b, (3,), tag=30)
    b_lineage = durable_steps(b)[1]
    assert b_lineage != a_lineage

    a = node(tmp_path, "a", durable)
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        last = txckpt.get_last_checkpoint(a)
    moved = [r.getMessage() for r in caplog.records if "has moved to lineage" in r.getMessage()]
    assert len(moved) == 1 and a_lineage in moved[0] and b_lineage in moved[0]
    assert txckpt.load_checkpoint(last)["trainer_state.json"] == {"global_step": 3, "tag": 30}
    fast_seq = a.fast_root.state().seq
    with pytest.raises(StepConflictError):
        txckpt.save_checkpoint(a, 3, files(3))
    # Refused before the save: the fast tier only follows the durable lineage (no checkpoint).
    assert [c.step for c in a.fast_root.checkpoints("all") if c.lineage == b_lineage] == []
    assert a.fast_root.state().seq <= fast_seq + 1
    run(a, (4,), tag=40)
    steps, head = durable_steps(a)
    assert steps == [1, 2, 3, 4] and head == b_lineage == a.fast_root.state().head
    d = txckpt.CheckpointRoot(a.durable, a.storage_options)
    assert txckpt.load_checkpoint(d.get_last_checkpoint(), storage_options=a.storage_options)["trainer_state.json"] == {
        "global_step": 4,
        "tag": 40,
    }
    assert [c.step for c in d.checkpoints("current")][:3] == [1, 2, 3]
    assert (
        txckpt.load_checkpoint(d.locate(d.history().find(step=3).ref), storage_options=a.storage_options)[
            "trainer_state.json"
        ]["tag"]
        == 30
    )  # B's step 3, not A's abandoned one


def test_a_rollback_on_a_new_node_forks_from_a_step_only_the_durable_tier_holds(tmp_path, durable):
    a = node(tmp_path, "a", durable)
    run(a, (1, 2, 3, 4))
    old = durable_steps(a)[1]
    c = node(tmp_path, "c", durable)  # a new node
    at = txckpt.resume(c, step=2)
    assert at is not None and not at.startswith(c.fast)
    assert txckpt.load_checkpoint(at)["trainer_state.json"]["global_step"] == 2
    assert txckpt.get_last_checkpoint(c) == at
    run(c, (3,), tag=33)
    steps, head = durable_steps(c)
    assert steps == [1, 2, 3] and head != old and head == c.fast_root.state().head
    d = txckpt.CheckpointRoot(c.durable, c.storage_options)
    assert sorted(x.step for x in d.checkpoints("all")) == [1, 2, 3, 3, 4]  # nothing lost


def test_the_readme_idiom_repairs_a_missing_fast_file_and_reads_a_new_nodes_durable_path(tmp_path, durable):
    a = node(tmp_path, "a", durable)
    run(a, (1, 2))
    path = txckpt.get_last_checkpoint(a)
    os.unlink(os.path.join(path, "model.safetensors"))
    assert txckpt.load_checkpoint(txckpt.get_last_checkpoint(a))["trainer_state.json"]["global_step"] == 2
    assert list(a.last_fetched) == ["model.safetensors"]
    txckpt.verify_checkpoint(path)  # whole again on the fast tier
    # The text alone (a copy of the string, as stock code makes) reads the same way.
    os.unlink(os.path.join(path, "model.safetensors"))
    assert txckpt.load_checkpoint(str(path))["model.safetensors"]["w"][0] == 2.0

    b = node(tmp_path, "b", durable)  # a new node: the path is the durable tier's
    last = txckpt.get_last_checkpoint(b)
    assert txckpt.load_checkpoint(last)["trainer_state.json"]["global_step"] == 2
    assert txckpt.verify_checkpoint(last).txid == txckpt.read_manifest(last).txid
    # Still a plain str to users and stock code: a pickle (a broadcast) is a str.
    assert isinstance(last, str) and type(pickle.loads(pickle.dumps(last))) is str


def test_a_tiered_root_loaded_with_storage_options_still_reads_and_repairs_through_its_tiers(tmp_path):
    # Its tiers have their own storage options: the ones given to load_checkpoint change nothing
    # (as before lookups issued paths), never an AssertionError.
    root = node(tmp_path, "a", (str(tmp_path / "durable"), {}))
    run(root, (1, 2))
    os.unlink(os.path.join(root.get_last_checkpoint(), "model.safetensors"))
    state = txckpt.load_checkpoint(root, storage_options={})
    assert state["trainer_state.json"]["global_step"] == 2 and state["model.safetensors"]["w"][0] == 2.0
    assert list(root.last_fetched) == ["model.safetensors"]


@pytest.mark.s3
def test_a_remote_roots_lookup_carries_its_storage_options(s3_root):
    from txckpt._base.issued import CheckpointPath

    url, options = s3_root
    txckpt.save_checkpoint(url, 1, files(1), storage_options=options)
    forget_roots()
    last = txckpt.get_last_checkpoint(url, storage_options=options)
    assert isinstance(last, CheckpointPath) and last.storage_options == options
    assert txckpt.load_checkpoint(last)["trainer_state.json"]["global_step"] == 1
    assert txckpt.read_manifest(str(last)).step == 1
    assert txckpt.load_checkpoint(txckpt.resume(url, storage_options=options))["trainer_state.json"]["global_step"] == 1


def test_two_jobs_on_one_durable_root_say_which_owns_the_lineage(tmp_path):
    durable = (str(tmp_path / "durable"), {})
    a = node(tmp_path, "a", durable)
    run(a, (1, 2))  # job A's saves compared the tiers once, then settled
    b = node(tmp_path, "b", durable)  # job B starts on the same durable root
    txckpt.resume(b)
    run(b, (3,))
    txckpt.save_checkpoint(a, 3, files(3))  # job A still runs: committed on its fast tier only
    with pytest.raises(ReplicationError, match="another job owns lineage") as e:
        a.wait_durable()
    assert "txckpt.resume(root)" in str(e.value) and e.value.durable == a.durable_root.url
    assert [c.step for c in a.pending()] == [3]


@contextlib.contextmanager
def outage(tmp_path, monkeypatch, **kw):
    """A TieredRoot whose durable tier (a moto server of its own) saved steps 1 and 2, then went
    away (the server stopped: its port closed) for the rest of the block."""
    pytest.importorskip("moto.server")
    from emulators.s3 import running_s3_server

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's attempts: an outage answers at once
    with running_s3_server() as server:
        server.reset()  # moto's state is the process's: nothing of another test's server
        server.create_bucket("outage")
        forget_roots()
        root = TieredRoot(str(tmp_path / "fast"), "s3://outage/run", server.storage_options(), **kw)
        run(root, (1, 2))
        server.stop()
        yield root
        with pytest.raises(ReplicationError):
            root.wait_durable()  # no replication outlives the test; the fast tier keeps it all


@pytest.mark.s3
def test_an_unreachable_durable_tier_degrades_pending_retention_and_lookups_and_saves_go_on(
    tmp_path, monkeypatch, caplog
):
    from txckpt.errors import EndpointUnreachableError

    with outage(tmp_path, monkeypatch) as root, caplog.at_level(logging.WARNING, logger="txckpt"):
        for step in (3, 4, 5):
            txckpt.save_checkpoint(root, step, files(step))  # saves go on
        assert [c.step for c in root.pending()] == [3, 4, 5]  # from what this process knows
        assert isinstance(root.durable_unreachable, EndpointUnreachableError)
        assert any("is unreachable" in r.getMessage() and "pending() answers" in r.getMessage() for r in caplog.records)
        retired = root.apply_retention(txckpt.RetentionPolicy(keep_last=1))
        assert sorted(i.step for i in retired) == [1, 2]  # the durable ones only
        assert [c.step for c in root.fast_root.checkpoints("current")] == [3, 4, 5]
        assert txckpt.get_last_checkpoint(root) == os.path.join(root.fast, "checkpoint-5")
        txckpt.save_checkpoint(root, 6, files(6))
        assert [c.step for c in root.pending()] == [3, 4, 5, 6]


@pytest.mark.s3
def test_max_pending_warns_once_when_replication_lags_behind_it(tmp_path, monkeypatch, caplog):
    with outage(tmp_path, monkeypatch, max_pending=2) as root, caplog.at_level(logging.WARNING, logger="txckpt"):
        assert root.pending() == []  # (a read of the durable tier fails: the outage is known)
        for step in (3, 4, 5, 6):
            txckpt.save_checkpoint(root, step, files(step))
    lags = [r.getMessage() for r in caplog.records if "lags" in r.getMessage()]
    assert len(lags) == 1 and "3 checkpoints" in lags[0] and "max_pending=2" in lags[0]
    assert "unreachable" in lags[0] and root.lag == 4
    with pytest.raises(txckpt.errors.InvalidArgumentError, match="max_pending"):
        TieredRoot(str(tmp_path / "f"), str(tmp_path / "d"), max_pending=0)


def test_ls_durable_shows_which_checkpoints_of_the_fast_tier_are_durable(tmp_path, monkeypatch, capsys):
    import json

    from txckpt import cli

    root = node(tmp_path, "fast", (str(tmp_path / "durable"), {}))
    run(root, (1,))
    monkeypatch.setattr(TieredRoot, "_kick", lambda self: None)  # step 2: not replicated yet
    txckpt.save_checkpoint(root, 2, files(2))
    capsys.readouterr()
    assert cli.main(["ls", root.fast, "--durable", root.durable, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["step"]: r["durable"] for r in rows} == {1: True, 2: False}
    assert cli.main(["ls", root.fast, "--durable", root.durable]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines[0].index("DURABLE")  # a column of its own, between STATE and PATH
    assert lines[0].index("STATE") < at < lines[0].index("PATH")
    marks = {line.split()[0]: line[at:].split()[0] for line in lines[1:] if line[:1].isdigit()}
    assert marks == {"1": "yes", "2": "no"}


@pytest.mark.s3
def test_ls_durable_says_when_the_durable_tier_cannot_be_read(tmp_path, closed_endpoint, monkeypatch, capsys):
    from txckpt import cli

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    txckpt.save_checkpoint(str(tmp_path / "fast"), 1, files(1))
    capsys.readouterr()
    code = cli.main(
        [
            "ls",
            str(tmp_path / "fast"),
            "--durable",
            "s3://bucket/run",
            "--durable-option",
            f'client_kwargs={{"endpoint_url": "{closed_endpoint}"}}',
            "--durable-option",
            "key=k",
            "--durable-option",
            "secret=s",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and "could not be read" in err and "?" in out.splitlines()[-1].split()


def test_a_checkpoint_the_durable_tier_abandoned_before_it_was_replicated_does_not_block_replication(
    tmp_path, monkeypatch
):
    durable = (str(tmp_path / "durable"), {})
    a = node(tmp_path, "a", durable)
    run(a, (1, 2))
    with monkeypatch.context() as m:
        m.setattr(TieredRoot, "_kick", lambda self: None)  # node A is lost before replicating step 3
        txckpt.save_checkpoint(a, 3, files(3))
    b = node(tmp_path, "b", durable)
    txckpt.resume(b, step=1)  # B rolls back: the durable tier abandons A's lineage
    run(b, (2,), tag=20)

    a = node(tmp_path, "a", durable)  # A again: its step 3 can never become durable
    assert txckpt.load_checkpoint(txckpt.resume(a))["trainer_state.json"]["tag"] == 20
    run(a, (3,), tag=30)
    assert a.pending() == []
    steps, head = durable_steps(a)
    assert steps == [1, 2, 3] and head == a.fast_root.state().head


@pytest.mark.process
def test_a_requeue_a_b_a_in_separate_processes_resumes_the_newest_durable_checkpoint(tmp_path):
    import json
    import subprocess
    import sys

    durable = str(tmp_path / "durable")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def job(node_name: str, steps: str, *rollback: str) -> dict:
        p = subprocess.run(
            [sys.executable, "-m", "tests.children.tiered_node", str(tmp_path / node_name), durable, steps, *rollback],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": repo},
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert job("a", "1,2,3") == {"resumed": 0, "saved": [1, 2, 3], "refused": None, "pending": 0}
    assert job("b", "4,5,6") == {"resumed": 3, "saved": [4, 5, 6], "refused": "StepConflictError", "pending": 0}
    assert job("a", "7,8") == {"resumed": 6, "saved": [7, 8], "refused": "StepConflictError", "pending": 0}
    assert job("b", "5", "4") == {"resumed": 4, "saved": [5], "refused": "StepConflictError", "pending": 0}
    assert job("a", "6") == {"resumed": 5, "saved": [6], "refused": "StepConflictError", "pending": 0}
    d = txckpt.CheckpointRoot(durable)
    assert [c.step for c in d.checkpoints("current")] == [1, 2, 3, 4, 5, 6]
    assert sorted(c.step for c in d.checkpoints("all")) == [1, 2, 3, 4, 5, 5, 6, 6, 7, 8]


def test_max_pending_counts_no_durable_backlog_of_a_restart(tmp_path, caplog):
    durable = (str(tmp_path / "durable"), {})
    run(node(tmp_path, "a", durable), (1, 2, 3, 4))  # all durable
    restarted = node(tmp_path, "a", durable, max_pending=2)
    with caplog.at_level(logging.WARNING, logger="txckpt"):
        txckpt.save_checkpoint(restarted, 5, files(5))  # before this process read the durable tier
    assert restarted.lag == 1 and not [r for r in caplog.records if "lags" in r.getMessage()]
    restarted.wait_durable()


def test_restore_brings_a_stale_fast_tier_up_to_the_durable_tip_under_the_same_txid(tmp_path):
    durable = (str(tmp_path / "durable"), {})
    run(node(tmp_path, "a", durable), (1, 2, 3))
    run(node(tmp_path, "b", durable), (4, 5, 6))
    a = node(tmp_path, "a", durable)
    local = a.restore()  # what the Trainer and Accelerate do before reading the fast tier
    assert local is not None and local.startswith(a.fast)
    d = txckpt.CheckpointRoot(a.durable)
    assert txckpt.read_manifest(local).txid == d.history().find(step=6).txid
    assert txckpt.get_last_checkpoint(a) == local and a.restore() is None
    assert [c.step for c in a.fast_root.checkpoints("current")] == [1, 2, 3, 6] and a.pending() == []
