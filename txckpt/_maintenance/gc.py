"""Garbage collection: reclaim what crashes and retention leave behind, never committed data.

:func:`collect_garbage` finds, and unless ``dry_run`` removes:

* **staging**: ``.txckpt/tx/<txid>`` whose txid the log has not committed and whose writer is
  gone: its intent is missing, or the intent's host is this host and its pid is dead (or now
  belongs to another process: its start time in /proc is not the one the writer recorded in the
  intent, or the host rebooted since), or the intent is older than ``grace_seconds`` (writers on
  other hosts, whose liveness cannot be checked). A live writer's staging is never
  removed. Before anything is deleted the log is read again, so a save that committed meanwhile
  is kept. A session's first save applies the same rules after its commit (:func:`reclaim_after_save`).
* **retired**: data of checkpoints a ``retire`` entry names (phase two of a deletion that a
  crash interrupted), except those under a live reader lease.
* **intents** whose transaction committed or whose writer is gone; expired reader leases.
* **temp files** (``*.tmp``) of interrupted create-if-absent and replace writes in ``.txckpt/``,
  ``.txckpt/log``, ``.txckpt/intents``, ``.txckpt/readers`` and ``.txckpt/snapshots``, and a
  crashed adoption's temp file of a manifest in a ``checkpoint-N``, older than ``grace_seconds``.
* **history snapshots** (protocol §4a) older than the newest one that reads back, and damaged
  ones (a reader ignores those and reads the log).
* with a ``policy``: what the :class:`~txckpt._maintenance.retention.RetentionPolicy` lets go. It runs after
  everything that needs no log entry, so on a full disk that space can hold its retire entry (as
  can ``.txckpt/reserve``, :mod:`txckpt._base.reserve`, which gc makes again once there is room).
* on S3: multipart uploads under the root that were never completed, older than the grace
  period and not part of a live writer's staging (when the storage backend can list them).

Each item's ``bytes`` is what removing it frees (:meth:`GcReport.measure`): a file whose other
links (a live checkpoint's, on an incremental root) outlive the removal frees nothing, and is
counted in ``held`` instead; each file is counted once. The storage says which files share
their bytes (``Storage.file_links``); gc never asks which backend it has.

It also completes publication (current checkpoints get their ``checkpoint-N`` names, others
lose them). It never touches the log, a committed checkpoint that is not retired (an empty
``.txckpt/tx/<txid>`` left by publication belongs to a committed checkpoint and stays),
``.txckpt/orphans`` (listed in the report only), or an uncommitted ``.txckpt/tx/adopted-*``: no
save stages there, so it is a legacy directory publication moved aside (kept, and listed).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from .._log import log as commit_log
from .._base import progress
from ..errors import StorageError

# Intents, writer liveness and the staging reclaim are the save path's (txckpt/_maintenance/intents.py); gc
# uses them and keeps the names importable from here.
from .intents import (
    GRACE_SECONDS,
    GcItem,
    GcReport,
    remove_item,
    tree_bytes,
    read_intents,
    reclaim_staging,
    writer_status,
)
from .._base.layout import ORPHANS_DIR, TEMP_DIRS, TX_DIR, is_manifest_temp
from .._log.publication import Root
from .._storage.base import Storage
from .retention import (
    RetentionPolicy,
    apply_retention,
    delete_checkpoint_data,
    read_leases,
    retire,
    retired_present,
)
from .._base.reserve import ensure_reserve

log = logging.getLogger("txckpt")


# ----- the collector ---------------------------------------------------------------------------
def collect_garbage(
    root: Root,
    *,
    dry_run: bool = False,
    grace_seconds: float = GRACE_SECONDS,
    policy: RetentionPolicy | None = None,
    now: float | None = None,
) -> GcReport:
    """List and (unless ``dry_run``) remove the root's garbage; see the module doc."""
    storage = root.storage
    now = time.time() if now is None else now
    report = GcReport(root.url, dry_run)
    started = time.perf_counter()

    history = root.history(snapshot=not dry_run)
    _publication(root, history, report)

    # What needs no log entry goes first: on a full disk it may make room for the retire entry
    # of (f). (b) data of checkpoints retired earlier (a crash between retention's two phases).
    leased, expired_leases = read_leases(storage, now)
    _delete_retired(root, report, history, leased, {})

    # (a) leftover staging and (d) stale intents.
    hostname = socket.gethostname()
    history = reclaim_staging(root, report, history, now=now, grace_seconds=grace_seconds, hostname=hostname)
    for key in expired_leases:
        remove_item(report, GcItem("lease", key, "expired reader lease"), storage.delete_file, key)

    # (e) temp files of interrupted writes.
    for key in _temp_files(root):
        mtime = storage.modified_time(key)
        if mtime is None or now - mtime <= grace_seconds:
            continue  # may belong to a write in progress
        size = _file_size(storage, key)
        remove_item(
            report,
            GcItem("temp", key, f"temp file of an interrupted write, {now - mtime:.0f}s old", size),
            storage.delete_file,
            key,
        )

    # (h) history snapshots: every one older than the newest usable one, and damaged ones.
    _snapshots(storage, report, known_usable=history.snapshot_seq)

    # (f) the retention policy: its retire entry is phase one; then (b) deletes what it retired.
    if policy is not None:
        _apply_policy(root, report, policy, now)

    # (g) incomplete multipart uploads (S3).
    _uploads(root, report, now, grace_seconds, hostname)

    # Orphans are the operator's to inspect: listed, never touched.
    report.orphans = [f"{ORPHANS_DIR}/{n}" for n in storage.list_dir(ORPHANS_DIR)]
    if not dry_run:
        ensure_reserve(storage, durable=root.durable)  # made again once there is room for it
    counted = [i for i in report.items if i.kind not in ("publish", "unpublish") and (dry_run or i.done)]
    nbytes = sum(i.bytes for i in counted)
    log.info(
        "gc of %s: %d item(s), %s (%d bytes) %s%s in %.2fs",
        root.url,
        len(counted),
        progress.human(nbytes),
        nbytes,
        "reclaimable" if dry_run else "reclaimed",
        f"; {progress.human(report.held)} ({report.held} bytes) of their files still held by live checkpoints' links"
        if report.held
        else "",
        time.perf_counter() - started,
        extra={"txckpt_op": "gc", "txckpt_phase": "done", "txckpt_bytes": nbytes, "txckpt_files": len(counted)},
    )
    return report


