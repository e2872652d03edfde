"""The commit log: ``.txckpt/log/<seq>.json``, one file per change of the root, created with a
create-if-absent write. Creating entry ``seq`` is the commit point of whatever it records; of two
writers that race for the same ``seq`` exactly one wins, and the loser re-reads and re-validates.

``.txckpt/latest`` is a hint (the seq of a recent entry) that lets a reader find the newest entry
in a constant number of reads: read the hint, read that entry, probe the next seq until it is
absent. The hint may lag or be missing; it is never trusted beyond that.

Format ``txckpt-log/2`` (written): an entry says what its action changed and carries the head
lineage's record after it, so its size depends on neither the number of lineages nor the
history; the folded state lives in snapshots (protocol §4a). ``txckpt-log/1`` entries (every
lineage's record in each) are still read: a root may hold both, /1 entries first.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable

from .._base.checksum import digest_bytes
from ..errors import ConcurrentWriterError, LogCorruptError, SpecialFileError, storage_error

# The names are layout's; entry_key & co. stay importable from here, where most callers look.
from .._base.layout import LATEST_HINT, LOG_DIR, SNAPSHOT_DIR, entry_key, snapshot_key
from .lineage import History, State
from .._storage.base import Storage

FORMAT = "txckpt-log/2"
#: The format before entries stopped carrying every lineage's record; read, never written.
FORMAT_V1 = "txckpt-log/1"
_FORMATS = (FORMAT, FORMAT_V1)
SNAPSHOT_FORMAT = "txckpt-snapshot/3"
#: Snapshots of /1 logs, which took the state from their entry; read, never written.
SNAPSHOT_FORMAT_V1 = "txckpt-snapshot/1"
#: One JSON object whose digest covers its canonical re-encoding; read, never written.
SNAPSHOT_FORMAT_V2 = "txckpt-snapshot/2"
_SNAPSHOT_FORMATS = (SNAPSHOT_FORMAT, SNAPSHOT_FORMAT_V2, SNAPSHOT_FORMAT_V1)
#: A writer that folded at least this many entries past the newest snapshot leaves a new one.
SNAPSHOT_EVERY = max(1, int(os.environ.get("TXCKPT_SNAPSHOT_EVERY", "") or 100))
#: Snapshots a reader tries (newest first) before it folds the whole log.
_SNAPSHOT_TRIES = 3

_log = logging.getLogger("txckpt")
_MAX_APPEND_ATTEMPTS = 64


def writer_identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _decode(data: bytes, seq: int) -> dict[str, Any]:
    try:
        entry = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise LogCorruptError(
            f"log entry {seq} ({entry_key(seq)}) is not valid JSON ({e}); the log was damaged "
            "outside txckpt: restore it from a backup, or move .txckpt aside to start over"
        ) from None
    if not isinstance(entry, dict) or entry.get("format") not in _FORMATS or entry.get("seq") != seq:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("format"), str)
            and entry["format"].startswith("txckpt-log/")
            and entry.get("seq") == seq
        ):
            raise LogCorruptError(
                f"log entry {entry_key(seq)} is in format {entry['format']}, which this txckpt does "
                f"not read ({', '.join(_FORMATS)}): a newer txckpt wrote it; upgrade txckpt"
            )
        raise LogCorruptError(
            f"log entry {entry_key(seq)} is not a {FORMAT} entry for seq {seq}; "
            "the log was edited or copied from another root"
        )
    claimed = entry.pop("digest", None)
    if claimed != _digest(entry):
        raise LogCorruptError(
            f"log entry {entry_key(seq)} does not match its digest: it was damaged or edited after it "
            "was written. Restore .txckpt/log from a backup; txckpt will not guess what it said"
        )
    return entry


def _digest(entry: dict[str, Any]) -> str:
    return digest_bytes(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode())


def _read_file(storage: Storage, key: str) -> bytes | None:
    """The bytes of the log file at ``key`` (an entry, a snapshot), None if absent; what stands
    there instead of a file raises :class:`_NotAFile` saying what it is. The one place a log read
    meets the storage: a local directory is ``IsADirectoryError``, a FIFO ``SpecialFileError``;
    on an object store a "directory" is a prefix, and the key reads as absent (see
    :func:`_absent`)."""
    try:
        return storage.read_bytes(key)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # .txckpt/log (or .txckpt) is a file
        raise LogCorruptError(
            f"{storage.full_path(key)} cannot be read: {storage.full_path(key.rsplit('/', 1)[0])} (or a "
            "directory above it) is a file, not a directory; the log was damaged outside txckpt. "
            "Restore .txckpt from a backup; txckpt will not guess what the log said"
        ) from None
    except IsADirectoryError:
        raise _NotAFile("directory") from None
    except SpecialFileError as e:
        raise _NotAFile(e.kind or "special file") from None


class _NotAFile(Exception):
    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def _absent(storage: Storage, seq: int) -> str:
    """How to word entry ``seq``'s absence where the log says it exists: on an object store a
    prefix of that name (objects under ``<entry>/``) is what a directory there looks like. One
    listing, on this error path only."""
    name = entry_key(seq).rsplit("/", 1)[1]
    return "a directory, not a file" if name in storage.list_subdirs(LOG_DIR) else "missing"


def _not_a_file(storage: Storage, seq: int, kind: str) -> LogCorruptError:
    return LogCorruptError(
        f"log entry {seq} ({storage.full_path(entry_key(seq))}) is a {kind}, not a file: the log was "
        "damaged outside txckpt. Restore .txckpt/log from a backup; txckpt will not guess what it said"
    )


def read_entry(storage: Storage, seq: int) -> dict[str, Any] | None:
    try:
        data = _read_file(storage, entry_key(seq))
    except _NotAFile as e:
        raise _not_a_file(storage, seq, e.kind) from None
    return None if data is None else _decode(data, seq)


def _hint(storage: Storage) -> int:
    try:
        return max(0, int(storage.read_bytes(LATEST_HINT).decode().strip() or 0))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, UnicodeDecodeError, SpecialFileError):
        return 0  # only a hint: a FIFO or a directory there reads as a missing one


#: ``read_latest``'s probe past the hinted entry, not read yet.
_UNREAD = object()


def read_latest(storage: Storage) -> dict[str, Any] | None:
    """The newest log entry, or None for a root without a log (new or legacy)."""
    seq = _hint(storage)
    ahead: Any = _UNREAD
    if storage.overlap_requests:
        # A round trip each: the probe past the hinted entry goes out beside it (on a root at
        # rest it finds nothing, so the newest entry costs two round trips, not three). Entries are
        # immutable and created in order, so reading them at once sees what reading them one
        # after the other would.
        entry, ahead = storage.run_concurrently(
            [lambda: read_entry(storage, seq), lambda: read_entry(storage, seq + 1)]
        )
        if isinstance(entry, BaseException):
            raise entry
    else:
        entry = read_entry(storage, seq)
    if entry is None:
        if seq == 0:
            return None
        # The hint is written only after its entry exists, and entries are never deleted: a
        # hint naming a missing entry means the log lost its newest entries (deleted by hand, or
        # a power cut with durability off). Going on would silently roll the root back.
        if _absent(storage, seq) != "missing":
            raise _not_a_file(storage, seq, "directory")
        seqs = list_seqs(storage)
        raise LogCorruptError(
            f"{storage.full_path(LATEST_HINT)} names log entry {seq}, which is missing (the newest "
            f"present is {seqs[-1] if seqs else 'none'}): the log lost entries. Restore .txckpt/log from "
            "a backup; if you accept losing them, delete .txckpt/latest and run `txckpt verify`"
        )
    while True:
        nxt, ahead = (read_entry(storage, seq + 1) if ahead is _UNREAD else ahead), _UNREAD
        if isinstance(nxt, BaseException):
            raise nxt
        if nxt is None:
            return entry
        seq, entry = seq + 1, nxt


def entry_state(entry: dict[str, Any] | None) -> State:
    """The state one entry carries (None: a root without a log): for a /2 entry a partial state
    holding the head's record only, enough for lookup and for validating a commit or a claim."""
    if entry is None:
        return State()
    return State.from_entry(entry)


