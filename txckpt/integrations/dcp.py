"""txckpt under torch.distributed.checkpoint (DCP): a StorageWriter that commits one txckpt
checkpoint per ``dcp.save``, and a StorageReader that verifies what ``dcp.load`` reads.

Save (docs/distributed.md, "DCP"): DCP plans on every rank, gathers the plans on its coordinator,
scatters them back, lets every rank write, gathers the write results and calls ``finish`` on the
coordinator. The writer adds no collective: it works on DCP's group and in ``dcp.async_save``:

* ``prepare_local_plan`` (each rank) puts the step its writer was given in its plan;
* ``prepare_global_plan`` (coordinator) refuses ranks that ask for another step, plans the txckpt
  save as any save is planned (step conflict, lineage, fencing, intent, staging:
  :meth:`Transaction.begin_external`) and hands the staging key, step and lineage to every rank
  in its SavePlan's ``storage_data``, as FileSystemWriter hands out file prefixes;
* ``write_data`` (each rank) checks that plan against its own (step, root, lineage: a
  disagreement is reported, nothing written), then writes that rank's shards into the staging
  through txckpt's storage layer (an object store: once, to the final key), hashing each byte as
  it is written, and returns, next to DCP's WriteResults, a report of its files (name, size,
  digest, rank);
* ``finish`` (coordinator) writes DCP's ``.metadata`` and commits ONE checkpoint from the reports:
  no rank reads another rank's bytes. A rank that fails or dies before ``finish`` means nothing
  is committed (a failure the coordinator learns of aborts the staging; a dead rank's staging
  is reclaimed as any dead writer's).

Files are DCP's own format (``__<rank>_<i>.distcp`` written with DCP's item writer, a pickled
``.metadata`` of DCP's classes), so plain ``FileSystemReader`` still reads a committed local
checkpoint. The writer also records the digest of every item's byte range (in each rank's part
of the manifest; a one-rank save: ``txckpt-dcp-ranges.json``), which lets
:class:`TransactionalReader` check ranged reads (:mod:`.dcp_ranges`), and lists each tensor item
in its file's tensor index (name, dtype, shape, range, that digest, ``encoding: "torch_save"``;
protocol §3b, ``_dcp/items.py``), which ``txckpt inspect``, ``diff`` and ``load_tensors`` read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import mmap
import os
import pickle
import queue
import uuid
from typing import Any, Iterator, Mapping, cast

import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import errors
from .._base import fileio
from .._async.asyncsave import wait_for_root
from .._base.checksum import HashingWriter, digest_bytes
from .._manifest.tensor_index import Indexer
from ..errors import IntegrityError, InvalidArgumentError, ManifestError, TransactionAbortedError
from .._base.layout import intent_key
from .._manifest.manifest import FileEntry, RangeTable, kind_for_name, read_rank_part
from .._manifest.rankparts import write_part
from .._read.reader import Found, read_checked
from .._root.root import open_root
from .._tiered.tiered import TieredRoot, load_source, save_target
from .._manifest.verify import FALLBACK_HINT, wrong_checksum, verify_checkpoint_files
from ._dcp.compat import (  # torch's unpublished DCP names (DCP's own file format, item by item)
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _split_by_size_and_type,
    _StorageInfo,
    _StorageWriterTransforms,
    _write_files_from_queue,
    narrow_tensor_by_index,
)
from ._dcp.incremental import ITEMS_NAME, IncrementalShards, encode_items
from ._dcp.items import item_records, with_item_records
from ._dcp.ranges import RANGES_NAME, RangeHashingWriter, read_ranges, shard_rank

#: DCP's metadata file (the name FileSystemReader reads).
METADATA_NAME = ".metadata"
#: The fqn of the extra WriteResult that carries a rank's report to the coordinator.
_REPORT_FQN = "__txckpt_rank_report__"
VERIFY_MODES = ("full", "ranges")


@dataclasses.dataclass(frozen=True)
class _Asked:
    """What one rank's writer was asked to save, in its local SavePlan's ``storage_data``: the
    coordinator compares every rank's before it plans anything."""

    rank: int
    step: int


