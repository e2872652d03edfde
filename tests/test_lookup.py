"""get_last_checkpoint at the edges: a reader that a writer outpaces, a root that does not exist,
a checkpoint directory passed as the root, and the form of the path it returns."""

from __future__ import annotations

import os

import pytest

import txckpt
from txckpt._log import log as commit_log
from txckpt.errors import LookupRaceError, RootNotFoundError
from txckpt._maintenance.gc import collect_garbage
from txckpt._base.refs import Ref
from txckpt._base.layout import home_key
from txckpt._maintenance.retention import RetentionPolicy, apply_retention


pytestmark = pytest.mark.non_durable  # TXCKPT_DURABLE=0 for every test here (tests/conftest.py)


def files(step: int) -> dict:
    return {"w.bin": f"w{step}".encode() * 16, "meta.json": {"step": step}}


def step_of(path: str, so: dict | None) -> int:
    return txckpt.read_manifest(path, storage_options=so).step


def hold_after_first_log_read(monkeypatch, run_writer) -> None:
    """Hold the reader between its read of the log and its next request: ``run_writer`` runs
    right after the first ``read_state`` returns (a deterministic hook, no sleeps)."""
    real = commit_log.read_state
    calls = []

    def held(storage):
        out = real(storage)
        if not calls:
            calls.append(out.seq)
            run_writer()
        return out

    monkeypatch.setattr(commit_log, "read_state", held)


# ----- a reader outpaced by the writer's rotation (protocol §6 step 4) --------------------------
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_lookup_follows_the_log_when_rotation_deletes_the_tip_it_read(kind, tmp_path, request, monkeypatch):
    """The readers-polling failure, made deterministic: the reader reads the log (tip: step 3),
    then the writer saves 4 and 5 and rotates with keep_last=2 (3 is retired and deleted) and
    runs gc. The reader must answer step 5, never None."""
    if kind == "local":
        root, so = str(tmp_path / "out"), None
    else:
        root, so = request.getfixturevalue("s3_root")
    writer = txckpt.CheckpointRoot(root, so)
    for s in (1, 2, 3):
        writer.save(s, files(s))
        apply_retention(writer, RetentionPolicy(keep_last=2))
    reader = txckpt.CheckpointRoot(root, so)

    def writer_runs():
        for s in (4, 5):
            writer.save(s, files(s))
            apply_retention(writer, RetentionPolicy(keep_last=2))
        collect_garbage(writer)

    hold_after_first_log_read(monkeypatch, writer_runs)
    path = reader.get_last_checkpoint()
    assert path is not None, "lookup returned None while step 5 was committed"
    assert step_of(path, so) == 5


def test_lookup_finds_a_tip_published_between_its_two_reads(tmp_path, monkeypatch, txlog):
    """On a rename backend, locate reads checkpoint-N, then the home. A publication (home ->
    checkpoint-N) between the two makes both miss; the lookup must find the tip, not fall back
    to an older checkpoint with a "deleted by hand" warning."""
    root = str(tmp_path / "out")
    writer = txckpt.CheckpointRoot(root)
    writer.save(1, files(1))
    writer.save(2, files(2))
    tip = writer.state().head_tip
    # Committed but not yet published: the state between §8 steps 9 and 10.
    os.rename(os.path.join(root, "checkpoint-2"), os.path.join(root, *home_key(tip.txid, 2).split("/")))
    reader = txckpt.CheckpointRoot(root)
    real = reader.storage.read_bytes
    published = []

    def racing(key):
        try:
            return real(key)
        except FileNotFoundError:
            if key == "checkpoint-2/txckpt-manifest.json" and not published:
                published.append(writer.publication.publish(Ref(tip.lineage, 2, tip.txid)))
            raise

    monkeypatch.setattr(reader.storage, "read_bytes", racing)
    path = reader.get_last_checkpoint()
    assert published == ["checkpoint-2"]
    assert path == os.path.join(root, "checkpoint-2")
    assert "missing" not in txlog.text


def test_lookup_gives_up_with_a_typed_error_when_always_outpaced(tmp_path, monkeypatch):
    """A writer that retires the tip under every attempt: a typed error, never None."""
    root = str(tmp_path / "out")
    writer = txckpt.CheckpointRoot(root)
    writer.save(1, files(1))
    reader = txckpt.CheckpointRoot(root)
    step = [1]
    real_state = reader.state

    def state_then_rotate():
        out = real_state()
        # The tip this read names is retired and deleted before the reader locates it.
        step[0] += 1
        writer.save(step[0], files(step[0]))
        apply_retention(writer, RetentionPolicy(keep_last=1))
        return out

    monkeypatch.setattr(reader, "state", state_then_rotate)
    with pytest.raises(LookupRaceError) as e:
        reader.get_last_checkpoint()
    assert e.value.attempts == txckpt._log.publication.LOOKUP_ATTEMPTS
    assert e.value.root == reader.url and "reader lease" in str(e.value)


def test_a_tip_deleted_by_hand_still_falls_back_with_a_warning(tmp_path, txlog):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, files(1))
    txckpt.save_checkpoint(root, 2, files(2))
    import shutil

    shutil.rmtree(os.path.join(root, "checkpoint-2"))
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-1")
    assert "Falling back to step 1" in txlog.text