def read_state(storage: Storage) -> State:
    return entry_state(read_latest(storage))


def _numbered(storage: Storage, directory: str) -> list[int]:
    """The seqs of the ``<seq:020d>.json`` files in ``directory`` (log entries, snapshots)."""
    seqs = []
    for name in storage.list_dir(directory):
        stem, dot, ext = name.partition(".")
        if ext == "json" and stem.isdigit() and len(stem) == 20:
            seqs.append(int(stem))
    return sorted(seqs)


def list_seqs(storage: Storage) -> list[int]:
    return _numbered(storage, LOG_DIR)


def read_history(storage: Storage, since: History | None = None, *, snapshots: bool = True) -> History:
    """Fold every entry (or every entry after ``since``) into a History.

    Without ``since``, the fold starts from the newest usable snapshot (§4a) unless
    ``snapshots`` is false; its ``entries`` then hold only the entries after that snapshot.
    """
    # The hint is read before the entries: it is written only after its entry exists, so every
    # entry it names then is in the log the fold reads. Read after the fold, a commit landing
    # between the fold's last read and the hint's would look like lost entries (it did, to
    # readers polling an S3 root while a writer committed).
    hint = _hint(storage)
    fresh = since is None  # (a snapshot read here is this call's own: extended in place)
    if fresh and snapshots:
        since = read_newest_snapshot(storage)
    if since is not None:
        return _extended(storage, since, hint, copy=not fresh)
    history = History()
    seq = history.state.seq + 1
    # A fold from entry 0 lists the log, so that a hole (an entry deleted by hand) is reported
    # rather than taken for the end of the log. A fold that extends a history or a snapshot
    # probes forward only, as a lookup does (§6): its cost follows the entries appended since,
    # not the log's length (retention folds after every save). A hole there ends the probe
    # short of the hint, which the check below reports.
    seqs = list_seqs(storage) if seq == 0 else []
    # A listing may lag on some stores; probing past it finds entries created since.
    expected = seq
    for s in seqs:
        if s != expected:
            raise LogCorruptError(
                f"log entry {expected} is missing while {s} exists; the log was damaged: "
                "restore .txckpt/log from a backup"
            )
        entry = read_entry(storage, s)
        if entry is None:
            raise LogCorruptError(
                f"log entry {s} was listed but cannot be read: it is {_absent(storage, s)}. "
                "Restore .txckpt/log from a backup"
            )
        history.apply(entry)
        expected += 1
    while True:
        entry = read_entry(storage, expected)
        if entry is None:
            break
        history.apply(entry)
        expected += 1
    _check_hint(storage, history, hint)
    return history


