"""Lightning's sharded strategies through txckpt's DCP writer (issue 48, docs/lightning.md,
"Sharded strategies"): tests/children/lightning_sharded.py runs 2 gloo CPU ranks of a
ModelParallelStrategy (FSDP2) fit with TransactionalCheckpointIO, saving every 2 steps.

One scenario, three 2-rank runs: the uninterrupted run to step 6; a run of the same job in which
rank 1 SIGKILLs itself inside the save of step 6 (before the first write of its own shard file,
a real process crash: rank 0 is then stuck in DCP's collective and is killed by its timeout, or
fails); a fresh 2-rank ``fit(ckpt_path="last")`` that must start at step 4 (the newest committed
step: nothing of step 6 was committed) and end with the uninterrupted run's weights and optimizer
state, bit for bit, on both ranks. Then ``fit(ckpt_path=<published name>)`` of a checkpoint whose
shard lost a byte fails on the damaged file, which DCP's default reader would have loaded."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.harness.zygote import popen_python

pytest.importorskip("lightning")

pytestmark = [pytest.mark.process, pytest.mark.lightning]

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "tests" / "children" / "lightning_sharded.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(root: Path, out: Path, *args: str) -> list[tuple[int, str]]:
    """Both ranks of one run (the same command, each its own process); (status, output) per rank."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TXCKPT_COORDINATION_TIMEOUT="60")
    base = [str(RUN), "--dir", str(root), "--out", str(out), "--port", str(_free_port()), *args]
    procs = []
    for r in range(2):
        log = open(out / f"log-rank{r}", "w+")
        procs.append((popen_python(base + ["--rank", str(r)], env=env, stdout=log, stderr=log), log))
    results = []
    for p, log in procs:
        try:
            code = p.wait(120)
        except Exception:  # a rank left waiting on its dead peer's collective: ended here
            p.kill()
            code = p.wait()
        log.seek(0)
        results.append((code, log.read()))
        log.close()
    return results


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _committed_steps(root: Path) -> list[int]:
    """The live committed steps; all of one lineage (a resume continues it, nothing forked)."""
    from txckpt._root.root import CheckpointRoot

    history = CheckpointRoot(str(root)).history()
    live = [c for c in history.checkpoints.values() if c.txid not in history.retired]
    assert len({c.lineage for c in live}) <= 1, [(c.step, c.lineage) for c in live]
    return sorted(c.step for c in live)


def _resume_equals_the_reference(tmp_path: Path, root: Path, *args: str) -> None:
    """A fresh 2-rank ``fit(ckpt_path="last")`` of ``root`` (whose newest commit is step 4)
    starts at step 4, commits 6, and ends with the uninterrupted run's (``ref-out``) weights and
    optimizer state on both ranks, bit for bit."""
    import torch

    resumed = _run(root, tmp_path / "resume-out", "--max-steps", "6", "--resume", *args)
    assert all(code == 0 for code, _ in resumed), [t[-3000:] for _, t in resumed]
    assert _committed_steps(root) == [2, 4, 6]
    for r in range(2):
        want = torch.load(tmp_path / "ref-out" / f"rank{r}.pt", weights_only=True)
        got = torch.load(tmp_path / "resume-out" / f"rank{r}.pt", weights_only=True)
        assert (got["start"], got["end"]) == (4, 6)
        assert want["weights"].keys() == got["weights"].keys()
        for k in want["weights"]:
            assert torch.equal(want["weights"][k], got["weights"][k]), (r, k)
        assert want["optim"].keys() == got["optim"].keys() and want["optim"]
        for k in want["optim"]:
            for n in want["optim"][k]:
                assert torch.equal(want["optim"][k][n], got["optim"][k][n]), (r, k, n)