def _delete_retired(
    root: Root, report: GcReport, history: Any, leased: set[str], policy_items: dict[str, GcItem]
) -> None:
    """(b): delete retired checkpoints' data, except leased ones (``leased`` read after ``history``)."""
    storage = root.storage
    for c in retired_present(root, history):
        key = root.publication.locate(c.ref) or f"{TX_DIR}/{c.txid}"
        item = policy_items.get(c.txid)
        if c.txid in leased:
            if item is None:
                item = GcItem(
                    "retired",
                    key,
                    f"step {c.step} of lineage {c.lineage} (txid {c.txid}) is retired; its data was not deleted yet",
                    tree_bytes(storage, key),
                )
            else:
                report.items.remove(item)
            item.reason += "; kept for now: a reader holds a lease on it"
            report.kept.append(item)
            continue
        # Measured just before it goes (a policy's items too: the ones deleted before it may
        # have dropped the other links of its shared files).
        freed, held = report.measure(storage, key)
        if item is None:
            item = GcItem(
                "retired",
                key,
                f"step {c.step} of lineage {c.lineage} (txid {c.txid}) is retired; its data was not deleted yet",
                freed,
                held=held,
            )
            report.items.append(item)
        else:
            item.bytes, item.held = freed, held
        if report.dry_run:
            continue
        try:
            delete_checkpoint_data(root, c)
            item.done = True
            progress.advance(item.bytes or 0)
        except Exception as e:
            item.error = f"{type(e).__name__}: {e}"
            log.warning("gc: could not delete retired %s: %s", c.txid, item.error)


def _apply_policy(root: Root, report: GcReport, policy: RetentionPolicy, now: float) -> None:
    """(f): retire what the policy lets go (one entry; on a full disk in the reserve's space), then
    delete it. A failed retire is reported on the policy's items."""
    history = root.history()
    going = apply_retention(root, policy, dry_run=True, now=now)
    policy_items: dict[str, GcItem] = {}
    for info in going:
        key = (root.storage.key_of(info.path) if info.path else None) or f"{TX_DIR}/{info.txid}"
        # A dry run measures here, in the order it would delete; a real run when it deletes.
        freed, held = report.measure(root.storage, key) if report.dry_run else (info.bytes, 0)
        item = GcItem(
            "policy",
            key,
            f"retention policy lets go of step {info.step} ({info.state}, lineage {info.lineage}, txid {info.txid})",
            freed,
            held=held,
        )
        report.items.append(item)
        policy_items[info.txid] = item
    if report.dry_run or not going:
        return
    try:
        retired = set(retire(root, [i.txid for i in going], policy=policy, decided_at=history.state.seq, now=now))
    except StorageError as e:  # a full disk without a reserve: the message says what to do
        for item in policy_items.values():
            item.error = f"{type(e).__name__}: {e}"
        log.warning("gc: %s", e)
        return
    for txid, item in policy_items.items():
        if txid not in retired:
            item.reason += " (kept after all: the log moved and the policy now keeps it)"
    history = root.history()
    leased, _ = read_leases(root.storage, now)  # after the retired set (protocol §11)
    _delete_retired(root, report, history, leased, policy_items)


