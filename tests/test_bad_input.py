"""Damaged checkpoints and hostile manifests give typed errors and delete nothing."""

import json
import os
import subprocess
import sys

import pytest
import torch

import txckpt
import txckpt.errors
from txckpt.errors import IntegrityError, LogCorruptError, ManifestError, UnsafePathError


def make(root):
    return txckpt.save_checkpoint(root, 2, {
        "model.safetensors": {"w": torch.arange(100, dtype=torch.float32)},
        "optimizer.pt": {"m": torch.ones(50)},
        "trainer_state.json": {"global_step": 2},
    })


def tree(root):
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def assert_nothing_deleted(before, root):
    after = tree(root)
    missing = set(before) - set(after)
    assert not missing, f"deleted: {missing}"


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_flipped_byte(root, name):
    path = make(root)
    p = os.path.join(path, name)
    data = bytearray(open(p, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(p, "wb").write(bytes(data))
    before = tree(root)
    with pytest.raises(IntegrityError, match=name):
        txckpt.load_checkpoint(path)
    with pytest.raises(IntegrityError, match="checksum"):
        txckpt.verify_checkpoint(path)
    assert_nothing_deleted(before, root)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_truncated_file(root, name):
    path = make(root)
    p = os.path.join(path, name)
    os.truncate(p, os.path.getsize(p) - 3)
    before = tree(root)
    with pytest.raises(IntegrityError, match="truncated"):
        txckpt.load_checkpoint(path)
    assert_nothing_deleted(before, root)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_missing_file(root, name):
    path = make(root)
    os.unlink(os.path.join(path, name))
    before = tree(root)
    with pytest.raises(IntegrityError, match="missing"):
        txckpt.load_checkpoint(path)
    assert_nothing_deleted(before, root)


def _edit_manifest(path, change, keep_digest=True):
    mp = os.path.join(path, txckpt.MANIFEST_NAME)
    body = json.load(open(mp))
    change(body)
    json.dump(body, open(mp, "w"))


def test_edited_manifest(root):
    path = make(root)
    _edit_manifest(path, lambda b: b["files"]["trainer_state.json"].update(size=1))
    before = tree(root)
    with pytest.raises(ManifestError, match="edited"):
        txckpt.load_checkpoint(path)
    assert_nothing_deleted(before, root)


def test_missing_manifest(root):
    path = make(root)
    os.unlink(os.path.join(path, txckpt.MANIFEST_NAME))
    with pytest.raises(ManifestError, match="no txckpt-manifest.json"):
        txckpt.load_checkpoint(path)


def test_garbage_manifest(root):
    path = make(root)
    open(os.path.join(path, txckpt.MANIFEST_NAME), "w").write("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        txckpt.load_checkpoint(path)


def _forge(path, name, content=b"x"):
    """A manifest naming ``name``, with a digest that verifies (an attacker or a bug, not an edit)."""
    from txckpt import checksum
    from txckpt.manifest import FileEntry, Manifest

    m = txckpt.read_manifest(path)
    body = m.body()
    body["files"][name] = FileEntry(len(content), checksum.digest_bytes(content), "bytes").to_json()
    from txckpt.manifest import _digest

    body["digest"] = _digest({k: v for k, v in body.items() if k != "digest"})
    open(os.path.join(path, txckpt.MANIFEST_NAME), "w").write(json.dumps(body))
    return Manifest


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "..", "./a"])
def test_manifest_naming_a_path_outside(root, name):
    path = make(root)
    _forge(path, name)
    before = tree(root)
    with pytest.raises(UnsafePathError):
        txckpt.load_checkpoint(path)
    with pytest.raises(UnsafePathError):
        txckpt.verify_checkpoint(path)
    assert_nothing_deleted(before, root)


def test_symlink_out_of_the_root(root, tmp_path):
    path = make(root)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x")
    os.symlink(secret, os.path.join(path, "link.bin"))
    _forge(path, "link.bin", b"x")
    # Inside the root, the forged manifest itself is refused: the log committed another digest.
    with pytest.raises(IntegrityError, match="not the manifest the log committed"):
        txckpt.load_checkpoint(path)
    # A copy outside any root is read on its own manifest's word: the symlink is still refused.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(path, copy, symlinks=True)
    with pytest.raises(UnsafePathError, match="symlink"):
        txckpt.load_checkpoint(copy)


def test_symlink_out_of_the_root_is_not_committed(root, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x")
    with pytest.raises(UnsafePathError, match="symlink"):
        with txckpt.transaction(root, 1) as tx:
            tx.save("a.json", 1)
            os.symlink(secret, os.path.join(tx.directory, "escape.bin"))
    assert txckpt.get_last_checkpoint(root) is None
    assert secret.read_bytes() == b"x"


def test_damaged_log_entry_is_a_typed_error(root):
    make(root)
    log_dir = os.path.join(root, ".txckpt", "log")
    newest = sorted(os.listdir(log_dir))[-1]
    open(os.path.join(log_dir, newest), "w").write("garbage")
    with pytest.raises(LogCorruptError, match="restore"):
        txckpt.get_last_checkpoint(root)


def test_checkpoint_deleted_by_hand_falls_back_with_a_warning(root, txlog):
    txckpt.save_checkpoint(root, 1, {"a.json": 1})
    p2 = txckpt.save_checkpoint(root, 2, {"a.json": 2})
    import shutil

    shutil.rmtree(p2)
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-1")
    assert "missing" in txlog.text and "txckpt verify" in txlog.text


def test_read_only_root_gives_a_clear_error(root):
    if os.geteuid() == 0:
        # root ignores permission bits; a read-only bind mount needs privileges the suite avoids.
        import errno

        from txckpt.storage.local import LocalStorage

        class ReadOnly(LocalStorage):
            def open_write(self, key, *, durable):
                raise OSError(errno.EROFS, "Read-only file system", key)

        make(root)
        r = txckpt.CheckpointRoot(root, storage=ReadOnly(root))
        before = tree(root)
        with pytest.raises(txckpt.errors.StorageError, match="read-only filesystem"):
            r.save(3, {"a.json": 1})
        assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-2")
        assert_nothing_deleted(before, root)
        return
    pytest.skip("needs root")


def test_demo_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "txckpt.demo", str(tmp_path / "demo")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "abandons 2 checkpoint(s)" in out.stdout
    assert "get_last_checkpoint -> " + str(tmp_path / "demo" / "checkpoint-2") in out.stdout
    assert out.stdout.count("verified, manifest unchanged: True") == 2


# ----- special files where a committed file was (a FIFO must never hang a reader) -------------
_SPECIAL_PROBE = r"""
import json, sys
import txckpt
from txckpt.errors import IntegrityError, SpecialFileError
path = sys.argv[1]
out = {}
for label, fn in [("load", lambda: txckpt.load_checkpoint(path)),
                  ("load-unverified", lambda: txckpt.load_checkpoint(path, verify=False)),
                  ("verify", lambda: txckpt.verify_checkpoint(path))]:
    try:
        fn()
        out[label] = "ok"
    except SpecialFileError as e:
        out[label] = ["SpecialFileError", e.kind, e.path, str(e)]
    except Exception as e:
        out[label] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def _replace_with_special(p, kind):
    os.unlink(p)
    if kind == "FIFO":
        os.mkfifo(p)
        return None
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(p)  # a bound socket stays in the file system while s lives
    return s


@pytest.mark.parametrize("kind", ["FIFO", "socket"])
@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.json"])
def test_committed_file_replaced_by_a_special_file_is_a_typed_error_not_a_hang(tmp_path, kind, name):
    root = str(tmp_path / "r")  # short: a unix socket's path is limited to 107 bytes
    path = make(root)
    p = os.path.join(path, name)
    keep = _replace_with_special(p, kind)
    try:
        # A child process: on a reader that blocks on the FIFO the timeout fails the test.
        out = subprocess.run([sys.executable, "-c", _SPECIAL_PROBE, path], capture_output=True, text=True,
                             timeout=120)
    finally:
        if keep is not None:
            keep.close()
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    for label in ("load", "load-unverified", "verify"):
        typ, got_kind, got_path, msg = res[label]
        assert (typ, got_kind, got_path) == ("SpecialFileError", kind, p), res
        assert "resume from another" in msg
    assert issubclass(txckpt.errors.SpecialFileError, IntegrityError)


def test_fileio_never_blocks_on_a_fifo(tmp_path):
    from txckpt import fileio
    from txckpt.errors import SpecialFileError

    p = str(tmp_path / "fifo")
    os.mkfifo(p)
    code = ("import sys; from txckpt import fileio\n"
            "for f in (lambda: fileio.hash_file(sys.argv[1]), lambda: fileio.read_into_buffer(sys.argv[1], 0, hash=True),\n"
            "          lambda: fileio.open_regular(sys.argv[1])):\n"
            "    try: f(); print('read')\n"
            "    except Exception as e: print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code, p], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["SpecialFileError"] * 3, out.stderr
    with pytest.raises(SpecialFileError) as e:
        fileio.regular_size(p)
    assert e.value.kind == "FIFO" and e.value.path == p
