"""One checkpoint save as a transaction: staging -> per-rank writes -> gather -> manifest ->
commit -> publish. Protocol: docs/protocol.md, "Save".

Every rank of an initialised torch.distributed group enters the same transaction; rank 0 (the
committer) validates the save, picks the staging name and broadcasts it, gathers every rank's
file list, writes the manifest, appends the commit entry and publishes; the outcome is broadcast
so that every rank returns the same path or raises the same error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from typing import Any, BinaryIO, Callable, Iterable, Literal, Mapping

from .. import errors
from .._manifest import parts
from .._base.checksum import HashingWriter
from .._manifest.claims import check_claims, claimed_names, hash_claimed
from .._base.coordination import Coordinator, GatheredElsewhere, current_coordinator, decide_on_rank0
from ..errors import CheckpointNotFoundError, InvalidArgumentError, TransactionAbortedError, storage_error
from .._log.commit import append_commit, clear_intent, committed_path, finish_commit, plan_save
from .._manifest.tensor_index import CHUNK_SIZE, SAFETENSORS_SUFFIX, FileIndex, Indexer
from .incremental import Sharing, Source
from .grouped import is_tensor_dict, save_grouped
from .._maintenance.intents import reclaim_after_save, write_intent
from .._base.layout import checkpoint_name, intent_key
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import (
    FileEntry,
    Manifest,
    agree_files,
    check_file_name,
    check_new_file_name,
    check_step,
    kind_for_name,
    written_entries,
)
from .._base.progress import Timer
from .._manifest.rankparts import parts_manifest, staged_files, write_part
from .._log.publication import Root
from .._base.saveplan import SavePlan
from .._base.fileio import makedirs_durable, walk_relative
from .serialization import write_object
from .txnames import TxNames

log = logging.getLogger("txckpt")


class Transaction:
    """Use through ``txckpt.transaction(root, step)``::

        with txckpt.transaction(root, step) as tx:
            tx.save("model.safetensors", model.state_dict())
            with tx.open("extra.bin", "wb") as f:
                f.write(blob)
            model.config.save_pretrained(tx.directory)
        print(tx.path)  # the committed checkpoint

    Files written through ``open``/``save`` are hashed while they are written. Files that other
    code writes into ``tx.directory`` are hashed (and, with durability on, fsynced) at commit, by
    rank 0; or by the rank that wrote them, before its report, if it claims them
    (:meth:`claim_files`).
    """

    def __init__(
        self,
        root: Root,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        coordinator: Coordinator | None = None,
        local_dir: str | os.PathLike | None = None,
        incremental: bool = False,
        txid: str | None = None,
    ):
        # Validated before anything formats it (a step of 5,000 digits cannot even be printed).
        step = check_step(step)
        self._root = root
        self._scratch_parent = None if local_dir is None else os.fspath(local_dir)
        self.step = step
        self.metadata = dict(metadata or {})
        self._timeout = timeout
        self._coord = coordinator
        self.path: str | None = None
        self.txid: str | None = None
        self._plan: SavePlan | None = None
        # name -> (size, checksum, kind, prefixes), once closed (or, shared, once decided)
        self._written: dict[str, tuple[int, str, str, tuple[str, ...], FileIndex | None]] = {}
        # incremental=True: the files tx.save finds unchanged, shared at this rank's end
        self._sharing = Sharing(root) if incremental else None
        self._open_writers: set[str] = set()
        self._names = TxNames()  # directories of the names, and marks of files tx.directory may rewrite
        self._writes: Any = None  # the storage's WriteBatch of this rank's staging files
        self._local_dir: str | None = None
        self._temp_root: str | None = None
        self._entered = False
        self._done = False
        self._timer: Timer | None = None  # phases logged at DEBUG, the summary at INFO (rank 0)
        self._alone = False  # a world of one rank (set by __enter__): no collective to make
        self._committer = False  # this rank commits (set by __enter__)
        self._manifest: Manifest | None = None
        self._totals: tuple[int, int] | None = None  # (bytes, files) of the committed checkpoint
        self._claims: list[str] = []  # names and globs of tx.directory files this rank hashes itself
        self._replica_txid = txid  # a tiered root's replica commits under its source's txid

    # ----- properties --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._coord.rank if self._coord else 0

    @property
    def world_size(self) -> int:
        return self._coord.world_size if self._coord else 1

    @property
    def staging_key(self) -> str:
        self._require_open()
        assert self._plan is not None  # _require_open checked it
        return self._plan.key

    @property
    def directory(self) -> str:
        """A local directory that code such as ``save_pretrained`` can write into.

        On a local root it is the staging directory itself; on a remote root it is a local
        scratch directory (under ``local_dir``, else $TXCKPT_STAGING_DIR, else the system temp
        directory) whose files are uploaded (once, hashed on the way) at commit. Its name
        is ``checkpoint-<step>``, so its parent (:attr:`output_root`) can stand in for a Trainer
        output_dir.
        """
        self._require_open()
        if self._local_dir is None:
            storage = self._root.storage
            local = storage.local_path(self.staging_key)
            if local is None:
                base = self._scratch_parent or os.environ.get("TXCKPT_STAGING_DIR") or None
                if base:
                    os.makedirs(base, exist_ok=True)
                self._temp_root = tempfile.mkdtemp(prefix=f"txckpt-{self.txid}-", dir=base)
                local = os.path.join(self._temp_root, checkpoint_name(self.step))
            os.makedirs(local, exist_ok=True)
            self._local_dir = local
            for name in self._written:
                if self._sharing is None or name not in self._sharing.pending:  # not there yet
                    self._mark(name)
        return self._local_dir

    @property
    def output_root(self) -> str:
        """The parent of :attr:`directory` (``directory == output_root/checkpoint-<step>``)."""
        return os.path.dirname(self.directory)

    @property
    def final_path(self) -> str:
        """Where the checkpoint will be once committed (``path`` after a clean exit): its
        public name (``checkpoint-<step>``, or the root's naming) on local disks, its staging key on
        object stores."""
        self._require_open()
        return self._root.storage.full_path(self._root.publication.final_key(self.step, self.staging_key))

    def _require_open(self) -> None:
        if not self._entered or self._done or self._plan is None:
            raise InvalidArgumentError("use the transaction inside its `with` block")

    # ----- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Transaction":
        if self._entered:
            raise InvalidArgumentError("a transaction can be entered once")
        self._entered = True
        self._timer = Timer("save", f"step {self.step}")
        if self._coord is None:
            self._coord = current_coordinator(self._timeout)
        # Asked once: alone, this rank commits and every collective returns what it was given.
        self._alone = self._coord.world_size == 1
        self._committer = self._alone or self._coord.is_committer
        plan = (
            self._plan_save()
            if self._alone
            else decide_on_rank0(self._plan_save, phase="save plan", coordinator=self._coord)
        )
        self._plan = plan
        self.txid = plan.txid
        if self._timer.phases:
            self._timer.phase("staging")
        self._writes = self._root.storage.write_batch()
        try:
            if plan.step != self.step:
                raise TransactionAbortedError(
                    f"ranks disagree on the step: this rank saves {self.step}, rank 0 saves {plan.step}"
                )
            if not self._committer:
                self._check_shared_root(plan)
        except BaseException as e:
            # The other ranks are inside the transaction already and will gather at its end:
            # take part in the gather and the outcome broadcast with this error, so that every
            # rank learns it and none waits for the timeout (or meets a mismatched collective).
            self._done = True
            self._outcome({"rank": self.rank, "error": errors.encode_error(e, rank=self.rank)})
            raise
        return self

    def _outcome(self, report: dict[str, Any]) -> dict[str, Any]:
        """Every rank: the committer's outcome of the save, given this rank's report. In a group
        (protocol §3a) each rank writes its part and sends a fixed-size record; only if one
        failed do the ranks send their reports (the errors) as objects, the rare path."""
        if self._alone:
            return self._commit_or_abort([report])
        assert self._coord is not None  # set by __enter__
        outcome = self._broadcast(self._gather_parts(report))
        if outcome.get("gather_errors"):
            reports = self._coord.gather(report if "error" in report else None)
            outcome = self._broadcast(self._commit_or_abort([r for r in reports or [] if r]) if self._committer else {})
        return outcome

    def _gather_parts(self, report: dict[str, Any]) -> dict[str, Any]:
        """This rank's part written and its record gathered; the committer's outcome (to
        broadcast), ``{"gather_errors": True}`` if a rank failed; {} on other ranks."""
        assert self._coord is not None
        record = report.pop("record", None) or parts.failed_record()  # written by _rank_report
        records = self._coord.gather_records(record.encode())
        if not self._committer:
            return {}
        decoded = [parts.Record.decode(r, rank) for rank, r in enumerate(records or [])]
        if any(r.failed for r in decoded):
            return {"gather_errors": True}
        return self._commit_or_abort([], decoded)

    def _broadcast(self, outcome: dict[str, Any]) -> dict[str, Any]:  # the committer's, on every rank
        assert self._coord is not None
        return outcome if self._alone else self._coord.broadcast(outcome)

    def _plan_save(self) -> SavePlan:
        """Rank 0: validate the save, record its intent, create its staging; the plan."""
        assert self._coord is not None
        try:
            try:
                plan = plan_save(self._root, self.step, txid=self._replica_txid)
                # The intent carries this process's start time from /proc, which is what gc
                # checks a local writer's liveness with (not this process's clock).
                write_intent(self._root, plan, self._coord.world_size)
                self._create_staging(plan)
                return plan
            except OSError as os_error:
                raise storage_error(os_error, f"start the save of step {self.step}") from os_error
        except errors.TxckptError:
            raise
        except Exception as e:
            if self._coord.world_size == 1:
                raise
            # In a group a failed start is a TransactionAbortedError on every rank (rank 0 too).
            raise TransactionAbortedError(str(e)) from e

    def _create_staging(self, plan: SavePlan) -> None:
        """The committer creates the shared staging directory (rename backends) before the plan
        goes out, so no two ranks race to create it (and no rank's file operations depend on
        which rank got there first). If it cannot, the intent just written goes too."""
        staging = self._root.storage.local_path(plan.key)
        if staging is None:
            return
        try:  # in a group, with the directory of the ranks' manifest parts (protocol §3a)
            assert self._coord is not None
            makedirs_durable(
                staging if self._coord.world_size < 2 else os.path.join(staging, parts.PARTS_DIR), self._root.durable
            )
        except BaseException:
            self._abort(plan)
            raise

    def _check_shared_root(self, plan: SavePlan) -> None:
        """A rank other than the committer must see the intent that rank 0 wrote before it
        broadcast the plan: ranks that do not share the root (node-local disks) would
        otherwise commit a manifest naming files the committer cannot see."""
        if not self._root.storage.exists(intent_key(plan.txid)):
            raise TransactionAbortedError(
                f"rank {self.rank} cannot see the transaction record that rank 0 just wrote under "
                f"{self._root.url}: the ranks do not share the checkpoint root (a node-local disk, or "
                "a different root path per rank). Every rank must pass the same root on storage that "
                "all ranks see (a shared filesystem or an object store URL); see docs/distributed.md"
            )

    def open(self, name: str, mode: str = "wb") -> BinaryIO:
        """A new file of the checkpoint, hashed while written. Only mode "wb"."""
        self._require_open()
        if mode != "wb":
            raise InvalidArgumentError(f"transaction files open with mode 'wb' only, not {mode!r}")
        check_new_file_name(name)
        if name in self._written or name in self._open_writers:
            raise InvalidArgumentError(f"{name!r} was already written in this transaction")
        self._names.add(name, lambda n: n in self._written or n in self._open_writers, self._local_dir)
        try:
            sink = self._writes.open_write(f"{self.staging_key}/{name}", durable=self._root.durable)
        except BaseException as e:
            self._rebuild_names()  # the name was not opened after all
            if isinstance(e, (IsADirectoryError, NotADirectoryError, FileExistsError)):  # another rank's 'a' or 'a/'?
                TxNames.raise_conflict_in_staging(name, self._root.storage.local_path(self.staging_key), e)
            if isinstance(e, OSError):
                raise storage_error(e, f"create {name!r} in the staging directory") from e
            raise
        self._open_writers.add(name)
        return _TrackedWriter(self, name, sink)  # type: ignore[return-value]

    def _rebuild_names(self) -> None:  # after a name was dropped: a writer aborted, a file not created
        self._names.rebuild(list(self._written) + sorted(self._open_writers))

    def check_not_rewritten(self) -> None:
        """Raise InvalidArgumentError if a file written through ``open``/``save`` was written
        again through ``tx.directory`` since: the check the commit makes, for a caller (the
        Trainer integration) that wants to refuse before the commit, with its own advice."""
        self._require_open()
        self._names.check_not_rewritten(lambda n: self._root.storage.local_path(f"{self.staging_key}/{n}"))

    def claim_files(self, names_or_globs: str | Iterable[str]) -> None:
        """Claim files this rank's code writes straight into :attr:`directory` (DeepSpeed's
        ``zero_pp_rank_{r}_*``, DCP's ``__{r}_*.distcp``), by name or glob (:mod:`txckpt._manifest.claims`),
        before or after writing them: this rank hashes (and fsyncs) them at its end of the
        transaction and they are recorded with its rank; rank 0 does not read them back. A file
        two ranks claim is refused like a name two ranks write."""
        self._require_open()
        self._claims.extend(check_claims(names_or_globs))

    def save(self, name: str, obj: Any) -> None:
        """Write ``obj`` as file ``name`` by the rules of :func:`txckpt.save_checkpoint`; with
        ``incremental=True``, share it instead if a committed file has its bytes; and a
        ``.safetensors`` dict of tensors is grouped (txckpt._save.grouped): the tensors unchanged
        since the checkpoint this save follows go in files of their own, which are shared."""
        # One tensor has one layout: the check of the dict's values is made for two or more.
        if (
            self._sharing is not None
            and isinstance(obj, Mapping)
            and len(obj) > 1
            and name.lower().endswith(".safetensors")
            and is_tensor_dict(obj)
        ):
            save_grouped(self, name, obj)
            return
        if self._sharing is not None and self._share(name, lambda sharing: sharing.unchanged(name, obj)):
            return
        f: Any = self.open(name, "wb")  # a _TrackedWriter (kind, abort, sink_error), typed as a BinaryIO
        try:
            kind = write_object(name, obj, f)
            f.kind = kind
            f.close()
        except Exception as e:
            f.abort()
            # A serializer may turn the storage's error into its own: torch.save's zip writer
            # reports a failed write (ENOSPC) as RuntimeError "[enforce fail at
            # inline_container.cc] unexpected pos". The writer remembers what its sink raised.
            cause = f.sink_error if f.sink_error is not None else e
            if not isinstance(cause, OSError):
                raise
            err = storage_error(cause, f"write {name!r}")
            if err is e:
                raise
            raise err from e
        except BaseException:
            f.abort()
            raise

    def share_copy(self, name: str, entry: FileEntry) -> bool:
        """Share ``name`` if a committed file has the size and checksum ``entry`` gives (leased,
        once trusted); False: the caller writes it. For a tiered root's replica
        (txckpt._tiered.tiered: ``entry`` is its source's record) and a grouped save's file
        proven equal to a committed one from its tensor digests (txckpt._save.grouped)."""
        return self._sharing is not None and self._share(
            name, lambda sharing: (s, entry.kind) if (s := sharing.matching(entry.size, entry.checksum)) else None
        )

    def _share(self, name: str, find: Callable[[Sharing], tuple[Source, str] | None]) -> bool:
        """The incremental path (txckpt._save.incremental): True if ``find`` names the committed file
        (and the kind) that ``name`` shares."""
        assert self._sharing is not None
        self._require_open()
        check_new_file_name(name)
        if name in self._written or name in self._open_writers:
            raise InvalidArgumentError(f"{name!r} was already written in this transaction")
        found = find(self._sharing)
        if found is None:
            return False
        self._names.add(name, lambda n: n in self._written or n in self._open_writers, self._local_dir)
        source, kind = found
        self._sharing.pending[name] = source  # placed at this rank's end
        self._written[name] = (
            source.entry.size,
            source.entry.checksum,
            kind,
            source.entry.prefixes,
            source.entry.index,
        )
        return True

    def _finished_file(
        self, name: str, size: int, digest: str, kind: str, prefixes: list[str], index: FileIndex | None
    ) -> None:
        self._open_writers.discard(name)
        self._written[name] = (size, digest, kind, tuple(prefixes), index)
        if self._local_dir is not None:
            self._mark(name)

    def _mark(self, name: str) -> None:
        if not self._temp_root:  # on a remote root tx.directory is a scratch directory of its own
            self._names.mark(name, self._root.storage.local_path(f"{self.staging_key}/{name}"))

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        timer = self._timer
        assert self._coord is not None and timer is not None  # both set by __enter__
        outcome: dict[str, Any] = {}
        try:
            report = self._rank_report(exc)
            if "files" in report and timer.phases:
                timer.phase(
                    "data" if self.world_size == 1 else f"data (rank {self.rank})",
                    sum(f.size for f in report["files"].values()),
                )
            outcome = self._outcome(report)
            if "path" in outcome and self._committer and not self._root.shared.staging_reclaimed:
                # Committed, and every rank has its path: now the session's first save reclaims
                # what dead writers left (§8 step 12), off the other ranks' way.
                reclaim_after_save(self._root)
        finally:
            self._done = True
            if self._temp_root:
                shutil.rmtree(self._temp_root, ignore_errors=True)
            if self._sharing is not None:
                # A group's manifest is assembled from parts; only a lone rank's is remembered.
                committed = self._manifest if self._alone and "path" in outcome else None
                self._sharing.release(committed)
        if exc is not None:
            return False  # this rank's own exception propagates
        if "error" in outcome:
            raise errors.decode_error(outcome["error"])
        self.path = outcome["path"]
        return False

    # ----- ranks that another library gathers (txckpt.integrations.dcp) -----------------------
    def begin_external(self, world_size: int) -> SavePlan:
        """``__enter__`` for the committer of ``world_size`` ranks gathered by another library
        (DCP's collectives): validation, intent and staging, no collective of txckpt's. Then
        :meth:`commit_reports` with every rank's report; a failure here leaves nothing."""
        self._entered, self._timer = True, Timer("save", f"step {self.step}")
        self._coord = GatheredElsewhere(world_size)
        self._plan = self._plan_save()
        self.txid = self._plan.txid
        return self._plan

    def commit_reports(self, reports: list[dict[str, Any]], records: list[bytes] | None = None) -> str:
        """Commit from every rank's report (``{"rank", "files"}``, or ``{"rank", "error"}``:
        then abort) and return the path, or raise the error for every rank. ``records``: each
        rank's fixed-size record of the part it wrote (:func:`txckpt._manifest.rankparts.write_part`),
        in rank order; the reports then hold only the committer's own files, or errors."""
        self._require_open()
        self._done = True
        decoded = None if records is None else [parts.Record.decode(r, i) for i, r in enumerate(records)]
        outcome = self._commit_or_abort(reports, decoded)
        if "error" in outcome:
            raise errors.decode_error(outcome["error"])
        self.path = path = outcome["path"]
        reclaim_after_save(self._root)  # as __exit__: after the commit, never raises
        return path

    def _rank_report(self, exc: BaseException | None) -> dict[str, Any]:
        # Every upload of this rank has finished (or failed) before the report leaves: rank 0
        # checks the staged files, or deletes the staging, right after the gather, and no upload
        # may land after either.
        if exc is not None:
            self._cancel_writes()
            return {"rank": self.rank, "error": errors.encode_error(exc, rank=self.rank)}
        try:
            if self._open_writers:
                raise InvalidArgumentError(f"files still open at commit: {sorted(self._open_writers)}")
            if self._local_dir is not None:  # files are marked once tx.directory is out (_mark)
                self._names.check_not_rewritten(lambda n: self._root.storage.local_path(f"{self.staging_key}/{n}"))
            sharing = self._sharing
            files = written_entries(self._written, self.rank)
            if self._temp_root and self._local_dir is not None:
                # Remote root: upload what other code wrote into the local scratch directory
                # (this rank's own: every file there is hashed and recorded as this rank's).
                local = list(walk_relative(self._local_dir))
                claimed_names([n for n, _ in local] + list(files), self._claims, set())  # claimed names exist
                for name, size in local:
                    if name in files:
                        raise InvalidArgumentError(f"{name!r} written both through tx.open and tx.directory")
                    check_file_name(name)
                    path = os.path.join(self._local_dir, name)
                    source = sharing.unchanged_file(path) if sharing is not None else None
                    if source is not None:  # a committed file's bytes: shared below, not uploaded
                        sharing.pending[name] = source  # type: ignore[union-attr]
                        files[name] = dataclasses.replace(source.entry, kind=kind_for_name(name), rank=self.rank)
                        continue
                    indexer = Indexer(name)  # the tensor index, from the upload's own read
                    size, digest = self._writes.upload_file(
                        path, f"{self.staging_key}/{name}", durable=self._root.durable, tap=indexer.update
                    )
                    files[name] = FileEntry(size, digest, kind_for_name(name), self.rank, index=indexer.finish(size))
            elif self._claims:  # shared staging: this rank hashes what it claims; rank 0 only stats it
                files.update(
                    hash_claimed(
                        self._root.storage,
                        self.staging_key,
                        self._claims,
                        set(files),
                        self._root.durable,
                        self.rank,
                        sharing.relink if sharing is not None else None,
                    )
                )
            if sharing is not None:  # no code writes into the staging any more
                sharing.place(self.staging_key, self._root.durable, files)
            record = None
            try:
                if not self._alone:  # this rank's part (protocol §3a), durable with its files in one wait
                    assert self._plan is not None
                    record = write_part(
                        self._root.storage,
                        self.staging_key,
                        self.rank,
                        self._plan.txid,
                        {n: e.to_json() for n, e in files.items()},  # the part's wire form
                        durable=self._root.durable,
                        open_write=self._writes.open_write,
                        directory=self._local_dir is not None and not self._temp_root,
                    )
                self._writes.wait()
            except OSError as e:
                raise storage_error(
                    e,
                    "upload the checkpoint's files"
                    + (" and this rank's part of the manifest" if not self._alone else ""),
                ) from e
            return {"rank": self.rank, "files": files, **({"record": record} if record else {})}
        except Exception as e:
            self._cancel_writes()
            return {"rank": self.rank, "error": errors.encode_error(e, rank=self.rank)}

    def _cancel_writes(self) -> None:
        if self._writes is None:
            return
        try:
            self._writes.cancel()
        except Exception:  # pragma: no cover - cancel ignores upload failures by contract
            log.warning("waiting for the uploads of %s failed", self.txid, exc_info=True)

    def _commit_or_abort(
        self, reports: list[dict[str, Any]], records: list[parts.Record] | None = None
    ) -> dict[str, Any]:
        plan = self._plan
        assert plan is not None
        failed = [r for r in reports if "error" in r]
        if not failed:
            try:
                path = self._commit(reports, records)
                assert self._totals is not None and self._timer is not None  # _commit set them; __enter__ the timer
                self._timer.done("saved", *self._totals, path)
                return {"path": path}
            except Exception as e:
                if isinstance(e, OSError):
                    e = storage_error(e, f"commit checkpoint step {plan.step}")
                try:
                    committed = committed_path(self._root, plan)
                except CheckpointNotFoundError as lost:
                    # Committed, and its data is gone: nothing is left to delete; say so.
                    log.error("%s", lost)
                    try:
                        clear_intent(self._root, plan.txid)
                    except OSError:
                        pass  # gc removes the intent of a committed txid
                    return {"error": errors.encode_error(lost, rank=self.rank)}
                if committed is not None:  # the commit point was passed: never delete
                    log.warning("checkpoint %s committed, but finishing it failed: %s", plan.txid, e)
                    return {"path": committed}
                failed = [{"rank": self.rank, "error": errors.encode_error(e, rank=self.rank)}]
                log.debug("commit of %s failed", plan.txid, exc_info=True)
        self._abort()
        first = failed[0]
        err = first["error"]
        if first["rank"] != self.rank or self.world_size > 1:
            err = errors.reworded(err, f"rank {first['rank']}: {err['message']}")
        if not errors.is_txckpt_error(err):
            err = errors.encode_error(
                TransactionAbortedError(f"checkpoint step {plan.step} was not committed: {err['message']}"),
                rank=self.rank,
            )
        return {"error": err}

    def _commit(self, reports: list[dict[str, Any]], records: list[parts.Record] | None = None) -> str:
        """Rank 0's commit of every rank's report (or, in a group, record: protocol §3a),
        protocol §8 steps 6-11a, in this order; the log's phases are the commit room's
        (txckpt/_log/commit.py). Raises before step 9: nothing is committed (the caller deletes
        the staging); after it the checkpoint is committed."""
        plan, root, timer = self._plan, self._root, self._timer
        assert plan is not None and timer is not None  # both set by __enter__
        relink = self._sharing.relink if self._sharing is not None else None
        structures = None
        if records is not None:  # steps 6-8 on the parts: txckpt/_manifest/rankparts.py
            own = agree_files(reports) if reports else {}
            manifest, structures = parts_manifest(
                root.storage,
                plan,
                records,
                own,
                previous=root.shared.part_structures,
                durable=root.durable,
                relink=relink,
                created=time.time(),
                metadata=self.metadata,
            )
        else:
            # Step 6: one rank per name. Step 7: every reported file still there with its size;
            # the files other code wrote into the staging hashed; all durable but its entries.
            files = staged_files(root.storage, plan.key, agree_files(reports), root.durable, relink)
            # Step 8: the manifest, create-if-absent and durable (fsyncing the staging directory).
            manifest = Manifest(
                txid=plan.txid,
                lineage=plan.lineage,
                step=plan.step,
                parent=plan.parent,
                files=files,
                created=time.time(),
                world_size=self.world_size,
                metadata=self.metadata,
            )
            root.storage.create_exclusive(f"{plan.key}/{MANIFEST_NAME}", manifest.encode(), durable=root.durable)
        self._manifest = manifest
        if timer.phases:
            timer.phase("manifest")
        # Step 9, the commit point: the commit entry, after the state step 1 planned against.
        entry = append_commit(root, manifest, plan.writer)
        root.shared.part_structures = structures  # the next save's fast path (protocol §3a)
        if timer.phases:
            timer.phase("commit")
        self._totals = (entry["checkpoint"]["bytes"], entry["checkpoint"]["files"])  # as the log records them
        # Steps 10-11: the hint, the publication, the intent's deletion (overlapped remotely),
        # then 11a, a history snapshot every SNAPSHOT_EVERY entries (best effort).
        path = finish_commit(root, manifest, entry, plan.key)
        if timer.phases:
            timer.phase("publish")
        return path

    def _abort(self, plan: SavePlan | None = None) -> None:
        """Delete the staging and the intent of ``plan`` (default: this transaction's)."""
        plan = plan or self._plan
        if plan is None:
            return
        storage = self._root.storage
        try:
            storage.delete_tree(plan.key.rsplit("/", 1)[0])
            clear_intent(self._root, plan.txid)
        except OSError:
            log.warning("could not remove staging %s; `txckpt gc` will", plan.key, exc_info=True)


class _TrackedWriter(HashingWriter):
    def __init__(self, tx: Transaction, name: str, sink: BinaryIO):
        # The chunk digests and, for a safetensors file, the tensor index (protocol §3b) are
        # taken from the same pieces the writer hashes; other files need no indexer.
        self._indexer = Indexer(name, chunks=False) if name.lower().endswith(SAFETENSORS_SUFFIX) else None
        super().__init__(
            sink,
            prefixes=tx._sharing is not None,
            chunk_size=CHUNK_SIZE,
            tap=None if self._indexer is None else self._indexer.update,
        )
        self._tx = tx
        self._name = name
        self.kind = "bytes"  # raw bytes through tx.open; tx.save records what it serialised

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        index = self._index()
        self._tx._finished_file(self._name, self.size, self.digest, self.kind, self.prefixes, index)

    def _index(self) -> FileIndex | None:
        """What the manifest records of the file besides its size and digest (protocol §3b)."""
        if self._indexer is None:
            return FileIndex(CHUNK_SIZE, self.chunks)
        return self._indexer.finish(self.size, self.chunks)

    def abort(self) -> None:
        if self.closed:
            return
        super().abort()
        self._tx._open_writers.discard(self._name)
        self._tx._rebuild_names()


def save_files(root: Root, step: int, files: Mapping[str, Any], **kwargs: Any) -> str:
    """Save ``files`` (name -> object, as save_checkpoint) as ``step`` in one Transaction(**kwargs)."""
    with Transaction(root, step, **kwargs) as tx:
        for name, obj in files.items():
            tx.save(name, obj)
    assert tx.path is not None
    return tx.path