def _extended(storage: Storage, since: History, hint: int, *, copy: bool) -> History:
    """``since`` with the entries appended after it folded in: ``since`` itself when there are
    none; with ``copy``, a copy of it otherwise (a history handed out is never changed: another
    thread of this process may be reading it, as an async save's commit beside a lookup)."""
    new: list[dict[str, Any]] = []
    while (entry := read_entry(storage, since.state.seq + 1 + len(new))) is not None:
        new.append(entry)
    history = since.copy() if new and copy else since
    for entry in new:
        history.apply(entry)
    _check_hint(storage, history, hint)
    return history


def _check_hint(storage: Storage, history: History, hint: int) -> None:
    if hint > max(history.state.seq, 0):
        # The hint is written only after its entry exists: entries were lost. Acting on the
        # shorter history (gc, retention) could take committed checkpoints for leftovers.
        raise LogCorruptError(
            f"{storage.full_path(LATEST_HINT)} names log entry {hint}, but the log ends at "
            f"{history.state.seq}: the log lost entries. Restore .txckpt/log from a backup; nothing "
            "was changed"
        )


def append(
    storage: Storage,
    build: Callable[[State, int, float], dict[str, Any]],
    *,
    durable: bool,
    start: State | None = None,
    update_hint: bool = True,
    on_full: Callable[[], bool] | None = None,
) -> tuple[dict[str, Any], State]:
    """Append one entry; returns it, and the state it carries (:func:`entry_state`). ``build(state, seq, time)`` validates against the newest state and
    returns the entry's body: the action's fields and "state", the State after it (or its
    ``to_json()``); it may raise to refuse. The entry records that state's head record only.
    ``state`` is partial (:func:`entry_state`): what the newest entry says.

    ``update_hint=False``: the caller writes the ``latest`` hint itself (:func:`write_hint`),
    e.g. at the same time as other follow-ups of a commit.

    On a lost race the newest state is re-read and ``build`` runs again, so every validation
    holds against the state the entry is actually appended to.

    ``start``: a state this process read earlier (a save reads it when it begins). The first
    attempt appends after it without reading the log again: entries are gapless and created
    if absent, so creating entry ``start.seq + 1`` succeeds only if ``start`` is still the
    newest state; if it is not, the attempt loses the race and the loop re-reads.

    ``on_full``: called once if creating the entry fails for lack of space (ENOSPC, EDQUOT); if
    it returns True (it freed space: retention releases ``.txckpt/reserve``), the append is tried
    again from a fresh read.
    """
    entry_id = uuid.uuid4().hex
    for attempt in range(_MAX_APPEND_ATTEMPTS):
        if attempt == 0 and start is not None and start.seq >= 0:
            state = start
        else:
            state = entry_state(read_latest(storage))
        seq = state.seq + 1
        now = time.time()
        body = dict(build(state, seq, now))
        new_state = body.pop("state")
        if not isinstance(new_state, State):
            new_state = State.from_json(seq, new_state)
        entry = {
            "format": FORMAT,
            "seq": seq,
            "id": entry_id,
            "time": now,
            "writer": writer_identity(),
            **body,
            "head": new_state.head_record(),
        }
        data = (json.dumps({**entry, "digest": _digest(entry)}, sort_keys=True, indent=1) + "\n").encode()
        try:
            storage.create_exclusive(entry_key(seq), data, durable=durable)
        except FileExistsError:
            # Either another writer took this seq, or our own earlier attempt did (a retried
            # request whose first try succeeded): the entry id tells which.
            existing = read_entry(storage, seq)
            if existing is not None and existing.get("id") == entry_id:
                entry, new_state = existing, entry_state(existing)  # what it records, as written
            else:
                continue
        except OSError as e:
            if on_full is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
                freed, on_full = on_full(), None
                if freed:
                    continue
            raise storage_error(e, f"append log entry {seq}") from e
        if update_hint:
            write_hint(storage, seq)
        # The entry records new_state's head only: what a reader of the entry sees (entry_state).
        return entry, new_state.head_only()
    raise ConcurrentWriterError(
        f"could not append to the log after {_MAX_APPEND_ATTEMPTS} attempts: too many concurrent writers on one root"
    )


