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
  ``.txckpt/log``, ``.txckpt/intents`` and ``.txckpt/readers``, older than ``grace_seconds``.
* **history snapshots** (protocol §4a) older than the newest one that reads back, and damaged
  ones (a reader ignores those and reads the log).
* with a ``policy``: what the :class:`~txckpt.retention.RetentionPolicy` lets go. It runs after
  everything that needs no log entry, so on a full disk that space can hold its retire entry (as
  can ``.txckpt/reserve``, :mod:`txckpt.reserve`, which gc makes again once there is room).
* on S3: multipart uploads under the root that were never completed, older than the grace
  period and not part of a live writer's staging (when the storage backend can list them).

It also completes publication (current checkpoints get their ``checkpoint-N`` names, others
lose them). It never touches the log, a committed checkpoint that is not retired (an empty
``.txckpt/tx/<txid>`` left by publication belongs to a committed checkpoint and stays),
``.txckpt/orphans`` (listed in the report only), or an uncommitted ``.txckpt/tx/adopted-*``: no
save stages there, so it is a legacy directory publication moved aside (kept, and listed).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import log as commit_log
from . import progress
from .errors import SpecialFileError
from .publication import ORPHANS_DIR, TX_DIR
from .retention import (
    READERS_DIR,
    RetentionPolicy,
    apply_retention,
    delete_checkpoint_data,
    read_leases,
    retired_present,
)
from .reserve import ensure_reserve
from .root import INTENTS_DIR

log = logging.getLogger("txckpt")

META_DIR = ".txckpt"
#: Age past which an intent of another host, an unreadable intent or a temp file is taken for dead.
GRACE_SECONDS = 3600.0
TEMP_DIRS = (META_DIR, f"{META_DIR}/log", INTENTS_DIR, READERS_DIR, commit_log.SNAPSHOT_DIR)


@dataclass
class GcItem:
    """One thing gc removed (or would remove, or kept on purpose)."""

    kind: str  # staging | retired | policy | intent | lease | temp | upload | publish | unpublish | snapshot
    key: str  # root-relative key (an upload: its object key)
    reason: str
    bytes: int = 0
    done: bool = False  # removed (or, for publish/unpublish, renamed)
    error: str | None = None


@dataclass
class GcReport:
    root: str
    dry_run: bool
    items: list[GcItem] = field(default_factory=list)
    #: Things that look like garbage but were kept on purpose (a live writer, a reader lease).
    kept: list[GcItem] = field(default_factory=list)
    #: Directories txckpt moved aside instead of overwriting; never deleted, listed for the operator.
    orphans: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[GcItem]:
        return [i for i in self.items if i.error]

    @property
    def bytes(self) -> int:
        """Bytes reclaimed (a dry run: reclaimable); what failed or was kept does not count."""
        return sum(i.bytes for i in self.items
                   if i.kind not in ("publish", "unpublish") and (self.dry_run or i.done))

    def of(self, kind: str) -> list[GcItem]:
        return [i for i in self.items if i.kind == kind]

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "dry_run": self.dry_run, "bytes": self.bytes,
                "items": [asdict(i) for i in self.items], "kept": [asdict(i) for i in self.kept],
                "orphans": list(self.orphans), "errors": len(self.errors)}


# ----- writer liveness ---------------------------------------------------------------------------
def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: the process's start, in clock ticks since boot; None where
    unknown (no /proc, the process is gone, or its stat is hidden)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str | None:
    """This boot of this host's kernel (changes at every reboot); None where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def process_start(pid: int | None = None) -> dict[str, Any] | None:
    """Identifies one run of process ``pid`` (default: this one) on this host:
    ``{"boot_id", "ticks"}``, the kernel's boot id and the start time from /proc/<pid>/stat. A pid
    reused by another process, or the same pid after a reboot, gives another value. None where
    /proc does not tell (then writers record nothing and gc falls back to wall-clock times)."""
    boot = _boot_id()
    ticks = _start_ticks(os.getpid() if pid is None else pid)
    if boot is None or ticks is None:
        return None
    return {"boot_id": boot, "ticks": ticks}


def _process_start_time(pid: int) -> float | None:
    """Start time (epoch seconds) of a local process, from /proc; None where unknown."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _valid_start(start: Any) -> bool:
    return (isinstance(start, dict) and isinstance(start.get("boot_id"), str)
            and isinstance(start.get("ticks"), int) and not isinstance(start.get("ticks"), bool))


