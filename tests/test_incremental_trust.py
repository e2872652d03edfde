"""Issue 45 (items 1-3): an incremental save shares a committed file only once its bytes are known
to match its manifest entry. A same-size write or a bit flip in a shared file, a truncation, a
``torch.save`` over it: later saves of good state write the file instead of sharing the damaged
one, commit, and verify; after a fallback the next restart resumes the newest checkpoint, not the
old one. Local shares are clones where the file system can clone (an in-place write then
changes one checkpoint only: tested on a real XFS image), else read-only hard links."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

import txckpt
from txckpt._save import incremental
from txckpt.errors import IntegrityError

MiB = 1 << 20
FROZEN = {"w": torch.arange(3 * MiB // 4, dtype=torch.float32)}  # 3 MiB: past two prefix boundaries
NAME = "frozen.safetensors"


def files(step: int) -> dict:
    return {NAME: FROZEN, "adapter.safetensors": {"a": torch.full((256,), float(step))}, "step.json": {"step": step}}


def restart() -> None:
    """What a new process knows: no root, no checked or damaged file (on b94973a: no root)."""
    txckpt.forget_roots()
    for cache in ("_CHECKED", "_DAMAGED", "_DISTRUSTED"):
        getattr(incremental, cache, {}).clear()


@pytest.fixture(autouse=True)
def _fresh_process_state():
    restart()
    yield
    restart()


def flip(path: str, offset: int = MiB + 4096) -> None:
    """A same-size write in place (one bit), as `open("r+b")` or bit rot does it."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def damaged_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "does not match its manifest entry" in r.getMessage()]


def full_then_incremental(root: str, steps=(2, 3, 4)) -> list[str]:
    paths = [txckpt.save_checkpoint(root, 1, files(1))]
    return paths + [txckpt.save_checkpoint(root, s, files(s), incremental=True) for s in steps]


# ----- same-size damage: local, S3, DCP --------------------------------------------------------
@pytest.mark.parametrize("restarted", [False, True], ids=["same process", "new process"])
def test_a_same_size_write_into_a_shared_file_is_never_shared_into_later_checkpoints(root, restarted, caplog):
    """The same process checked the file at steps 3 and 4, and sees its identity changed; a
    new process has checked nothing and reads it once."""
    caplog.set_level(logging.WARNING, logger="txckpt")
    paths = full_then_incremental(root)
    flip(os.path.join(paths[-1], NAME))  # checkpoints 2-4 hold these bytes
    if restarted:
        restart()
    later = [txckpt.save_checkpoint(root, s, files(s), incremental=True) for s in (5, 6, 7)]
    for p in later:
        txckpt.verify_checkpoint(p)
    warned = damaged_warnings(caplog)
    assert len(warned) == 1 and "checkpoint step 4" in warned[0], warned  # once, naming the damaged checkpoint
    # The good bytes written at step 5 are shared from then on.
    assert len({os.stat(os.path.join(p, NAME)).st_ino for p in later}) == 1


def test_after_a_fallback_new_checkpoints_are_whole_and_the_next_restart_resumes_the_newest(root, caplog):
    """The issue's corpus shape: without the check every save after the fallback was born
    damaged, and every restart fell back to step 1 again: all training after the fault lost."""
    paths = full_then_incremental(root)
    flip(os.path.join(paths[-1], NAME))
    restart()
    assert txckpt.resume(root, on_damaged="fallback") == paths[0]
    saved = [txckpt.save_checkpoint(root, s, files(s), incremental=True) for s in (2, 3)]
    for p in saved:
        txckpt.verify_checkpoint(p)
    restart()
    assert txckpt.resume(root, on_damaged="fallback") == saved[-1]


@pytest.mark.s3
def test_a_same_size_overwrite_of_a_shared_object_is_never_copied_into_later_checkpoints(s3_root):
    import fsspec

    url, so = s3_root
    txckpt.save_checkpoint(url, 1, files(1), storage_options=so)
    three = [txckpt.save_checkpoint(url, s, files(s), storage_options=so, incremental=True) for s in (2, 3)][-1]
    fs = fsspec.filesystem("s3", **so)
    key = f"{three}/{NAME}"
    data = bytearray(fs.cat_file(key))
    data[MiB + 4096] ^= 1
    fs.pipe_file(key, bytes(data))  # a new object of the same size (a tool that uploads over it)
    with pytest.raises(IntegrityError):
        txckpt.verify_checkpoint(three, storage_options=so)
    for s in (4, 5):
        txckpt.verify_checkpoint(
            txckpt.save_checkpoint(url, s, files(s), storage_options=so, incremental=True), storage_options=so
        )


