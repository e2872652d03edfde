"""Damaged checkpoints and hostile manifests give typed errors and delete nothing."""

import json
import os

import pytest
import torch

import txckpt
import txckpt.errors
from tests.harness.zygote import run_python
from txckpt.errors import IntegrityError, LogCorruptError, ManifestError, UnsafePathError


def make(root):
    return txckpt.save_checkpoint(
        root,
        2,
        {
            "model.safetensors": {"w": torch.arange(100, dtype=torch.float32)},
            "optimizer.pt": {"m": torch.ones(50)},
            "trainer_state.json": {"global_step": 2},
        },
    )


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
    from txckpt._base import checksum
    from txckpt._manifest.manifest import FileEntry, Manifest

    m = txckpt.read_manifest(path)
    body = m.body()
    body["files"][name] = FileEntry(len(content), checksum.digest_bytes(content), "bytes").to_json()
    from txckpt._manifest.manifest import _digest

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

        from txckpt._storage.local.store import LocalStorage

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
    out = run_python(["-m", "txckpt.demo", str(tmp_path / "demo")], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "abandons 2 checkpoint(s)" in out.stdout
    assert "get_last_checkpoint -> " + str(tmp_path / "demo" / "checkpoint-2") in out.stdout
    assert out.stdout.count("verified, manifest unchanged: True") == 2


# ----- special files where a committed file was (a FIFO must never hang a reader) -------------
_SPECIAL_PROBE = r"""
import json, sys
import txckpt
path = sys.argv[1]
out = {}
for label, fn in [("load", lambda: txckpt.load_checkpoint(path)),
                  ("load-unverified", lambda: txckpt.load_checkpoint(path, verify=False)),
                  ("verify", lambda: txckpt.verify_checkpoint(path))]:
    try:
        fn()
        out[label] = "ok"
    except Exception as e:
        out[label] = [type(e).__name__, getattr(e, "kind", None), getattr(e, "path", None), str(e)]
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
        out = run_python(["-c", _SPECIAL_PROBE, path], timeout=120)
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
    from txckpt._base import fileio
    from txckpt.errors import SpecialFileError

    p = str(tmp_path / "fifo")
    os.mkfifo(p)
    code = (
        "import sys; from txckpt._base import fileio\n"
        "for f in (lambda: fileio.hash_file(sys.argv[1]), lambda: fileio.read_into_buffer(sys.argv[1], 0, hash=True),\n"
        "          lambda: fileio.open_regular(sys.argv[1])):\n"
        "    try: f(); print('read')\n"
        "    except Exception as e: print(type(e).__name__)\n"
    )
    out = run_python(["-c", code, p], timeout=120)
    assert out.stdout.split() == ["SpecialFileError"] * 3, out.stderr
    with pytest.raises(SpecialFileError) as e:
        fileio.regular_size(p)
    assert e.value.kind == "FIFO" and e.value.path == p


# ----- bad names, steps and a temp file deleted under an append: typed errors, nothing lost ----
def _staging_empty(root):
    """No staging of an uncommitted save and no intent is left (committed homes may stay)."""
    tx_dir = os.path.join(root, ".txckpt", "tx")
    intents = os.path.join(root, ".txckpt", "intents")
    committed = set(txckpt.CheckpointRoot(root).history().checkpoints) if os.path.isdir(tx_dir) else set()
    return (not os.path.isdir(tx_dir) or set(os.listdir(tx_dir)) <= committed) and (
        not os.path.isdir(intents) or os.listdir(intents) == []
    )


@pytest.mark.parametrize("first,second", [("a", "a/b"), ("a/b", "a"), ("d/a", "d/a/b/c")])
def test_a_file_and_a_directory_of_the_same_name_are_refused(root, first, second):
    from txckpt.errors import InvalidArgumentError

    prev = txckpt.save_checkpoint(root, 1, {"x.json": 1})
    with pytest.raises(InvalidArgumentError, match="Rename one of them") as e:
        with txckpt.transaction(root, 2) as tx:
            tx.save(first, b"1")
            tx.save(second, b"2")
    assert repr(min(first, second, key=len)) in str(e.value)
    assert txckpt.get_last_checkpoint(root) == prev
    assert _staging_empty(root)


def test_a_directory_name_clash_across_ranks_is_refused_at_commit():
    from txckpt.errors import InvalidArgumentError
    from txckpt._manifest.manifest import check_name_tree

    check_name_tree(["a", "b/a", "ab/c"])
    with pytest.raises(InvalidArgumentError, match="'a/b/c' needs 'a/b'"):
        check_name_tree(["x", "a/b", "a/b/c"])


def test_a_tx_directory_file_blocks_a_nested_name(root):
    from txckpt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="Rename one of them"):
        with txckpt.transaction(root, 1) as tx:
            open(os.path.join(tx.directory, "a"), "wb").write(b"1")
            tx.save("a/b.json", 1)
    assert txckpt.get_last_checkpoint(root) is None and _staging_empty(root)


@pytest.mark.parametrize("name", ["x" * 256, "d/" + "é" * 128 + ".bin"])
def test_a_name_over_the_file_system_limit_is_refused(root, name):
    from txckpt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="at most 255"):
        txckpt.save_checkpoint(root, 1, {name: b"x", "ok.json": 1})
    assert txckpt.get_last_checkpoint(root) is None and _staging_empty(root)
    txckpt.save_checkpoint(root, 1, {"x" * 255: b"x"})  # the limit itself is fine


@pytest.mark.parametrize(
    "step", [10**300, 10**5000, 2**63, -1, 1.5, True], ids=["1e300", "1e5000", "2**63", "-1", "1.5", "True"]
)
def test_steps_outside_0_to_2_63_are_typed_errors(root, step):
    from txckpt.errors import InvalidArgumentError

    prev = txckpt.save_checkpoint(root, 3, {"x.json": 1})
    with pytest.raises(InvalidArgumentError, match=r"0 <= step < 2\*\*63"):
        txckpt.save_checkpoint(root, step, {"x.json": 2})
    with pytest.raises(InvalidArgumentError, match=r"0 <= step < 2\*\*63"):
        txckpt.resume(root, step=step)
    assert txckpt.get_last_checkpoint(root) == prev and _staging_empty(root)
    txckpt.save_checkpoint(root, 2**63 - 1, {"x.json": 3})  # the largest step works


def test_temp_file_removed_by_gc_during_a_retention_append(root, monkeypatch):
    from txckpt.errors import StorageError, TempFileRemovedError
    from txckpt._maintenance.retention import RetentionPolicy, apply_retention
    from txckpt._storage.local import store as local

    for s in (1, 2, 3):
        txckpt.save_checkpoint(root, s, {"w.bin": bytes([s]) * 1000})
    before = tree(root)
    real_link = os.link
    ran = []

    def link_after_gc(src, dst, *a, **k):
        if os.path.basename(os.path.dirname(src)) == "log" and not ran:
            # The real `txckpt gc --grace 0`, between the temp file's write and its link.
            ran.append(run_python(["-m", "txckpt", "gc", "--grace", "0", root], timeout=120))
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr(local.os, "link", link_after_gc)
    r = txckpt.CheckpointRoot(root)
    with pytest.raises(TempFileRemovedError, match="grace period") as e:
        apply_retention(r, RetentionPolicy(keep_last=1))
    assert ran and ran[0].returncode == 0, ran[0].stderr
    assert "removed" in ran[0].stdout and ".tmp" in ran[0].stdout
    assert isinstance(e.value, StorageError) and e.value.path.endswith(".tmp")
    assert not str(e.value).endswith("None")
    assert_nothing_deleted(before, root)  # no retire entry, no data deleted
    monkeypatch.setattr(local.os, "link", real_link)
    txckpt.forget_roots()
    gone = apply_retention(txckpt.CheckpointRoot(root), RetentionPolicy(keep_last=1))
    assert sorted(i.step for i in gone) == [1, 2]


# ----- tx.directory and tx.save of the same name ----------------------------------------------
def _save_pretrained_like(directory, content=b'{"hidden": 4}'):
    with open(os.path.join(directory, "config.json"), "wb") as f:
        f.write(content)


def test_tx_save_over_a_file_written_into_tx_directory_is_refused(root):
    from txckpt.errors import InvalidArgumentError

    prev = txckpt.save_checkpoint(root, 1, {"x.json": 1})
    with pytest.raises(InvalidArgumentError, match="already in tx.directory") as e:
        with txckpt.transaction(root, 2) as tx:
            _save_pretrained_like(tx.directory)
            tx.save("config.json", {"x": 1})
    assert "config.json" in str(e.value)
    assert txckpt.get_last_checkpoint(root) == prev and _staging_empty(root)


@pytest.mark.parametrize("same_size", [False, True])
def test_tx_directory_overwriting_a_tx_save_file_says_what_happened(root, same_size):
    from txckpt.errors import InvalidArgumentError

    prev = txckpt.save_checkpoint(root, 1, {"x.json": 1})
    with pytest.raises(InvalidArgumentError, match="written again in tx.directory") as e:
        with txckpt.transaction(root, 2) as tx:
            with tx.open("config.json") as f:
                f.write(b'{"hidden": 8}')
            # Another write of the same name, in place: even with the same size, within the
            # same tick of the file system's coarse clock, the commit must see it.
            _save_pretrained_like(tx.directory, b'{"hidden": 4}' if same_size else b'{"hidden": 4, "x": 1}')
    assert "deleted by hand" not in str(e.value)
    assert txckpt.get_last_checkpoint(root) == prev and _staging_empty(root)


def test_tx_save_and_tx_directory_with_distinct_names_still_commit(root):
    with txckpt.transaction(root, 1) as tx:
        tx.save("model.safetensors", {"w": torch.ones(3)})
        _save_pretrained_like(tx.directory)
    out = txckpt.load_checkpoint(tx.path)
    assert out["config.json"] == {"hidden": 4} and torch.equal(out["model.safetensors"]["w"], torch.ones(3))


def test_fifo_log_entry_hint_lease_and_intent_are_handled_without_blocking(root):
    make(root)
    meta = os.path.join(root, ".txckpt")
    newest = sorted(os.listdir(os.path.join(meta, "log")))[-1]
    os.makedirs(os.path.join(meta, "readers"), exist_ok=True)
    os.makedirs(os.path.join(meta, "intents"), exist_ok=True)
    os.unlink(os.path.join(meta, "latest"))
    for rel in ("latest", "readers/x.0000.json", "intents/9-abc-0000.json"):
        os.mkfifo(os.path.join(meta, rel))
    code = (
        "import sys, txckpt\nfrom txckpt._maintenance.gc import collect_garbage\n"
        "r = sys.argv[1]\nprint(txckpt.get_last_checkpoint(r))\n"
        "rep = collect_garbage(txckpt.CheckpointRoot(r), grace_seconds=0)\n"
        "print(sorted(i.kind for i in rep.items if i.done))\n"
    )
    out = run_python(["-c", code, root], timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == os.path.join(root, "checkpoint-2")  # a FIFO hint reads as a missing one
    assert lines[1] == str(sorted(["intent", "lease"]))  # unreadable records: gc removes them
    os.unlink(os.path.join(meta, "log", newest))
    os.mkfifo(os.path.join(meta, "log", newest))
    code = "import sys, txckpt\ntry:\n    txckpt.get_last_checkpoint(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    out = run_python(["-c", code, root], timeout=120)
    assert out.stdout.startswith("LogCorruptError") and "a FIFO, not a file" in out.stdout, out.stdout + out.stderr


def test_a_fifo_in_tx_directory_aborts_the_commit_instead_of_hanging(tmp_path):
    """Files other code put into tx.directory are read at commit (hashed in place on a local
    root, uploaded from the scratch directory on a remote one): a FIFO there must not block."""
    code = r"""
import os, sys, txckpt
root = sys.argv[1]
try:
    with txckpt.transaction(root, 1) as tx:
        tx.save("a.json", 1)
        os.mkfifo(os.path.join(tx.directory, "pipe.bin"))
    print("committed")
except Exception as e:
    print(type(e).__name__, "FIFO" in str(e), txckpt.get_last_checkpoint(root))
"""
    for root in (str(tmp_path / "local"), "memory://fifo-commit"):
        out = run_python(["-c", code, root], timeout=120)
        assert out.stdout.split() == ["SpecialFileError", "True", "None"], (root, out.stdout, out.stderr)


def test_a_path_over_the_file_system_limit_is_a_storage_error(root):
    name = "abcdefgh/" * 500 + "x"  # every component is short; the whole path is over PATH_MAX
    with pytest.raises(txckpt.errors.StorageError, match="longer than the file system allows"):
        txckpt.save_checkpoint(root, 1, {name: b"x"})
    assert txckpt.get_last_checkpoint(root) is None and _staging_empty(root)