@dataclasses.dataclass(frozen=True)
class _Assignment:
    """What the coordinator hands each rank in its SavePlan: where to write, under what names,
    and the save it planned (each rank checks it against its own before writing a byte, as a
    Transaction's ranks check rank 0's plan)."""

    key: str
    txid: str
    prefix: str
    durable: bool
    step: int
    lineage: str
    root: str  # the coordinator's root, as it was given
    coordinator: int
    world: int = 1  # ranks in the save: from 2, each writes its part of the manifest (protocol §3a)


def _disagreement(what: str, rank: int, mine: Any, coordinator: int, planned: Any) -> TransactionAbortedError:
    return TransactionAbortedError(
        f"ranks disagree on the {what}: rank {rank} saves {what} {mine}, the coordinator (rank {coordinator}) "
        f"saves {what} {planned}. Every rank must pass the same root and step to TransactionalWriter; "
        "nothing was committed"
    )


class TransactionalWriter(StorageWriter):
    """``dcp.save(state_dict, storage_writer=TransactionalWriter(root, step))`` on every rank
    commits checkpoint ``step`` of ``root``'s current lineage, all or nothing.

    ``root``: a local directory or an fsspec URL (``storage_options`` as for
    :func:`txckpt.save_checkpoint`); ``metadata``: the manifest's user metadata. After the save,
    ``writer.path`` is the committed checkpoint on the coordinator, and on every rank the
    returned Metadata's ``storage_meta.checkpoint_id`` is it. Errors reach every rank inside
    DCP's ``CheckpointException`` (``.failures``: rank -> (error, traceback)), txckpt's typed
    error among them (StepConflictError, StaleLineageError, TransactionAbortedError...).

    ``incremental=True``: a tensor item whose bytes equal an item of one of the root's newest
    committed checkpoints is not written again; its file is shared (docs/incremental.md, "DCP").
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | TieredRoot,
        step: int,
        *,
        storage_options: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        incremental: bool = False,
    ):
        super().__init__()
        self.root, storage_options = save_target(root, step, storage_options)  # a TieredRoot: its fast tier
        self.step = step
        self.incremental = incremental
        self.storage_options = dict(storage_options or {})
        self.metadata = dict(metadata or {})
        self.path: str | None = None
        self._rank = 0
        self._coordinator = True
        self._tx: Any = None
        self._save_id = uuid.uuid4().hex

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process-based async mode ships the writer to its own process: the planned
        # transaction lives in the process that planned it.
        return {**self.__dict__, "_tx": None}

    def _open(self) -> Any:
        return open_root(self.root, self.storage_options or None)

    # ----- StorageWriter -----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.root:
            raise InvalidArgumentError(
                f"TransactionalWriter saves into its root {self.root!r}, not checkpoint_id={os.fspath(checkpoint_id)!r}: "
                "leave checkpoint_id out (the committed path is writer.path after the save)"
            )
        self.path, self._tx, self._save_id = None, None, uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "dcp.save(use_collectives=False) has no coordinator that sees every rank's files, "
                "so no single checkpoint can commit: use the default use_collectives=True"
            )
        self._coordinator = bool(is_coordinator)
        self._rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=_Asked(self._rank, self.step))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if any(not p.usable for p in plans):
            # A planner with plan caching (DefaultSavePlanner(enable_plan_caching=True)) then
            # gives every rank its cached plan of an earlier save, which names that save's staging.
            raise InvalidArgumentError(
                "the planner replays a cached plan (plan caching, e.g. DefaultSavePlanner(enable_plan_caching=True)): "
                "it would hand every rank an earlier save's staging; TransactionalWriter plans each save "
                "afresh, so use a planner without plan caching. Nothing was saved"
            )
        for p in plans:  # before any staging exists: a plan that dropped storage_data is checked in write_data
            asked = p.storage_data
            if isinstance(asked, _Asked) and asked.step != self.step:
                raise _disagreement("step", asked.rank, asked.step, self._rank, self.step)
        wait_for_root(self.root, self.storage_options or None)  # a txckpt async save commits first
        root = self._open()
        tx = root.transaction(self.step, metadata=self.metadata)
        plan = tx.begin_external(len(plans))
        self._tx = tx
        return [
            dataclasses.replace(
                p,
                storage_data=_Assignment(
                    plan.key,
                    plan.txid,
                    f"__{i}_",
                    root.durable,
                    plan.step,
                    plan.lineage,
                    self.root,
                    self._rank,
                    len(plans),
                ),
            )
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        try:
            results, report = self._write_shards(plan, planner)
        except Exception as e:
            # Reported, not raised: the coordinator then aborts the staging it created, and every
            # rank gets the same error from finish (DCP raises it on all of them).
            results, report = [], {"rank": self._rank, "error": errors.encode_error(e, rank=self._rank)}
        results.append(WriteResult(MetadataIndex(f"{_REPORT_FQN}{self._rank}"), 0, report))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_shards(self, plan: SavePlan, planner: SavePlanner) -> tuple[list[WriteResult], dict[str, Any]]:
        a = plan.storage_data
        if not isinstance(a, _Assignment):
            raise InvalidArgumentError("this SavePlan was not planned by TransactionalWriter.prepare_global_plan")
        root = self._open()
        self._check_assignment(a, root)
        storage = root.storage
        files: dict[str, Any] = {}
        ranges: dict[str, RangeTable] = {}
        batch = storage.write_batch()

        # incremental: files shared by the tensors' keys, computed beside the writes (shards.writes)
        shards = IncrementalShards(root, a.prefix, plan.items, planner, self._rank) if self.incremental else None

        @contextlib.contextmanager
        def create_stream(name: str, mode: str) -> Iterator[RangeHashingWriter]:
            whole = shards is not None and name in shards.single
            key = shards.stream_key(name) if whole and shards is not None else None
            indexer = Indexer(name)  # the file's chunk digests (protocol §3b), from the same pieces
            w = RangeHashingWriter(
                batch.open_write(f"{a.key}/{name}", durable=a.durable), whole, key, tap=indexer.update
            )
            try:
                yield w
            except BaseException:
                w.abort()
                raise
            w.tell()  # closes the last range
            w.close()  # durable (or uploaded through the batch) from here
            if key is not None and shards is not None:  # a changed tensor: its key from this write
                shards.written(name, w.key_writes)
            index = indexer.finish(w.size)
            files[name] = FileEntry(w.size, w.digest, kind_for_name(name), self._rank, index=index).to_json()
            ranges[name] = {"0": [w.size, w.digest]} if whole else w.ranges

        buckets = (
            shards.writes()
            if shards is not None
            else [(f"{a.prefix}{i}{DEFAULT_SUFFIX}", b) for i, b in enumerate(_split_by_size_and_type(1, plan.items))]
        )
        done: queue.Queue[Any] = queue.Queue()
        results: list[WriteResult] = []
        try:
            for name, bucket in buckets:
                todo: queue.Queue[Any] = queue.Queue()
                todo.put((name, name, bucket))
                _write_files_from_queue(
                    create_stream,
                    todo,
                    done,
                    planner,
                    _StorageWriterTransforms(),
                    10_000_000,
                    False,
                    1,
                    SerializationFormat.TORCH_SAVE,
                )
            batch.wait()  # every upload is complete before the report leaves this rank
            if shards is not None:  # after this rank's writes: a shared name is never opened for writing
                shared_files, shared_ranges = shards.place(a.key, a.durable, files)
                files.update(shared_files)
                ranges.update(shared_ranges)
                results += shards.results
        except BaseException:
            batch.cancel()  # nothing of this rank lands after the coordinator's abort
            raise
        finally:
            if shards is not None:
                shards.release()  # placed (or failed): a shared file is a file of its own now
        while not done.empty():
            results += done.get_nowait()
        # Each tensor item in its file's tensor index (protocol §3b), from the range digests above.
        with_item_records(files, item_records(plan.items, results, ranges))
        # In a group, this rank's part of the manifest (protocol §3a), durable in the staging, holds
        # its files and their range digests: the coordinator gets its fixed-size record instead.
        report = (
            {"rank": self._rank, "files": files, "ranges": ranges}
            if a.world < 2
            else {
                "rank": self._rank,
                "record": write_part(
                    storage, a.key, self._rank, a.txid, files, durable=a.durable, directory=False, ranges=ranges
                ).encode(),
            }
        )
        if shards is not None:
            report["items"], report["packed"] = shards.keys, shards.packed
        return results, report

    def _check_assignment(self, a: _Assignment, root: Any) -> None:
        """This rank saves what the coordinator planned: the same step, the same root (it sees
        the intent the coordinator wrote there, whatever either calls the root), and the lineage
        this process writes, if it holds one. Raised before this rank writes anything."""
        if self._coordinator:
            if self._tx is None or a.txid != self._tx.txid:
                raise InvalidArgumentError(
                    f"the plan names transaction {a.txid}, not this save's: the planner returned a plan of "
                    "an earlier save; use a planner without plan caching. Nothing was committed"
                )
            return
        if a.step != self.step:
            raise _disagreement("step", self._rank, self.step, a.coordinator, a.step)
        if not root.storage.exists(intent_key(a.txid)):
            raise TransactionAbortedError(
                f"ranks disagree on the root: rank {self._rank} saves into {self.root!r} and cannot see there the "
                f"transaction record that the coordinator (rank {a.coordinator}) wrote under {a.root!r}: the "
                "ranks do not share the checkpoint root. Every rank must pass the same root, on storage that "
                "all ranks see (see docs/distributed.md); nothing was committed"
            )
        if root.writer_lineage is not None and root.writer_lineage != a.lineage:
            raise _disagreement("lineage", self._rank, root.writer_lineage, a.coordinator, a.lineage)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tx = self._tx
        if tx is None:
            raise InvalidArgumentError("finish() without prepare_global_plan() on this writer")
        reports: list[dict[str, Any]] = []
        own_files: dict[str, Any] = {}
        storage_md: dict[Any, Any] = {}
        for wr_list in results:
            for wr in wr_list:
                if wr.index.fqn.startswith(_REPORT_FQN):
                    reports.append(dict(wr.storage_data))
                else:
                    storage_md[wr.index] = wr.storage_data
        try:
            if not any("error" in r for r in reports):
                if sorted(r["rank"] for r in reports) != list(range(tx.world_size)):
                    raise TransactionAbortedError(
                        f"the write results hold the reports of ranks {sorted(r['rank'] for r in reports)}, "
                        f"expected 0..{tx.world_size - 1}: nothing was committed"
                    )
                metadata.version = CURRENT_DCP_VERSION
                metadata.storage_data = storage_md
                metadata.storage_meta = StorageMeta(checkpoint_id=tx.final_path, save_id=self._save_id)
                own = {METADATA_NAME: pickle.dumps(metadata)}
                if any("ranges" in r for r in reports):  # one rank (format /1): no part to hold them
                    ranges = {n: rg for r in reports for n, rg in r.get("ranges", {}).items()}
                    own[RANGES_NAME] = json.dumps(ranges, sort_keys=True).encode()
                if any("items" in r for r in reports):  # an incremental save: the next one looks its keys up
                    own[ITEMS_NAME] = encode_items(
                        {n: k for r in reports for n, k in r.get("items", {}).items()},
                        [p for r in reports for p in r.get("packed", [])],
                    )
                own_files = self._write_own(tx, own)
        except Exception as e:
            reports.append({"rank": self._rank, "error": errors.encode_error(e, rank=self._rank)})
        failed, own_report = [r for r in reports if "error" in r], {"rank": self._rank, "files": own_files}
        if failed or any("record" not in r for r in reports):  # a failure aborts; one rank: format /1
            self.path = tx.commit_reports(
                failed or [{"rank": r["rank"], "files": r["files"]} for r in reports] + [own_report]
            )
        else:
            self.path = tx.commit_reports([own_report], [r["record"] for r in sorted(reports, key=lambda r: r["rank"])])
        self._tx = None
        if metadata.storage_meta is not None:
            metadata.storage_meta.checkpoint_id = self.path  # what dcp.save returns on every rank

    def _write_own(self, tx: Any, blobs: dict[str, bytes]) -> dict[str, Any]:
        root = self._open()
        out = {}
        for name, data in blobs.items():
            indexer = Indexer(name)
            with HashingWriter(
                root.storage.open_write(f"{tx.staging_key}/{name}", durable=root.durable), tap=indexer.update
            ) as w:
                w.write(data)
            out[name] = FileEntry(
                w.size, w.digest, kind_for_name(name), self._rank, index=indexer.finish(w.size)
            ).to_json()
        return out

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.root, save_id=self._save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP on its own: a txckpt save needs a step


def _need(found: Found, name: str, ranges: dict[str, RangeTable]) -> None:
    """Put ``name``'s entry in ``found.manifest.files`` (/2: its rank's part, checked, read once,
    whose range digests go into ``ranges``)."""
    manifest, rank = found.manifest, shard_rank(name)
    if name not in manifest.files and manifest.parts is not None and rank is not None and rank < manifest.parts.count:
        part = read_rank_part(found.storage, found.key, manifest, rank, found.path)
        manifest.files.update(part.files)
        ranges.update(part.ranges)
    if name not in manifest.files:
        raise IntegrityError(
            f"{found.path}/{METADATA_NAME} names {name!r}, which the manifest does not list: the "
            f"checkpoint is damaged; {FALLBACK_HINT}",
            path=f"{found.path}/{METADATA_NAME}",
        )


class TransactionalReader(StorageReader):
    """``dcp.load(state_dict, storage_reader=TransactionalReader(path))``: DCP's load (with its
    resharding) over a committed txckpt checkpoint, local or remote.

    Before any byte is used, the manifest is checked against the root's log and ``.metadata``
    against the manifest. ``verify="full"`` (default) reads every shard file a rank touches whole
    and checks its size and xxh3-128 before loading from it: the same guarantee as
    :func:`txckpt.load_checkpoint`. ``verify="ranges"`` reads only the byte ranges DCP asks for
    and checks the file's size and each range's own digest (recorded at save): it proves the
    bytes used are the bytes written, and says nothing of the bytes it did not read. Damage is
    an IntegrityError naming the file (inside DCP's CheckpointException, on every rank).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | TieredRoot,
        *,
        storage_options: Mapping[str, Any] | None = None,
        verify: str = "full",
    ):
        super().__init__()
        if verify not in VERIFY_MODES:
            raise InvalidArgumentError(f"verify={verify!r}: choose one of {VERIFY_MODES}")
        self.path, storage_options = load_source(path, storage_options)  # a TieredRoot: its newest, repaired
        self.storage_options = dict(storage_options or {})
        self.verify = verify
        self._opened: tuple[Found, Metadata, dict[str, Any]] | None = None
        self._load_id = uuid.uuid4().hex
        # Opened (manifest, .metadata and the range digests checked) here, outside DCP's
        # collectives: DCP turns any error of read_metadata into an untyped AssertionError, while
        # this raises the IntegrityError itself, on every rank that makes a reader.
        self._open()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._opened, self._load_id = None, uuid.uuid4().hex
        self._open()

    def _open(self) -> tuple[Found, Metadata, dict[str, Any]]:
        if self._opened is not None:
            return self._opened

        def attempt(found: Found) -> tuple[Found, dict[str, Any]]:
            path, manifest = found.path, found.manifest
            if METADATA_NAME not in manifest.files:
                raise ManifestError(
                    f"{path} is a txckpt checkpoint without {METADATA_NAME}: it was not "
                    "saved through DCP; load it with txckpt.load_checkpoint",
                    path=path,
                )
            names = [n for n in (METADATA_NAME, RANGES_NAME) if n in manifest.files]
            return found, verify_checkpoint_files(
                found.storage, manifest, path, names=names, keep_bytes=True, at=found.key
            )

        # whole=False: of a /2 manifest (protocol §3a) this rank reads only the parts of the ranks
        # whose shards it loads (_need), each checked against the manifest's Merkle root.
        found, blobs = read_checked(self.path, self.storage_options or None, attempt, whole=False)
        metadata = pickle.loads(bytes(blobs[METADATA_NAME]))  # verified: the bytes the save wrote
        # A one-rank save's ranges (and a /2 one's before they moved into the parts); a /2 rank's
        # come with its part (_need).
        ranges = json.loads(bytes(blobs[RANGES_NAME])) if RANGES_NAME in blobs else {}
        for name in {info.relative_path for info in (metadata.storage_data or {}).values()}:
            if found.manifest.parts is None or shard_rank(name) is None:  # a rank's shard: checked when read
                _need(found, name, ranges)
        self._opened = (found, metadata, ranges)
        return self._opened

    # No ``**kwargs``: DCP then never asks for a per-rank ``__<rank>.metadata`` (a save through
    # TransactionalWriter always has one global .metadata).
    def read_metadata(self, *args: Any) -> Metadata:
        metadata = self._open()[1]
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self._load_id
        metadata.storage_meta = meta
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        found, metadata, ranges = self._open()
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(metadata.storage_data[item.storage_index].relative_path, []).append(item)
        for name in per_file:
            _need(found, name, ranges)
        for name, reqs in sorted(per_file.items()):
            infos = [cast(_StorageInfo, metadata.storage_data[r.storage_index]) for r in reqs]
            blobs: list[Any]
            if self.verify == "full":
                blobs = self._whole(found, name, infos)
            else:
                blobs = read_ranges(found, ranges, name, infos)
            for req, blob in zip(reqs, blobs):
                _load_item(req, blob, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _whole(self, found: Found, name: str, infos: list[_StorageInfo]) -> list[memoryview]:
        path, storage, manifest, key = found.path, found.storage, found.manifest, found.file_key(name)
        entry = manifest.files[name]
        local = storage.local_path(key)
        view: memoryview | None = None
        if local is not None and entry.size > 0 and not storage.is_symlink_escape(key):
            view = _mapped(local, entry.size)  # None: missing or resized, which the check below names
        if view is None:
            data = verify_checkpoint_files(storage, manifest, path, names=[name], keep_bytes=True, at=found.key)[name]
            raw: Any = data.numpy() if isinstance(data, torch.Tensor) else data  # a uint8 buffer or bytes
            view = memoryview(raw).cast("B")
        elif digest_bytes(view) != entry.checksum:
            raise wrong_checksum(path, name)
        return [view[i.offset : i.offset + i.length] for i in infos]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly: DCP's FileSystemReader stays the default for plain paths


def _mapped(local: str, size: int) -> memoryview | None:
    """A local shard mapped into memory when it has the manifest's size (None otherwise: the
    caller's full check then names what is wrong). It is hashed in place and loaded from the
    same mapping: one pass over the page cache to hash, one copy into the tensors, as many as
    DCP's own reader makes, instead of a read into a private buffer first. A committed shard
    is never rewritten; the bytes hashed are the bytes loaded."""
    try:
        with fileio.open_regular_file(local) as f:  # a FIFO or device is refused, unread
            if os.fstat(f.fileno()).st_size != size:
                return None
            return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


class _ViewReader(io.RawIOBase):
    """A seekable reader over a buffer that copies nothing until asked: torch.load reads each
    record with ``readinto`` straight into its tensor's storage (io.BytesIO would first copy the
    whole item)."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        piece = self._view[self._pos : self._pos + len(memoryview(b).cast("B"))]
        n = len(piece)
        memoryview(b).cast("B")[:n] = piece
        self._pos += n
        return n


def _load_item(req: ReadItem, blob: Any, planner: LoadPlanner) -> None:
    """One item into its target, as FileSystemReader loads it (no stream transforms: the writer
    applies none)."""
    stream: Any = _ViewReader(memoryview(blob).cast("B")) if isinstance(blob, memoryview) else io.BytesIO(blob)
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, stream)
        return
    tensor = cast(torch.Tensor, torch.load(stream, map_location="cpu", weights_only=True))
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise IntegrityError(
            f"item {req.storage_index} holds a tensor of size {tuple(tensor.size())}, the load "
            f"expects {tuple(target.size())}: the checkpoint does not match its metadata"
        )
    target.copy_(tensor)
    planner.commit_tensor(req, target)


# Public (docs/api.md). METADATA_NAME, RANGES_NAME and VERIFY_MODES stay importable, but are internal.
__all__ = ["TransactionalWriter", "TransactionalReader"]