def test_a_damaged_one_item_dcp_file_is_never_shared_into_later_checkpoints(tmp_path):
    import torch.distributed.checkpoint as dcp

    from txckpt.integrations.dcp import TransactionalWriter

    g = torch.Generator().manual_seed(0)
    state = {f"base{i}": torch.randn(300_000, generator=g) for i in range(2)}  # 1.1 MiB each: a file each
    root = str(tmp_path / "root")
    paths = []
    for step in (1, 2):
        dcp.save(state, storage_writer=TransactionalWriter(root, step, incremental=True), no_dist=True)
        paths.append(txckpt.get_last_checkpoint(root))
    alone = sorted(
        n for n in txckpt.read_manifest(paths[1]).files if n.endswith(".distcp") and not n.endswith("_0.distcp")
    )
    assert (
        alone and os.stat(os.path.join(paths[1], alone[0])).st_ino == os.stat(os.path.join(paths[0], alone[0])).st_ino
    )
    flip(os.path.join(paths[1], alone[0]), offset=600_000)
    for step in (3, 4):
        dcp.save(state, storage_writer=TransactionalWriter(root, step, incremental=True), no_dist=True)
        txckpt.verify_checkpoint(txckpt.get_last_checkpoint(root))


# ----- size-changing damage --------------------------------------------------------------------
def _truncate(path: str) -> None:
    os.truncate(path, 1000)


def _torch_save_over(path: str) -> None:
    torch.save({"something": "else"}, path)  # opens the name for writing: the same inode, truncated


def _append(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"tail")


@pytest.mark.parametrize("damage", [_truncate, _torch_save_over, _append], ids=["truncate", "torch.save", "append"])
def test_a_size_changing_write_into_a_shared_file_does_not_block_later_saves(root, damage, caplog):
    caplog.set_level(logging.WARNING, logger="txckpt")
    paths = full_then_incremental(root)
    damage(os.path.join(paths[-1], NAME))
    for s in (5, 6):
        txckpt.verify_checkpoint(txckpt.save_checkpoint(root, s, files(s), incremental=True))
    assert len(damaged_warnings(caplog)) == 1, damaged_warnings(caplog)


def test_files_written_into_tx_directory_are_never_replaced_by_a_damaged_share(root):
    """A Trainer writes its files into tx.directory; the save then replaces each one equal to a
    committed file by a share of it. Through a damaged source that swapped the good file
    written for the damaged inode."""
    blob = os.urandom(2 * MiB)

    def save(step: int) -> str:
        with txckpt.transaction(root, step, incremental=True) as tx:
            with open(os.path.join(tx.directory, "tokenizer.json"), "wb") as f:
                f.write(blob)
        return txckpt.get_last_checkpoint(root)

    paths = [save(s) for s in (1, 2, 3)]
    flip(os.path.join(paths[-1], "tokenizer.json"))
    txckpt.verify_checkpoint(save(4))


# ----- what a shared file is on the disk -------------------------------------------------------
def test_a_hard_linked_shared_file_is_read_only(root):
    """Where the file system cannot clone (ext4, tmpfs), a shared file is a hard link, and its
    inode loses its write bits: an ordinary tool run by a user other than root gets EACCES
    instead of changing every checkpoint that holds it."""
    paths = full_then_incremental(root, steps=(2, 3))
    shared = os.path.join(paths[-1], NAME)
    if os.stat(shared).st_nlink == 1:
        pytest.skip("this file system clones: a shared file is a file of its own")
    assert os.stat(shared).st_nlink == 2
    assert os.stat(shared).st_mode & 0o222 == 0
    assert os.stat(os.path.join(paths[-1], "adapter.safetensors")).st_mode & 0o200  # written, not shared


