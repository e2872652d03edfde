"""Intent records, writer liveness, and the reclaim of dead writers' staging.

A save's committer writes ``.txckpt/intents/<txid>.json`` (:func:`write_intent`) before it
creates its staging, and an adopter ``intents/adopt-<L>.<session>.json`` (docs/protocol.md §8
step 2, §9). Whether the writer an intent names is gone (:func:`writer_status`) decides whether
its staging may be reclaimed: by ``txckpt gc`` (:mod:`txckpt._maintenance.gc`, a maintenance tool above the
save path) and by a session's first save after its commit (:func:`reclaim_after_save`), which
both apply :func:`reclaim_staging`'s rules. This module sits below both, so the save path never
imports garbage collection.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from .._base import progress
from ..errors import SpecialFileError
from .._base.layout import ADOPTED_TXID_PREFIX, INTENTS_DIR, TX_DIR, intent_key, parse_checkpoint_name
from .._log.publication import Root
from .._storage.base import Storage
from .._base.saveplan import SavePlan

log = logging.getLogger("txckpt")

#: Age past which an intent of another host, an unreadable intent or a temp file is taken for dead.
GRACE_SECONDS = 3600.0


@dataclass
class GcItem:
    """One thing gc removed (or would remove, or kept on purpose)."""

    kind: str  # staging | retired | policy | intent | lease | temp | upload | publish | unpublish | snapshot
    key: str  # root-relative key (an upload: its object key)
    reason: str
    bytes: int = 0  # what removing it frees (a removed item: freed); a kept item: its size
    done: bool = False  # removed (or, for publish/unpublish, renamed)
    error: str | None = None
    held: int = 0  # bytes of its files that stay: other names (a live checkpoint's hard links) hold them


@dataclass
class GcReport:
    root: str
    dry_run: bool
    items: list[GcItem] = field(default_factory=list)
    #: Things that look like garbage but were kept on purpose (a live writer, a reader lease).
    kept: list[GcItem] = field(default_factory=list)
    #: Directories txckpt moved aside instead of overwriting; never deleted, listed for the operator.
    orphans: list[str] = field(default_factory=list)
    # measure()'s ledger, by file identity (Storage.file_links): the links a dry run has not
    # removed yet, and the size of the files measured as held by links outside what was collected.
    _links_left: dict[Any, int] = field(default_factory=dict, repr=False)
    _held: dict[Any, int] = field(default_factory=dict, repr=False)

    def measure(self, storage: Storage, key: str) -> tuple[int, int]:
        """(bytes that removing ``key`` frees, bytes of its files that other names still hold),
        each file counted once: call it for each thing collected just before it is removed (a
        dry run: in the order it would be). A file frees its size only with its last link, so
        an incremental root's retired checkpoint whose files live checkpoints share frees
        little; two collected items sharing a file free it once, with the second."""
        names: dict[Any, list[int]] = {}  # identity -> [size, links, names of it under key]
        for identity, size, links in storage.file_links(key):
            names.setdefault(identity, [size, links, 0])[2] += 1
        freed = held = 0
        for identity, (size, links, here) in names.items():
            # A real run reads each file's links as they are now (earlier removals already
            # dropped theirs); a dry run removes nothing, so it counts down what it would.
            left = (self._links_left.get(identity, links) if self.dry_run else links) - here
            if self.dry_run:
                self._links_left[identity] = left
            if left <= 0:
                freed += size
                self._held.pop(identity, None)
            else:
                held += size
                self._held[identity] = size
        return freed, held

    @property
    def held(self) -> int:
        """Bytes of what gc collected (a dry run: would collect) that stay on disk, held by the
        links of what it keeps (a live checkpoint sharing the file); each file once."""
        return sum(self._held.values())

    @property
    def errors(self) -> list[GcItem]:
        return [i for i in self.items if i.error]

    @property
    def bytes(self) -> int:
        """Bytes reclaimed (a dry run: reclaimable); what failed or was kept does not count."""
        return sum(i.bytes for i in self.items if i.kind not in ("publish", "unpublish") and (self.dry_run or i.done))

    def of(self, kind: str) -> list[GcItem]:
        return [i for i in self.items if i.kind == kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "dry_run": self.dry_run,
            "bytes": self.bytes,
            "held_bytes": self.held,
            "items": [asdict(i) for i in self.items],
            "kept": [asdict(i) for i in self.kept],
            "orphans": list(self.orphans),
            "errors": len(self.errors),
        }


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


def _valid_start(start: Any) -> TypeGuard[dict[str, Any]]:
    return (
        isinstance(start, dict)
        and isinstance(start.get("boot_id"), str)
        and isinstance(start.get("ticks"), int)
        and not isinstance(start.get("ticks"), bool)
    )


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


def intent_record(save: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The intent a save's committer writes before its staging (docs/protocol.md, "Save" step 2):
    who writes the staging, for gc. ``process_start`` is what gc checks the writer's liveness
    with on this host; ``time`` (the writer's clock) only serves the grace period of writers on
    other hosts, and the liveness check of intents written before ``process_start`` existed.
    ``save``: which save it is, as JSON: a :meth:`SavePlan.to_json`, or an adoption's."""
    record = {
        "txid": save["txid"],
        "step": save["step"],
        "lineage": save["lineage"],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "world_size": world_size,
    }
    start = process_start()
    if start is not None:
        record["process_start"] = start
    return record