def test_a_rank_killed_inside_a_sharded_save_commits_nothing_and_last_resumes_the_previous_step(tmp_path):
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    reference = _run(tmp_path / "ref", tmp_path / "ref-out", "--max-steps", "6")
    assert all(code == 0 for code, _ in reference), [t[-3000:] for _, t in reference]
    assert _committed_steps(tmp_path / "ref") == [2, 4, 6]
    # The published names are stock's directory layout, hard links to the committed files (the
    # ModelCheckpoint name and last.ckpt: one commit, three names), which stock tools read.
    published = tmp_path / "ref" / "epoch=2-step=6.ckpt"
    assert sorted(os.listdir(published)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert _inode(published / "meta.pt") == _inode(tmp_path / "ref" / "last.ckpt" / "meta.pt")
    assert os.stat(published / "meta.pt").st_nlink == 3
    assert torch.load(published / "meta.pt", weights_only=False)["global_step"] == 6
    assert "state_dict.a.weight" in FileSystemReader(str(published)).read_metadata().state_dict_metadata

    root, label = tmp_path / "run", tmp_path / "killed-at.json"
    crashed = _run(root, tmp_path / "crash-out", "--max-steps", "6", "--kill-step", "6", "--label", str(label))
    assert crashed[1][0] == -9, crashed[1][1][-3000:]  # rank 1: its own SIGKILL
    assert crashed[0][0] != 0  # rank 0 cannot finish a save a rank died in
    killed_at = json.load(open(label))
    assert "__1_0.distcp" in killed_at["op"] and "checkpoint-6" in killed_at["op"], killed_at
    assert _committed_steps(root) == [2, 4]  # nothing of step 6
    assert not (root / "epoch=2-step=6.ckpt").exists()
    assert _inode(root / "last.ckpt" / "meta.pt") == _inode(root / "epoch=1-step=4.ckpt" / "meta.pt")

    _resume_equals_the_reference(tmp_path, root)

    # ckpt_path=<a published name> resolves to its committed checkpoint and loads through
    # TransactionalReader: a byte flipped in a shard (through the hard link, so in the committed
    # file) is refused, by name, before any weight is used.
    shard = root / "epoch=0-step=2.ckpt" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(shard, "r+b") as f:
        f.write(data)
    damaged = _run(root, tmp_path / "damaged-out", "--max-steps", "4", "--ckpt-path", str(root / "epoch=0-step=2.ckpt"))
    assert all(code != 0 for code, _ in damaged)
    assert "IntegrityError" in damaged[1][1] and "checkpoint-2/__1_0.distcp" in damaged[1][1], damaged[1][1][-3000:]


def test_async_sharded_saves_commit_in_the_background_and_a_rank_killed_in_one_commits_nothing(tmp_path):
    """async_save=True with ModelParallelStrategy over 2 ranks: each save is staged (copied) before
    save_checkpoint returns and committed by dcp.async_save on a gloo group of its own while the
    ranks train on; rank 1 SIGKILLed inside the background save of step 6 commits nothing of it,
    and the restart resumes step 4 and ends bit-equal to the uninterrupted async run."""
    import torch

    reference = _run(tmp_path / "ref", tmp_path / "ref-out", "--max-steps", "6", "--async")
    assert all(code == 0 for code, _ in reference), [t[-3000:] for _, t in reference]
    assert _committed_steps(tmp_path / "ref") == [2, 4, 6]
    published = tmp_path / "ref" / "epoch=2-step=6.ckpt"  # linked once the background commit is done
    assert sorted(os.listdir(published)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert _inode(published / "meta.pt") == _inode(tmp_path / "ref" / "last.ckpt" / "meta.pt")
    assert torch.load(published / "meta.pt", weights_only=False)["global_step"] == 6

    root, label = tmp_path / "run", tmp_path / "killed-at.json"
    crashed = _run(
        root, tmp_path / "crash-out", "--max-steps", "6", "--async", "--kill-step", "6", "--label", str(label)
    )
    assert crashed[1][0] == -9, crashed[1][1][-3000:]
    assert crashed[0][0] != 0  # rank 0's background save lost its peer: raised at teardown
    killed_at = json.load(open(label))
    assert "__1_0.distcp" in killed_at["op"] and "checkpoint-6" in killed_at["op"], killed_at
    assert _committed_steps(root) == [2, 4]
    assert not (root / "epoch=2-step=6.ckpt").exists()

    _resume_equals_the_reference(tmp_path, root, "--async")


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 0])
def test_rotation_of_sharded_names_keeps_what_stock_keeps(tmp_path, top_k):
    """``save_top_k=1`` (and ``0``: ``last.ckpt`` alone) with ``save_last=True``: the run keeps the
    newest checkpoint only, as stock keeps one directory (and last.ckpt); the names are
    directories of links, removed with the checkpoint they name. (ModelParallelStrategy does not
    tear its CheckpointIO down: the plugin's wrapper does, which retires the last superseded one.)"""
    root = tmp_path / "run"
    done = _run(root, tmp_path / "out", "--max-steps", "6", "--top-k", str(top_k))
    assert all(code == 0 for code, _ in done), [t[-3000:] for _, t in done]
    assert _committed_steps(root) == [6]
    names = ["epoch=2-step=6.ckpt", "last.ckpt"] if top_k else ["last.ckpt"]
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["checkpoint-6", *names]
    for n in names:
        assert _inode(root / n / "meta.pt") == _inode(root / "checkpoint-6" / "meta.pt")


@pytest.mark.s3
@pytest.mark.slow
def test_a_sharded_run_on_an_s3_root_resumes_last_from_the_log(tmp_path, s3_root):
    """The plugin's root on an object store (s3 on moto): each sharded save is one transaction
    of both ranks' shards there, with no names (none are links on object stores), and
    ``fit(ckpt_path="last")`` finds the newest committed step through the log, on both ranks."""
    import torch

    import txckpt

    url, so = s3_root
    options = ["--root", url, "--storage-options", json.dumps(so)]
    first = _run(tmp_path / "dir", tmp_path / "first", "--max-steps", "4", *options)
    assert all(code == 0 for code, _ in first), [t[-3000:] for _, t in first]
    resumed = _run(tmp_path / "dir", tmp_path / "resumed", "--max-steps", "6", "--resume", *options)
    assert all(code == 0 for code, _ in resumed), [t[-3000:] for _, t in resumed]
    for r in range(2):
        got = torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=True)
        assert (got["start"], got["end"]) == (4, 6)
    txckpt.forget_roots()
    history = txckpt.open_root(url, so).history()
    live = [c for c in history.checkpoints.values() if c.txid not in history.retired]
    assert len({c.lineage for c in live}) == 1  # the resume continued the lineage
    assert sorted(c.step for c in live) == [2, 4, 6]
    assert not list((tmp_path / "dir").glob("*.ckpt"))  # the names live in the log alone