def write_hint(storage: Storage, seq: int) -> None:
    """Point ``latest`` at entry ``seq``, which exists. Best effort: the hint only saves reads,
    and readers probe past a stale one (§6)."""
    try:
        storage.replace(LATEST_HINT, str(seq).encode())
    except OSError:
        pass


# ----- snapshots (protocol §4a) ----------------------------------------------------------------
def list_snapshots(storage: Storage) -> list[int]:
    return _numbered(storage, SNAPSHOT_DIR)


def _parse_snapshot(data: bytes, seq: int) -> tuple[dict[str, Any] | None, str | None]:
    """(the snapshot's fields, digest checked; or None and what is wrong with it).

    A /3 snapshot is a header line, then the body: the header's ``digest`` covers its other
    fields (canonical JSON), its ``body_digest`` the body's bytes as stored, so checking a
    snapshot of 10,000 checkpoints hashes 1 MB instead of re-encoding it. /1 and /2 snapshots
    are one JSON object whose digest covers its canonical re-encoding."""
    try:
        first, _, rest = data.partition(b"\n")
        head: Any = json.loads(first) if first.startswith(b"{") else None
        if isinstance(head, dict) and head.get("format") == SNAPSHOT_FORMAT:
            if head.get("seq") != seq:
                return None, f"it is not a snapshot of entry {seq}"
            if head.pop("digest", None) != _digest(head):
                return None, "its header does not match its digest"
            if head.get("body_digest") != digest_bytes(rest):
                return None, "its body does not match its digest"
            body = json.loads(rest)
            if not isinstance(body, dict):
                return None, "its body is not a JSON object"
            return {**body, **head}, None
        if (
            isinstance(head, dict)
            and str(head.get("format")).startswith("txckpt-snapshot/")
            and head["format"] not in _SNAPSHOT_FORMATS
        ):
            return None, f"it is in format {head['format']}, which a newer txckpt writes"
        snap: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"it is not valid JSON ({e})"
    if not isinstance(snap, dict) or snap.get("format") not in _SNAPSHOT_FORMATS or snap.get("seq") != seq:
        return None, f"it is not a {SNAPSHOT_FORMAT} snapshot of entry {seq}"
    if snap.pop("digest", None) != _digest(snap):
        return None, "it does not match its digest"
    return snap, None