def write_intent(root: Root, plan: SavePlan, world_size: int) -> None:
    root.storage.replace(intent_key(plan.txid), json.dumps(intent_record(plan.to_json(), world_size)).encode())


def writer_status(
    intent: dict[str, Any] | None, *, now: float, grace_seconds: float, hostname: str | None = None
) -> tuple[bool, str]:
    """(gone, why) for the writer an intent names. ``gone`` means its staging may be reclaimed."""
    if intent is None:
        return True, "no intent (the writer aborted, or crashed before or after writing one)"
    hostname = hostname or socket.gethostname()
    host, pid = intent.get("host"), intent.get("pid")
    try:
        t = float(intent["time"])
    except (KeyError, TypeError, ValueError):
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


def read_intents(storage: Storage) -> dict[str, dict[str, Any] | None]:
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


def tree_bytes(storage: Storage, key: str) -> int:
    try:
        return sum(max(0, size) for _, size in storage.walk_files(key))
    except OSError:
        return 0


def remove_item(report: GcReport, item: GcItem, fn, *args) -> None:
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


def _judge(
    storage: Storage, txid: str, intents: dict[str, Any], *, now: float, grace_seconds: float, hostname: str
) -> tuple[bool, str]:
    """(gone, why) for the writer of ``txid``: :func:`writer_status` of its intent; an
    unreadable intent counts as gone once older than the grace period."""
    if txid in intents and intents[txid] is None:
        mtime = storage.modified_time(intent_key(txid))
        gone = mtime is not None and now - mtime > grace_seconds
        return gone, "unreadable intent " + ("older than the grace period" if gone else "(recent: kept)")
    return writer_status(intents.get(txid), now=now, grace_seconds=grace_seconds, hostname=hostname)