def pid_alive(pid: int, since: float | None = None, *, start: dict[str, Any] | None = None) -> bool:
    """Is process ``pid`` of this host alive, and the same process the caller means?

    ``start`` (a :func:`process_start` value recorded by the process itself): alive only if the
    host has not rebooted since and the pid's current start time is that one; a different one
    means the pid was reused. Without it, ``since`` (an epoch time the process wrote with its own
    clock): a process that started more than 2 s after it is taken for a reuse; this compares
    two clocks and is only the fallback for records that do not carry ``start``.
    """
    if pid <= 0:
        return False
    if _valid_start(start):
        boot = _boot_id()
        if boot is not None and boot != start["boot_id"]:
            return False  # the host rebooted since: that process is gone, whatever has its pid now
    elif pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    if _valid_start(start):
        ticks = _start_ticks(pid)
        # Unknown (stat hidden from us): it exists, so it is taken for alive.
        return ticks is None or ticks == start["ticks"]
    if since is not None:
        started = _process_start_time(pid)
        # A process that started after the intent was written reuses the pid of a dead writer.
        if started is not None and started > since + 2.0:
            return False
    return True


def intent_record(plan: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The intent a save's committer writes before its staging (docs/protocol.md, "Save" step 2):
    who writes the staging, for gc. ``process_start`` is what gc checks the writer's liveness
    with on this host; ``time`` (the writer's clock) only serves the grace period of writers on
    other hosts, and the liveness check of intents written before ``process_start`` existed."""
    record = {"txid": plan["txid"], "step": plan["step"], "lineage": plan["lineage"],
              "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
              "world_size": world_size}
    start = process_start()
    if start is not None:
        record["process_start"] = start
    return record


def write_intent(root: Any, plan: dict[str, Any], world_size: int) -> None:
    root.storage.replace(f"{INTENTS_DIR}/{plan['txid']}.json", json.dumps(intent_record(plan, world_size)).encode())


def writer_status(intent: dict[str, Any] | None, *, now: float, grace_seconds: float,
                  hostname: str | None = None) -> tuple[bool, str]:
    """(gone, why) for the writer an intent names. ``gone`` means its staging may be reclaimed."""
    if intent is None:
        return True, "no intent (the writer aborted, or crashed before or after writing one)"
    hostname = hostname or socket.gethostname()
    host, pid = intent.get("host"), intent.get("pid")
    try:
        t = float(intent.get("time"))
    except (TypeError, ValueError):
        t = 0.0
    age = now - t
    if host == hostname and isinstance(pid, int):
        start = intent.get("process_start")
        if _valid_start(start):
            if pid_alive(pid, start=start):
                return False, f"writer pid {pid} on this host is alive"
            boot = _boot_id()
            if boot is not None and boot != start["boot_id"]:
                return True, f"writer pid {pid} on this host is dead (the host rebooted since)"
            if _start_ticks(pid) is not None:
                return True, f"writer pid {pid} on this host is dead (the pid now belongs to another process)"
            return True, f"writer pid {pid} on this host is dead"
        if pid_alive(pid, since=t):
            return False, f"writer pid {pid} on this host is alive"
        return True, f"writer pid {pid} on this host is dead"
    if age > grace_seconds:
        return True, f"intent of {host}:{pid} is {age:.0f}s old (> grace {grace_seconds:.0f}s)"
    return False, f"writer {host}:{pid} on another host, intent {age:.0f}s old (< grace {grace_seconds:.0f}s)"


def read_intents(storage: Any) -> dict[str, dict[str, Any] | None]:
    """txid -> intent record (None if unreadable) for every ``.txckpt/intents/<txid>.json``."""
    out: dict[str, dict[str, Any] | None] = {}
    for name in storage.list_dir(INTENTS_DIR):
        if not name.endswith(".json"):
            continue
        txid = name[: -len(".json")]
        try:
            record = json.loads(storage.read_bytes(f"{INTENTS_DIR}/{name}"))
            out[txid] = record if isinstance(record, dict) else None
        except FileNotFoundError:
            continue
        except (ValueError, UnicodeDecodeError, SpecialFileError):  # a FIFO there: unreadable too
            out[txid] = None
    return out


def _tree_bytes(storage: Any, key: str) -> int:
    try:
        return sum(max(0, size) for _, size in storage.walk_files(key))
    except OSError:
        return 0


def _remove(report: GcReport, item: GcItem, fn, *args) -> None:
    report.items.append(item)
    if report.dry_run:
        return
    try:
        fn(*args)
        item.done = True
        progress.advance(item.bytes or 0)
    except Exception as e:  # reported, and the rest goes on
        item.error = f"{type(e).__name__}: {e}"
        log.warning("gc: could not remove %s: %s", item.key, item.error)


def _judge(storage: Any, txid: str, intents: dict[str, Any], *, now: float, grace_seconds: float,
           hostname: str) -> tuple[bool, str]:
    """(gone, why) for the writer of ``txid``: :func:`writer_status` of its intent; an
    unreadable intent counts as gone once older than the grace period."""
    if txid in intents and intents[txid] is None:
        mtime = storage.modified_time(f"{INTENTS_DIR}/{txid}.json")
        gone = mtime is not None and now - mtime > grace_seconds
        return gone, "unreadable intent " + ("older than the grace period" if gone else "(recent: kept)")
    return writer_status(intents.get(txid), now=now, grace_seconds=grace_seconds, hostname=hostname)


def reclaim_staging(root: Any, report: GcReport, history: Any, *, now: float, grace_seconds: float,
                    hostname: str, only: set[str] | None = None, measure_kept: bool = True) -> Any:
    """(a) leftover staging and (d) stale intents, by the rules of the module doc: the one
    implementation of gc and of a save's reclaim (:func:`reclaim_after_save`). ``history``: the
    log folded before this call; ``only``: judge only the staging of these txids. Returns the
    history re-read before the deletions."""
    storage = root.storage
    # List the staging first, then read the intents: a writer creates its intent before its
    # staging, so every staging listed here either has its intent in what is read next, or its
    # writer has already removed it (after committing or aborting) or never ran to completion.
    staged_now = [t for t in storage.list_dir(TX_DIR) if only is None or t in only]
    intents = read_intents(storage)
    judge = dict(now=now, grace_seconds=grace_seconds, hostname=hostname)
    candidates: list[tuple[str, str]] = []
    live: set[str] = set()
    for txid in staged_now:
        if txid in history.checkpoints:
            continue  # committed: a home (possibly an empty one, after publication); (b) did retired
        if txid.startswith("adopted-"):
            # No save stages under an adopted txid: this is a legacy directory that a publication
            # moved out of its checkpoint-N name, holding a manifest no log committed. Its bytes
            # may be all there is of a committed adopted checkpoint: never deleted (protocol §11).
            report.kept.append(GcItem("staging", f"{TX_DIR}/{txid}", "legacy checkpoint data under an "
                                      "uncommitted adopted txid (never deleted; inspect it, or move it "
                                      "back and `txckpt adopt` it)", _tree_bytes(storage, f"{TX_DIR}/{txid}")))
            continue
        gone, why = _judge(storage, txid, intents, **judge)
        if gone:
            candidates.append((txid, why))
        else:
            live.add(txid)
            report.kept.append(GcItem("staging", f"{TX_DIR}/{txid}", why,
                                      _tree_bytes(storage, f"{TX_DIR}/{txid}") if measure_kept else 0))
    # A save may have committed since the history was read (its intent disappears only after its
    # commit entry exists): read the log again before deleting anything.
    history = root.history()
    for txid, why in candidates:
        if txid in history.checkpoints:
            continue
        key = f"{TX_DIR}/{txid}"
        step = _staged_step(storage, key)
        desc = f"uncommitted staging{'' if step is None else f' of step {step}'}: {why}"
        _remove(report, GcItem("staging", key, desc, _tree_bytes(storage, key)), storage.delete_tree, key)
    staged = {t for t, _ in candidates}
    for txid in intents:
        if txid in live:
            continue
        key = f"{INTENTS_DIR}/{txid}.json"
        if txid in history.checkpoints:
            why = "its transaction committed (the writer stopped before removing it)"
        elif txid in staged:
            why = "its staging is reclaimed"
        else:
            gone, why = _judge(storage, txid, intents, **judge)
            if not gone:
                continue
        _remove(report, GcItem("intent", key, f"stale intent: {why}"), storage.delete_file, key)
    return history


def reclaim_after_save(root: Any, *, grace_seconds: float = GRACE_SECONDS) -> GcReport | None:
    """Protocol §8 step 12: a session's first commit reclaims the staging and intents of dead
    writers by :func:`reclaim_staging`'s rules, after the commit point and the publication: a
    failure here never touches the save, and a crash in the middle leaves what the next session
    (or gc) finishes. It starts from the intents (a killed save always leaves its own), so with
    none of a gone writer it costs one listing. Never raises; None if already done."""
    if root.staging_reclaimed:
        return None
    root.staging_reclaimed = True
    report = GcReport(root.url, dry_run=False)
    storage, now, hostname = root.storage, time.time(), socket.gethostname()
    try:
        intents = read_intents(storage)
        gone = {t for t in intents
                if _judge(storage, t, intents, now=now, grace_seconds=grace_seconds, hostname=hostname)[0]}
        if gone:
            reclaim_staging(root, report, root.history(snapshot=True), now=now, grace_seconds=grace_seconds,
                            hostname=hostname, only=gone, measure_kept=False)
    except Exception as e:  # the checkpoint is committed; this is housekeeping
        log.warning("the save committed, but reclaiming the staging of dead writers under %s "
                    "failed (%s: %s); `txckpt gc` reclaims it", root.url, type(e).__name__, e)
        return report
    for item in report.of("staging"):
        log.info("reclaimed %s (%d bytes) under %s: %s", item.key, item.bytes, root.url, item.reason)
    return report


# ----- the collector ---------------------------------------------------------------------------
def collect_garbage(
    root: Any,
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
        _remove(report, GcItem("lease", key, "expired reader lease"), storage.delete_file, key)

    # (e) temp files of interrupted writes.
    for d in TEMP_DIRS:
        for name in storage.list_dir(d):
            if not name.endswith(".tmp"):
                continue
            key = f"{d}/{name}"
            mtime = storage.modified_time(key)
            if mtime is None or now - mtime <= grace_seconds:
                continue  # may belong to a write in progress
            size = _file_size(storage, key)
            _remove(report, GcItem("temp", key, f"temp file of an interrupted write, {now - mtime:.0f}s old", size),
                    storage.delete_file, key)

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
    log.info("gc of %s: %d item(s), %s (%d bytes) %s in %.2fs", root.url, len(counted), progress.human(nbytes),
             nbytes, "reclaimable" if dry_run else "reclaimed", time.perf_counter() - started,
             extra={"txckpt_op": "gc", "txckpt_phase": "done", "txckpt_bytes": nbytes, "txckpt_files": len(counted)})
    return report


def _delete_retired(root: Any, report: GcReport, history: Any, leased: set[str],
                    policy_items: dict[str, GcItem]) -> None:
    """(b): delete retired checkpoints' data, except leased ones (``leased`` read after ``history``)."""
    storage = root.storage
    for c in retired_present(root, history):
        key = root.publication.locate(c.ref) or f"{TX_DIR}/{c.txid}"
        item = policy_items.get(c.txid)
        if item is None:
            item = GcItem("retired", key, f"step {c.step} of lineage {c.lineage} (txid {c.txid}) is "
                          "retired; its data was not deleted yet", _tree_bytes(storage, key))
            report.items.append(item)
        if c.txid in leased:
            report.items.remove(item)
            item.reason += "; kept for now: a reader holds a lease on it"
            report.kept.append(item)
            continue
        if report.dry_run:
            continue
        try:
            delete_checkpoint_data(root, c)
            item.done = True
            progress.advance(item.bytes or 0)
        except Exception as e:
            item.error = f"{type(e).__name__}: {e}"
            log.warning("gc: could not delete retired %s: %s", c.txid, item.error)


def _apply_policy(root: Any, report: GcReport, policy: RetentionPolicy, now: float) -> None:
    """(f): retire what the policy lets go (one entry; on a full disk in the reserve's space), then
    delete it. A failed retire is reported on the policy's items."""
    from .errors import StorageError
    from .retention import retire
    history = root.history()
    going = apply_retention(root, policy, dry_run=True, now=now)
    policy_items: dict[str, GcItem] = {}
    for info in going:
        key = root.storage.key_of(info.path) if info.path else None
        item = GcItem("policy", key or f"{TX_DIR}/{info.txid}",
                      f"retention policy lets go of step {info.step} ({info.state}, lineage "
                      f"{info.lineage}, txid {info.txid})", info.bytes)
        report.items.append(item)
        policy_items[info.txid] = item
    if report.dry_run or not going:
        return
    try:
        retired = set(retire(root, [i.txid for i in going], policy=policy,
                             decided_at=history.state.seq, now=now))
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


def _snapshots(storage: Any, report: GcReport, known_usable: int = -1) -> None:
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
        _remove(report, GcItem("snapshot", key, why), storage.delete_file, key)


def _file_size(storage: Any, key: str) -> int:
    local = storage.local_path(key)
    if local is not None:
        try:
            return os.path.getsize(local)
        except OSError:
            return 0
    return 0


def _staged_step(storage: Any, key: str) -> int | None:
    for name in storage.list_dir(key):
        if name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit():
            return int(name[len("checkpoint-"):])
    return None


def _publication(root: Any, history: Any, report: GcReport) -> None:
    """Complete publication (rename backends): the head's view holds the checkpoint-N names."""
    s = root.storage
    if not s.atomic_dir_rename:
        return
    current = history.in_view(None)
    current_ids = {c.txid for c in history.in_view(None, include_retired=True)}
    if report.dry_run:
        from .publication import manifest_txid

        for name in s.list_dir(""):
            if root.publication.naming.step_of(name) is not None:
                occupant = manifest_txid(s, name)
                if occupant and occupant in history.checkpoints and occupant not in current_ids:
                    report.items.append(GcItem("unpublish", name, f"{name} holds {occupant}, which is not "
                                               "in the current lineage: back to its home"))
    else:
        for name in root.reconcile_publication(history, publish=False):
            report.items.append(GcItem("unpublish", name, "not in the current lineage: moved back to its home",
                                       done=True))
    for c in current:
        key = root.publication.locate(c.ref)
        pub = root.publication.public_key(c.step)
        if key is None or key == pub or c.adopted:
            continue
        item = GcItem("publish", pub, f"committed step {c.step} (txid {c.txid}) was not "
                      "published (a crash after its commit, or during a fork): give it its name")
        report.items.append(item)
        if not report.dry_run:
            try:
                item.done = root.publication.publish(c.ref) == pub
            except OSError as e:
                item.error = f"{type(e).__name__}: {e}"


def _uploads(root: Any, report: GcReport, now: float, grace_seconds: float, hostname: str) -> None:
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
        initiated = u.get("initiated")
        if hasattr(initiated, "timestamp"):
            initiated = initiated.timestamp()
        try:
            age = now - float(initiated)
        except (TypeError, ValueError):
            age = float("inf")
        txid = key[len(TX_DIR) + 1:].split("/", 1)[0] if key.startswith(TX_DIR + "/") else None
        if txid is not None:
            gone, why = writer_status(intents.get(txid), now=now, grace_seconds=grace_seconds, hostname=hostname)
        else:
            gone, why = age > grace_seconds, f"started {age:.0f}s ago, outside any staging"
        if not gone:
            report.kept.append(GcItem("upload", key, f"upload {u.get('upload_id', '')}: {why}"))
            continue
        chosen.append(u)
        report.items.append(GcItem("upload", key, f"incomplete multipart upload {u.get('upload_id', '')}, "
                                   f"{age:.0f}s old: {why}", int(u.get("bytes", 0) or 0)))
    if chosen and not report.dry_run:
        items = report.items[-len(chosen):]
        try:
            storage.abort_incomplete_uploads(chosen)
            for i in items:
                i.done = True
        except Exception as e:
            for i in items:
                i.error = f"{type(e).__name__}: {e}"


__all__ = ["collect_garbage", "reclaim_staging", "reclaim_after_save", "GcReport", "GcItem", "writer_status",
           "pid_alive", "process_start", "intent_record", "write_intent", "read_intents"]