def read_snapshot(storage: Storage, seq: int) -> History | None:
    """The history folded through entry ``seq``, from its snapshot; None (with a warning) if the
    snapshot is damaged or bound to another entry, or if it is gone.

    Raises LogCorruptError if entry ``seq`` itself is missing or damaged: a snapshot is written
    only after its entry exists, so the log lost or garbled entries."""
    key = snapshot_key(seq)
    snap: dict[str, Any] | None = None
    try:
        data = _read_file(storage, key)
        if data is None:
            return None  # removed by gc meanwhile: the caller tries an older one
        snap, problem = _parse_snapshot(data, seq)
    except _NotAFile as e:
        problem = f"it is a {e.kind}, not a regular file"
    if snap is not None:
        entry = read_entry(storage, seq)
        if entry is None:
            raise LogCorruptError(
                f"{storage.full_path(key)} is a snapshot of log entry {seq}, which is "
                f"{_absent(storage, seq)}: the log lost entries. Restore .txckpt/log from a backup; "
                "nothing was changed"
            )
        if snap.get("entry_digest") != _digest(entry):
            problem = f"it was made from another log entry {seq} (another root, or a restored log)"
        else:
            try:
                state = _snapshot_state(seq, snap, entry)
                if state is None:
                    problem = f"its state is not the one log entry {seq} records"
                else:
                    return History.from_snapshot(state, snap)
            except (KeyError, TypeError, ValueError, AttributeError, LogCorruptError) as e:
                problem = f"it is malformed ({type(e).__name__}: {e})"
    _log.warning(
        "ignoring the history snapshot %s: %s. Snapshots only save reading the log, which "
        "is read instead; `txckpt gc` removes the bad snapshot.",
        storage.full_path(key),
        problem,
    )
    return None


def _snapshot_state(seq: int, snap: dict[str, Any], entry: dict[str, Any]) -> State | None:
    """The full state after entry ``seq`` from its snapshot; None if the two disagree.

    A /2 snapshot records the full state (a /2 entry holds the head's record only), which must
    agree with what the entry says; a /1 snapshot relies on its /1 entry, which holds it all."""
    if snap["format"] == SNAPSHOT_FORMAT_V1:
        return State.from_json(seq, entry["state"]) if "state" in entry else None
    state = State.from_json(seq, snap["state"])
    if "state" in entry:
        return state if entry["state"] == state.to_json() else None
    return state if State.from_entry(entry).head_record() == state.head_record() else None


def encode_snapshot(history: History, entry_digest: str) -> bytes:
    """The ``txckpt-snapshot/3`` bytes of ``history``: a header line, then the body (§4a)."""
    body = (
        json.dumps({"state": history.state.to_json(), **history.snapshot_body()}, separators=(",", ":")) + "\n"
    ).encode()
    head = {
        "format": SNAPSHOT_FORMAT,
        "seq": history.state.seq,
        "entry_digest": entry_digest,
        "body_digest": digest_bytes(body),
    }
    return (json.dumps({**head, "digest": _digest(head)}, sort_keys=True, separators=(",", ":")) + "\n").encode() + body


def read_newest_snapshot(storage: Storage) -> History | None:
    for seq in reversed(list_snapshots(storage)[-_SNAPSHOT_TRIES:]):
        history = read_snapshot(storage, seq)
        if history is not None:
            return history
    return None


def write_snapshot_if_due(storage: Storage, history: History, *, durable: bool) -> bool:
    """Leave a snapshot of ``history`` if it folded ``SNAPSHOT_EVERY`` entries or more past the
    newest snapshot it read or wrote. Best effort: a snapshot only saves reads, so a failure to write
    one (a read-only root, a full disk) is not an error. Returns whether one was written."""
    if not history.entries or history.state.seq - history.snapshot_seq < SNAPSHOT_EVERY:
        return False
    newest = history.entries[-1]
    seq = history.state.seq
    if newest.get("seq") != seq:  # pragma: no cover - History.apply keeps them in step
        return False
    data = encode_snapshot(history, _digest(newest))
    try:
        storage.create_exclusive(snapshot_key(seq), data, durable=durable)
    except FileExistsError:
        return False  # another process snapshotted the same entry: same content
    except OSError as e:
        _log.debug("could not write a history snapshot at entry %d: %s", seq, e)
        return False
    # Keep the newest two: a root that no gc runs on (a run that only saves, with a snapshot every
    # SNAPSHOT_EVERY commits) would otherwise hold one per 100 entries, each as large as the
    # history (~70 MB at 10,000 commits). The older of the two serves a reader that finds the
    # newest damaged; one whose snapshot goes under it falls back (§4a), as when gc removes it.
    for old in list_snapshots(storage)[:-2]:
        try:
            storage.delete_file(snapshot_key(old))
        except OSError:
            break
    return True