def reclaim_staging(
    root: Root,
    report: GcReport,
    history: Any,
    *,
    now: float,
    grace_seconds: float,
    hostname: str,
    only: set[str] | None = None,
    measure_kept: bool = True,
) -> Any:
    """(a) leftover staging and (d) stale intents, by the rules of txckpt._maintenance.gc's module doc: the one
    implementation of gc and of a save's reclaim (:func:`reclaim_after_save`). ``history``: the
    log folded before this call; ``only``: judge only the staging of these txids. Returns the
    history re-read before the deletions."""
    storage = root.storage
    # List the staging first, then read the intents: a writer creates its intent before its
    # staging, so every staging listed here either has its intent in what is read next, or its
    # writer has already removed it (after committing or aborting) or never ran to completion.
    staged_now = [t for t in storage.list_dir(TX_DIR) if only is None or t in only]
    intents = read_intents(storage)
    candidates: list[tuple[str, str]] = []
    live: set[str] = set()
    for txid in staged_now:
        if txid in history.checkpoints:
            continue  # committed: a home (possibly an empty one, after publication); (b) did retired
        if txid.startswith(ADOPTED_TXID_PREFIX):
            # No save stages under an adopted txid: this is a legacy directory that a publication
            # moved out of its checkpoint-N name, holding a manifest no log committed. Its bytes
            # may be all there is of a committed adopted checkpoint: never deleted (protocol §11).
            report.kept.append(
                GcItem(
                    "staging",
                    f"{TX_DIR}/{txid}",
                    "legacy checkpoint data under an "
                    "uncommitted adopted txid (never deleted; inspect it, or move it "
                    "back and `txckpt adopt` it)",
                    tree_bytes(storage, f"{TX_DIR}/{txid}"),
                )
            )
            continue
        gone, why = _judge(storage, txid, intents, now=now, grace_seconds=grace_seconds, hostname=hostname)
        if gone:
            candidates.append((txid, why))
        else:
            live.add(txid)
            report.kept.append(
                GcItem(
                    "staging", f"{TX_DIR}/{txid}", why, tree_bytes(storage, f"{TX_DIR}/{txid}") if measure_kept else 0
                )
            )
    # A save may have committed since the history was read (its intent disappears only after its
    # commit entry exists): read the log again before deleting anything.
    history = root.history()
    for txid, why in candidates:
        if txid in history.checkpoints:
            continue
        key = f"{TX_DIR}/{txid}"
        step = staged_step(storage, key)
        desc = f"uncommitted staging{'' if step is None else f' of step {step}'}: {why}"
        freed, held = report.measure(storage, key)
        remove_item(report, GcItem("staging", key, desc, freed, held=held), storage.delete_tree, key)
    staged = {t for t, _ in candidates}
    for txid in intents:
        if txid in live:
            continue
        key = intent_key(txid)
        if txid in history.checkpoints:
            why = "its transaction committed (the writer stopped before removing it)"
        elif txid in staged:
            why = "its staging is reclaimed"
        else:
            gone, why = _judge(storage, txid, intents, now=now, grace_seconds=grace_seconds, hostname=hostname)
            if not gone:
                continue
        remove_item(report, GcItem("intent", key, f"stale intent: {why}"), storage.delete_file, key)
    return history


def reclaim_after_save(root: Root, *, grace_seconds: float = GRACE_SECONDS) -> GcReport | None:
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
        gone = {
            t
            for t in intents
            if _judge(storage, t, intents, now=now, grace_seconds=grace_seconds, hostname=hostname)[0]
        }
        if gone:
            reclaim_staging(
                root,
                report,
                root.history(snapshot=True),
                now=now,
                grace_seconds=grace_seconds,
                hostname=hostname,
                only=gone,
                measure_kept=False,
            )
    except Exception as e:  # the checkpoint is committed; this is housekeeping
        log.warning(
            "the save committed, but reclaiming the staging of dead writers under %s "
            "failed (%s: %s); `txckpt gc` reclaims it",
            root.url,
            type(e).__name__,
            e,
        )
        return report
    for item in report.of("staging"):
        # WARNING: it means a process died in the middle of a save (a crash the user may not know
        # of, a preempted job); once per crash, never per save.
        log.warning(
            "reclaimed %s (%d bytes) under %s, the %s. That save never committed; nothing committed was lost",
            item.key,
            item.bytes,
            root.url,
            item.reason,
        )
    return report


def staged_step(storage: Storage, key: str) -> int | None:
    for name in storage.list_dir(key):
        step = parse_checkpoint_name(name)
        if step is not None:
            return step
    return None


__all__ = [
    "GRACE_SECONDS",
    "GcItem",
    "GcReport",
    "process_start",
    "pid_alive",
    "intent_record",
    "write_intent",
    "writer_status",
    "read_intents",
    "reclaim_staging",
    "reclaim_after_save",
]