def _mount_xfs(tmp_path) -> str:
    """A fresh XFS file system (reflink on, the mkfs default) loop-mounted at tmp_path/xfs."""
    if os.geteuid() != 0:
        pytest.skip("mounting an XFS image needs root")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is not installed (apt-get install xfsprogs)")
    image, mnt = str(tmp_path / "xfs.img"), str(tmp_path / "xfs")
    with open(image, "wb") as f:
        f.truncate(512 * MiB)  # sparse: XFS wants 300 MiB at least
    os.mkdir(mnt)
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", image], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.xfs failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", image, mnt], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an XFS image here: {mounted.stderr.strip()}")
    return mnt


@pytest.mark.process
def test_on_a_file_system_that_clones_an_in_place_write_damages_one_checkpoint_only(tmp_path):
    """On XFS a shared file is a clone: the stock tools that write in place (open r+b,
    torch.save over the file, cp over it) each damage the checkpoint they write into, and no
    other; the next save is whole and the next restart resumes it."""
    mnt = _mount_xfs(tmp_path)
    try:
        root = os.path.join(mnt, "out")
        paths = full_then_incremental(root, steps=(2, 3, 4, 5, 6))
        inodes = {os.stat(os.path.join(p, NAME)).st_ino for p in paths[1:]}
        assert len(inodes) == 5  # clones: a file of its own each
        other = str(tmp_path / "other")
        with open(other, "wb") as f:
            f.write(os.urandom(os.path.getsize(os.path.join(paths[1], NAME))))
        flip(os.path.join(paths[2], NAME))
        _torch_save_over(os.path.join(paths[3], NAME))
        subprocess.run(["cp", other, os.path.join(paths[4], NAME)], check=True)
        for p in paths[2:5]:
            with pytest.raises(IntegrityError):
                txckpt.verify_checkpoint(p)
        for p in (paths[0], paths[1], paths[5]):
            txckpt.verify_checkpoint(p)
        txckpt.verify_checkpoint(txckpt.save_checkpoint(root, 7, files(7), incremental=True))
        restart()
        assert txckpt.resume(root, on_damaged="fallback") == txckpt.get_last_checkpoint(root)
    finally:
        restart()
        subprocess.run(["umount", mnt], check=True)


STOCK_WRITES = r"""
import os, subprocess, sys, torch, txckpt
root = sys.argv[1]
base = {"w": torch.arange(3 << 18, dtype=torch.float32)}
paths = [txckpt.save_checkpoint(root, s, {"frozen.safetensors": base, "step.json": {"step": s}},
                                incremental=True) for s in (1, 2, 3)]
target = os.path.join(paths[-1], "frozen.safetensors")
print("LINKS", os.stat(target).st_nlink)
refused = []
for name, write in [("torch.save", lambda: torch.save({"x": 1}, target)),
                    ("open r+b", lambda: open(target, "r+b").close()),
                    ("truncate", lambda: os.truncate(target, 10))]:
    try:
        write()
    except (PermissionError, RuntimeError) as e:  # torch.save's C++ writer: RuntimeError "... Permission denied"
        if isinstance(e, PermissionError) or "Permission denied" in str(e):
            refused.append(name)
if subprocess.run(["cp", "/dev/null", target], capture_output=True).returncode != 0:
    refused.append("cp")
for p in paths:
    txckpt.verify_checkpoint(p)
print("REFUSED", ",".join(refused))
"""