def _temp_files(root: Root) -> list[str]:
    """Keys of the temp files that interrupted writes may leave (age not judged here): ``*.tmp``
    in the ``.txckpt`` directories of ``TEMP_DIRS``, and a crashed adoption's temp file of its
    manifest inside a ``checkpoint-N`` (``checkpoint-N/[.]txckpt-manifest.json.<rnd>.tmp``, §9)."""
    storage = root.storage
    keys = [f"{d}/{name}" for d in TEMP_DIRS for name in storage.list_dir(d) if name.endswith(".tmp")]
    step_of = root.publication.naming.step_of
    for top in storage.list_dir(""):
        if step_of(top) is None:
            continue
        try:
            keys += [f"{top}/{name}" for name in storage.list_dir(top) if is_manifest_temp(name)]
        except OSError:  # unreadable: nothing gc could remove in it either
            continue
    return keys


def _snapshots(storage: Storage, report: GcReport, known_usable: int = -1) -> None:
    """``known_usable``: the seq of a snapshot this process's fold just read or wrote (it needs
    no second read); -1 if none."""
    newest_usable = None
    for seq in reversed(commit_log.list_snapshots(storage)):
        key = commit_log.snapshot_key(seq)
        if newest_usable is None:
            # A snapshot appears whole (one create-if-absent write), so one that does not
            # read back is damaged, not in progress. read_snapshot warns about it.
            if seq == known_usable or commit_log.read_snapshot(storage, seq) is not None:
                newest_usable = seq
                continue
            why = "damaged or foreign history snapshot (the log is read instead)"
        else:
            why = f"history snapshot superseded by the one at entry {newest_usable}"
        remove_item(report, GcItem("snapshot", key, why), storage.delete_file, key)


def _file_size(storage: Storage, key: str) -> int:
    local = storage.local_path(key)
    if local is not None:
        try:
            return os.path.getsize(local)
        except OSError:
            return 0
    return 0


def _publication(root: Root, history: Any, report: GcReport) -> None:
    """Complete publication: the head's view holds the public names (rename backends; the
    publication of an object store has none to complete)."""
    current = history.in_view(None)
    current_ids = {c.txid for c in history.in_view(None, include_retired=True)}
    if report.dry_run:
        for name, occupant in root.publication.misplaced(current_ids, set(history.checkpoints)):
            report.items.append(
                GcItem(
                    "unpublish", name, f"{name} holds {occupant}, which is not in the current lineage: back to its home"
                )
            )
    else:
        # Every name in the root, not only those a fork moved (§7): after a crash between a
        # fork's entry and its renames, this is what completes them.
        for name in root.publication.unpublish(current_ids, set(history.checkpoints)):
            report.items.append(
                GcItem("unpublish", name, "not in the current lineage: moved back to its home", done=True)
            )
    for r in root.publication.unpublished([c.ref for c in current if not c.adopted]):
        pub = root.publication.public_key(r.step)
        item = GcItem(
            "publish",
            pub,
            f"committed step {r.step} (txid {r.txid}) was not "
            "published (a crash after its commit, or during a fork): give it its name",
        )
        report.items.append(item)
        if not report.dry_run:
            try:
                item.done = root.publication.publish(r) == pub
            except OSError as e:
                item.error = f"{type(e).__name__}: {e}"


def _uploads(root: Root, report: GcReport, now: float, grace_seconds: float, hostname: str) -> None:
    """Incomplete uploads under the root (the storage contract's ``list_incomplete_uploads``:
    S3 multipart uploads; none on other backends) whose writer is gone: aborted."""
    storage = root.storage
    try:
        uploads = list(storage.list_incomplete_uploads())
    except Exception as e:
        report.items.append(GcItem("upload", "", "could not list incomplete uploads", error=f"{type(e).__name__}: {e}"))
        return
    if not uploads:
        return
    # Intents are read after the listing: a writer writes its intent before its first upload.
    intents = read_intents(root.storage)
    chosen = []
    for u in uploads:
        key = str(u.get("key", ""))
        initiated: Any = u.get("initiated")  # a datetime (S3), a number, or absent
        if hasattr(initiated, "timestamp"):
            initiated = initiated.timestamp()
        try:
            age = now - float(initiated)
        except (TypeError, ValueError):
            age = float("inf")
        txid = key[len(TX_DIR) + 1 :].split("/", 1)[0] if key.startswith(TX_DIR + "/") else None
        if txid is not None:
            gone, why = writer_status(intents.get(txid), now=now, grace_seconds=grace_seconds, hostname=hostname)
        else:
            gone, why = age > grace_seconds, f"started {age:.0f}s ago, outside any staging"
        if not gone:
            report.kept.append(GcItem("upload", key, f"upload {u.get('upload_id', '')}: {why}"))
            continue
        chosen.append(u)
        report.items.append(
            GcItem(
                "upload",
                key,
                f"incomplete multipart upload {u.get('upload_id', '')}, {age:.0f}s old: {why}",
                int(u.get("bytes", 0) or 0),
            )
        )
    if chosen and not report.dry_run:
        items = report.items[-len(chosen) :]
        try:
            storage.abort_incomplete_uploads(chosen)
            for i in items:
                i.done = True
        except Exception as e:
            for i in items:
                i.error = f"{type(e).__name__}: {e}"


# GcReport/GcItem are intents' (a save's reclaim reports with them too); gc's callers take them here.
__all__ = ["collect_garbage"]