# ----- a root that does not exist; a checkpoint directory as the root -------------------------
def test_a_missing_root_directory_raises_file_not_found_like_transformers(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    typo = str(tmp_path / "ouptut")
    with pytest.raises(FileNotFoundError):
        hf_last(typo)
    with pytest.raises(RootNotFoundError) as e:
        txckpt.get_last_checkpoint(typo)
    assert isinstance(e.value, FileNotFoundError)
    assert e.value.root == typo and e.value.bucket is None
    assert "does not exist" in str(e.value) and "typo" in str(e.value)
    assert not os.path.exists(typo), "a lookup must not create the root"


def test_an_empty_existing_root_is_none(tmp_path):
    os.makedirs(tmp_path / "out")
    assert txckpt.get_last_checkpoint(str(tmp_path / "out")) is None


@pytest.mark.s3
def test_a_url_whose_bucket_does_not_exist_raises_root_not_found(s3_root, s3_requests):
    url, so = s3_root
    with pytest.raises(RootNotFoundError) as e:
        txckpt.get_last_checkpoint("s3://no-such-bucket-txckpt/run", storage_options=so)
    assert isinstance(e.value, FileNotFoundError)
    assert e.value.bucket == "s3://no-such-bucket-txckpt" and "bucket" in str(e.value)
    # A prefix not written yet, in a bucket that exists, is an empty root (a new run); only
    # this answer pays for the check (one HeadBucket), a lookup with a log still costs 4 GETs.
    with s3_requests.reset() as c:
        assert txckpt.get_last_checkpoint(url, storage_options=so) is None
    assert c.ops["HeadBucket"] == 1
    txckpt.save_checkpoint(url, 1, files(1), storage_options=so)
    txckpt.forget_roots()
    with s3_requests.reset() as c:
        path = txckpt.get_last_checkpoint(url, storage_options=so)
    assert dict(c.ops) == {"GetObject": 4} and step_of(path, so) == 1


def test_a_checkpoint_directory_passed_as_the_root_warns(tmp_path, txlog):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 10, files(10))
    assert txckpt.get_last_checkpoint(os.path.join(root, "checkpoint-10")) is None
    assert "checkpoint-10 is a checkpoint directory, not a root" in txlog.text
    assert f"Pass its parent, {root}" in txlog.text


# ----- the path, in transformers' form ----------------------------------------------------------
def test_the_path_has_transformers_form_for_a_relative_root(tmp_path, monkeypatch):
    from transformers.trainer_utils import get_last_checkpoint as hf_last

    monkeypatch.chdir(tmp_path)
    txckpt.save_checkpoint("out", 2, files(2))
    assert txckpt.get_last_checkpoint("out") == os.path.join("out", "checkpoint-2") == hf_last("out")
    assert txckpt.get_last_checkpoint("out/") == hf_last("out/")
    assert step_of(txckpt.get_last_checkpoint("out"), None) == 2  # and it reads, cross-checked
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(str(tmp_path / "out")) == str(tmp_path / "out" / "checkpoint-2")


@pytest.mark.parametrize(
    "kind", [pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("azure", marks=pytest.mark.azure)]
)
def test_a_missing_bucket_or_container_raises_root_not_found_on_gcs_and_azure(kind, request):
    """The drop-in contract on every bucketed store, not only S3: a missing bucket (GCS) or
    container (Azure) is RootNotFoundError, never None (which would train from scratch)."""
    url, so = request.getfixturevalue(f"{kind}_root")
    scheme = url.split("://", 1)[0]
    with pytest.raises(RootNotFoundError) as e:
        txckpt.get_last_checkpoint(f"{scheme}://no-such-bucket-txckpt/run", storage_options=so)
    assert isinstance(e.value, FileNotFoundError) and "no-such-bucket-txckpt" in (e.value.bucket or "")
    assert txckpt.get_last_checkpoint(url, storage_options=so) is None  # an unwritten prefix: empty
    txckpt.save_checkpoint(url, 1, files(1), storage_options=so)
    txckpt.forget_roots()
    assert step_of(txckpt.get_last_checkpoint(url, storage_options=so), so) == 1


# ----- a root without a log: only directories are checkpoints (protocol §9) ---------------------
def test_a_legacy_lookup_skips_a_file_named_like_a_checkpoint(any_root, root_kind, txlog):
    """transformers' get_last_checkpoint lists only directories: a regular file named
    ``checkpoint-50`` beside ``checkpoint-10/`` is not a checkpoint. On an object store a
    directory is a prefix with objects under it; a plain object named ``checkpoint-50`` is a file."""
    from txckpt._storage import open_storage

    url, so = any_root
    s = open_storage(url, so)
    s.replace("checkpoint-10/model.bin", b"weights")
    s.replace("checkpoint-50", b"not a checkpoint")
    path = txckpt.get_last_checkpoint(url, storage_options=so)
    assert path == s.full_path("checkpoint-10")
    assert "checkpoint-50" not in txlog.text
    if root_kind == "local":
        from transformers.trainer_utils import get_last_checkpoint as hf_last

        assert hf_last(url) == path
    # The first save adopts the same directories: the file is not recorded as a checkpoint.
    txckpt.forget_roots()
    root = txckpt.CheckpointRoot(url, so)
    root.adopt()
    assert [c.step for c in root.history().in_view(root.state().head)] == [10]