def test_a_user_but_root_cannot_write_into_a_hard_linked_shared_file(tmp_path):
    """On ext4/tmpfs (hard links) a shared inode is read-only: the stock calls that write in
    place fail with EACCES for an ordinary user, and every checkpoint stays whole. Run as root
    here, the child drops root's permission override (CAP_DAC_OVERRIDE) to be such a user."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to drop root's permission override")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    root = str(tmp_path / "out")
    out = subprocess.run(
        prefix + [sys.executable, "-c", STOCK_WRITES, root],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(txckpt.__file__))},
    )
    if "LINKS 1\n" in out.stdout:  # pragma: no cover - a file system that clones
        pytest.skip("this file system clones: shared files are files of their own")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("REFUSED ", 1)[1].strip() == "torch.save,open r+b,truncate,cp", out.stdout


# ----- what the check costs ---------------------------------------------------------------------
def test_a_shared_file_is_read_at_most_once_per_process(root, monkeypatch):
    """The process that wrote a file hashed it as it wrote it: it shares it without reading it
    back. A new process reads each shared inode once, then trusts its unchanged identity, until
    RECHECK_EVERY shares have passed."""
    reads: list[str] = []
    hash_stored = incremental._hash_stored
    monkeypatch.setattr(
        incremental,
        "_hash_stored",
        lambda storage, key, size: (reads.append(key.rsplit("/", 1)[-1]), hash_stored(storage, key, size))[1],
    )
    full_then_incremental(root, steps=(2, 3, 4, 5))
    assert reads == []
    restart()
    for s in (6, 7, 8):
        txckpt.save_checkpoint(root, s, files(s), incremental=True)
    assert reads == [NAME], reads  # the frozen base: the one file unchanged since step 2
    monkeypatch.setattr(incremental, "RECHECK_EVERY", 2)
    restart()
    reads.clear()
    for s in (9, 10, 11, 12, 13):
        txckpt.save_checkpoint(root, s, files(s), incremental=True)
    assert reads == [NAME] * 2, reads  # read at step 9, trusted at 10 and 11, read again at 12


def test_a_checkpoint_a_load_found_damaged_is_never_shared_from(root, monkeypatch):
    """Bit rot changes no file's identity: a process that checked the file before trusts it.
    A load that finds the checkpoint damaged tells the process's later saves not to share
    from it. (Identities here leave out mtime and ctime, as a bit flip on the medium would.)"""
    from txckpt._storage.local.store import LocalStorage

    def rot_blind(self, key):
        st = os.lstat(self._p(key))
        return (st.st_dev, st.st_ino, st.st_size)

    monkeypatch.setattr(LocalStorage, "file_identity", rot_blind, raising=False)
    monkeypatch.setattr(
        LocalStorage, "identity_after_share", lambda self, key, before: rot_blind(self, key), raising=False
    )
    paths = full_then_incremental(root, steps=(2, 3))
    flip(os.path.join(paths[-1], NAME))
    with pytest.raises(IntegrityError):
        txckpt.load_checkpoint(paths[-1])
    txckpt.verify_checkpoint(txckpt.save_checkpoint(root, 4, files(4), incremental=True))


def test_a_source_written_over_while_the_save_runs_fails_that_save_only(root):
    """The share is decided at tx.save and placed at the rank's end: a source written into in
    between (its identity moved, its bytes changed) fails the save with IntegrityError naming
    it, committing nothing; the next save writes the file and commits."""
    paths = full_then_incremental(root, steps=(2, 3))
    with pytest.raises(IntegrityError, match="changed while it saved") as raised:
        with txckpt.transaction(root, 4, incremental=True) as tx:
            for name, obj in files(4).items():
                tx.save(name, obj)
            flip(os.path.join(paths[-1], NAME))
    assert raised.value.path == os.path.join(paths[-1], NAME)
    assert txckpt.get_last_checkpoint(root) == paths[-1]
    txckpt.verify_checkpoint(txckpt.save_checkpoint(root, 4, files(4), incremental=True))


def test_a_dcp_rank_shares_the_files_it_wrote_without_reading_them_back(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from txckpt.integrations.dcp import TransactionalWriter

    reads: list[str] = []
    hash_stored = incremental._hash_stored
    monkeypatch.setattr(
        incremental, "_hash_stored", lambda storage, key, size: (reads.append(key), hash_stored(storage, key, size))[1]
    )
    g = torch.Generator().manual_seed(0)
    state = {f"base{i}": torch.randn(300_000, generator=g) for i in range(2)}
    root = str(tmp_path / "root")
    for step in (1, 2, 3):
        dcp.save(state, storage_writer=TransactionalWriter(root, step, incremental=True), no_dist=True)
    assert reads == []
    restart()
    dcp.save(state, storage_writer=TransactionalWriter(root, 4, incremental=True), no_dist=True)
    assert len(reads) == 2, reads  # a new process: each shared tensor file once
