"""Lineages: which checkpoints belong to the run being continued.

A lineage is a chain of checkpoints. It starts at a root (no parent), at a checkpoint outside the
root ("external"), or by forking from a committed checkpoint (a rollback). The root's *head* is
the current lineage. A checkpoint is *in* a lineage (Iceberg's "is ancestor of") when it was
committed by the lineage itself, or is in the parent lineage's view at or before the fork step.
Everything else is *abandoned* from the head's point of view: kept, never overwritten, but never
returned by ``get_last_checkpoint``.

This module is pure: it knows nothing of bytes or storage. Every log entry carries the head
lineage's record after it (``txckpt-log/2``; ``/1`` entries carried every lineage's), so the
newest entry alone answers "what is the newest checkpoint of the current lineage" and validates a
commit or a claim: :meth:`State.from_entry` gives that *partial* state. :class:`History` folds
every entry (or a snapshot and the entries after it) into the full state and every checkpoint.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Collection, Iterable, NamedTuple

from ..errors import (
    CheckpointNotFoundError,
    ConcurrentWriterError,
    InvalidArgumentError,
    LineageNotFoundError,
    LogCorruptError,
    StaleLineageError,
    StepConflictError,
)
from .._base.naming import DEFAULT as DEFAULT_NAMING, Naming
from .._base.refs import Parent, Ref, parent_from_json, parent_to_json, same_ref


def new_lineage_id(taken: Iterable[str] = ()) -> str:
    taken = set(taken)
    while True:
        lid = secrets.token_hex(4)
        if lid not in taken:
            return lid


@dataclass
class LineageInfo:
    id: str
    #: The checkpoint the lineage starts from.
    parent: Parent
    created_seq: int
    created_time: float
    reason: str  # "root", "fork", "external", "adopt"
    #: The newest checkpoint in the lineage's view (after a fork: the fork point), or None.
    tip: Ref | None = None
    #: The writer session that holds the lineage (the last to create, resume or claim it): only
    #: it may commit, which fences a zombie job off from its restart.
    writer: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "parent": parent_to_json(self.parent),
            "created_seq": self.created_seq,
            "created_time": self.created_time,
            "reason": self.reason,
            "tip": None if self.tip is None else self.tip.to_json(),
            "writer": self.writer,
        }

    @classmethod
    def from_json(cls, lid: str, d: dict[str, Any]) -> "LineageInfo":
        tip = d.get("tip")
        return cls(
            lid,
            parent_from_json(d.get("parent")),
            int(d["created_seq"]),
            float(d["created_time"]),
            str(d["reason"]),
            Ref.from_json(tip) if tip else None,
            d.get("writer"),
        )

    @property
    def parent_ref(self) -> Ref | None:
        p = self.parent
        return p if isinstance(p, Ref) else None


def _record(seq: int, rec: Any) -> LineageInfo:
    try:
        return LineageInfo.from_json(str(rec["id"]), rec)
    except (KeyError, TypeError, ValueError) as e:
        raise LogCorruptError(f"log entry {seq} has a malformed head lineage record ({e})") from None


@dataclass
class State:
    """The compact state after log entry ``seq``: the head and every lineage's tip.

    ``partial``: read from one ``txckpt-log/2`` entry, so ``lineages`` holds the head's record
    only (what lookup, a commit's and a claim's validation need). Questions about other lineages
    (fork points, ancestry, ids in use) take ``History.state``, which is always complete."""

    seq: int = -1
    head: str | None = None
    lineages: dict[str, LineageInfo] = field(default_factory=dict)
    partial: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"head": self.head, "lineages": {k: v.to_json() for k, v in sorted(self.lineages.items())}}

    @classmethod
    def from_json(cls, seq: int, d: dict[str, Any]) -> "State":
        try:
            lineages = {k: LineageInfo.from_json(k, v) for k, v in d["lineages"].items()}
            head = d.get("head")
        except (KeyError, TypeError, ValueError) as e:
            raise LogCorruptError(f"log entry {seq} has a malformed state ({e})") from None
        if head is not None and head not in lineages:
            raise LogCorruptError(
                f"log entry {seq} names head lineage {head!r}, which it does not define; "
                "the log was edited by hand: restore .txckpt/log from a backup"
            )
        return cls(seq, head, lineages)

    def copy(self) -> "State":  # (each lineage's record copied: the after_* methods change one)
        return State(self.seq, self.head, {k: replace(v) for k, v in sorted(self.lineages.items())}, self.partial)

    # ----- log entries (txckpt-log/1 and /2) -----------------------------------------------------
    def head_record(self) -> dict[str, Any] | None:
        """What a ``txckpt-log/2`` entry records of this state: the head lineage's record."""
        info = self.head_info
        return None if info is None else {"id": info.id, **info.to_json()}

    def head_only(self) -> "State":
        """What :meth:`from_entry` reads back from the ``/2`` entry that records this state (its
        head's record only, partial), without the round trip through JSON: the state a
        writer notes after appending its own entry."""
        info = self.head_info
        if info is None:
            return State(self.seq, partial=True)
        return State(self.seq, info.id, {info.id: replace(info)}, partial=True)

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> "State":
        """The state after one decoded entry: complete for a ``/1`` entry (it carries every
        lineage), partial for a ``/2`` one (the head's record only)."""
        seq = int(entry["seq"])
        if "state" in entry:  # txckpt-log/1
            return cls.from_json(seq, entry["state"])
        rec = entry.get("head")
        if rec is None:
            return cls(seq, partial=True)
        info = _record(seq, rec)
        return cls(seq, info.id, {info.id: info}, partial=True)

    def after_entry(self, entry: dict[str, Any]) -> "State":
        """The full state after ``entry``, this being the full state before it. A ``/2`` entry
        changes one lineage only (every action changes the head's record, or creates a new head),
        so its record replaces that lineage's and the others carry over unchanged."""
        seq = int(entry["seq"])
        if "state" in entry:  # txckpt-log/1: the whole state
            return State.from_json(seq, entry["state"])
        rec = entry.get("head")
        if rec is None:
            raise LogCorruptError(f"log entry {seq} has no head lineage record")
        info = _record(seq, rec)
        creates = entry.get("action") in ("fork", "adopt")
        if creates and (info.id in self.lineages or info.created_seq != seq or entry.get("lineage") != info.id):
            raise LogCorruptError(
                f"log entry {seq} ({entry.get('action')}) does not create lineage {info.id} as it says; "
                "the log was edited by hand: restore .txckpt/log from a backup"
            )
        if not creates and info.id not in self.lineages:
            raise LogCorruptError(
                f"log entry {seq} names head lineage {info.id!r}, which no earlier entry created; "
                "the log was edited by hand: restore .txckpt/log from a backup"
            )
        lineages = dict(self.lineages)  # LineageInfo objects of a folded state are never mutated
        lineages[info.id] = info
        return State(seq, info.id, lineages)

    @property
    def head_info(self) -> LineageInfo | None:
        return self.lineages.get(self.head) if self.head else None

    @property
    def head_tip(self) -> Ref | None:
        info = self.head_info
        return info.tip if info else None

    # ----- ancestry ----------------------------------------------------------------------------
    def view(self, lineage: str) -> list[tuple[str, float]]:
        """[(lineage, newest step it contributes)] from ``lineage`` up through its parents."""
        chain: list[tuple[str, float]] = []
        seen = set()
        limit: float = float("inf")
        cur: str | None = lineage
        while cur is not None:
            if cur in seen or cur not in self.lineages:
                if cur in seen:
                    raise LogCorruptError(f"lineage {cur} is its own ancestor; the log is corrupt")
                break
            seen.add(cur)
            chain.append((cur, limit))
            parent = self.lineages[cur].parent_ref
            if parent is None:
                break
            limit = min(limit, parent.step)
            cur = parent.lineage
        return chain

    def contains(self, lineage: str, ckpt_lineage: str, ckpt_step: int) -> bool:
        """Is the checkpoint committed by ``ckpt_lineage`` at ``ckpt_step`` in ``lineage``'s view?"""
        return any(l == ckpt_lineage and ckpt_step <= limit for l, limit in self.view(lineage))

    # ----- transitions (each validates, then returns the new state) ----------------------------
    def after_commit(
        self,
        seq: int,
        lineage: str,
        step: int,
        txid: str,
        parent: Parent,
        writer: str | None = None,
        digest: str | None = None,
    ) -> "State":
        info = self.lineages.get(lineage)
        if info is None and (not self.partial or self.head == lineage):
            raise StaleLineageError(
                f"lineage {lineage} does not exist in this root (it may belong to another root); "
                "call txckpt.resume(root) to continue the root's current lineage"
            )
        if self.head != lineage:
            raise StaleLineageError(
                f"this writer saves lineage {lineage}, but the root's current lineage is now "
                f"{self.head} (created at log entry {self.head_info.created_seq if self.head_info else '?'}"
                f", {self.head_info.reason if self.head_info else ''}). Another job or an operator's "
                "rollback took over this root; stop this job, or call txckpt.resume(root) to continue "
                "the current lineage. Nothing was committed or lost."
            )
        assert info is not None
        if info.writer is not None and writer != info.writer:
            raise StaleLineageError(
                f"another job took over lineage {lineage} of this root (it resumed or claimed it after "
                "this process did): this process is a stale writer, e.g. a zombie job still running "
                "beside its restart, or the same command launched twice. Stop it; nothing was "
                "committed or lost."
            )
        tip = info.tip
        if tip is not None and step <= tip.step:
            raise StepConflictError(
                f"step {step} is not newer than step {tip.step}, the newest committed checkpoint "
                f"of lineage {lineage}. Saving it would shadow a committed checkpoint. To roll back, "
                f"call txckpt.resume(root, step=K) with an older K first; otherwise save a newer step."
            )
        if tip is None:
            moved = isinstance(parent, Ref)
        else:
            moved = not same_ref(parent, tip)
        if moved:
            raise ConcurrentWriterError(
                f"another writer committed to lineage {lineage} while this save of step {step} was "
                f"in progress (the newest checkpoint was {parent.step if isinstance(parent, Ref) else None}, now "
                f"{tip and tip.step}). Two jobs are writing one root; stop one of them."
            )
        new = self.copy()
        new.seq = seq
        new.lineages[lineage].tip = Ref(lineage, int(step), txid, digest=digest)
        return new

    def after_claim(self, seq: int, lineage: str, writer: str) -> "State":
        """A writer session takes over the head lineage (a restart resuming it)."""
        if self.head != lineage:
            raise StaleLineageError(
                f"lineage {lineage} is no longer the root's current lineage ({self.head} is); "
                "resume again to continue the current one"
            )
        new = self.copy()
        new.seq = seq
        new.lineages[lineage].writer = writer
        return new

    def after_new_lineage(
        self, seq: int, time: float, lineage: str, parent: Parent, reason: str, writer: str | None = None
    ) -> "State":
        if lineage in self.lineages:
            raise LogCorruptError(f"lineage id {lineage} already exists")
        new = self.copy()
        new.seq = seq
        info = LineageInfo(lineage, parent, seq, time, reason, writer=writer)
        if isinstance(parent, Ref):
            info.tip = parent
        new.lineages[lineage] = info
        new.head = lineage
        return new


def _limits(view: list[tuple[str, float]]) -> dict[str, float]:
    """A view as lineage -> newest step it contributes (a lineage occurs once in a view)."""
    return dict(view)


class Checkpoint(NamedTuple):
    """One committed checkpoint, as the log records it. A named tuple: a fresh fold builds one per
    checkpoint of its snapshot, ten times faster than a frozen dataclass."""

    lineage: str
    step: int
    txid: str
    digest: str
    seq: int
    time: float
    bytes: int = 0
    files: int = 0
    adopted: bool = False
    key: str | None = None  # where the data was committed, when not the default home

    @property
    def ref(self) -> Ref:
        return Ref(self.lineage, self.step, self.txid, self.key, self.digest)


def _index_retired(
    c: "Checkpoint | None",
    live: dict[str, dict[str, Checkpoint]],
    retired_names: dict[int | str, dict[str, Checkpoint]],
) -> None:
    """Move retired checkpoint ``c`` out of ``live`` and under its names in ``retired_names``."""
    if c is not None:
        live.get(c.lineage, {}).pop(c.txid, None)
        names: set[int | str] = {c.step, (c.key or "").split("/", 1)[0]}
        for name in names - {""}:
            retired_names.setdefault(name, {})[c.txid] = c


@dataclass
class History:
    """Every log entry folded: all checkpoints ever committed, which are retired, and the state.

    A history handed out is never changed by a later fold (``read_history`` extends a
    :meth:`copy`), so threads of one process may read the same one; its lazily built index is
    published whole (:meth:`_index`)."""

    state: State = field(default_factory=State)
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # by txid
    retired: dict[str, int] = field(default_factory=dict)  # txid -> seq of the retire entry
    #: txid -> time of the first ``fork`` entry that abandoned it (retention's abandoned TTL).
    abandoned_at: dict[str, float] = field(default_factory=dict)
    #: The entries folded by this object, oldest first. A history read from a snapshot
    #: (protocol §4a) holds only the entries after it: ``entries[0]["seq"] == base_seq + 1``.
    entries: list[dict[str, Any]] = field(default_factory=list)
    #: The seq of the snapshot this history started from; -1 when folded from entry 0.
    base_seq: int = -1
    #: The newest snapshot this history read or wrote (when the next one is due).
    snapshot_seq: int = -1
    #: lineage -> txid -> checkpoint, every one and the non-retired ones: a view's checkpoints
    #: without a pass over every checkpoint ever committed (retention asks after every save).
    #: Built on first use (a fresh ``txckpt ls`` reads a snapshot and never needs them), then
    #: kept up to date by every entry folded.
    _by_lineage: dict[str, dict[str, Checkpoint]] = field(default_factory=dict, repr=False, compare=False)
    _live: dict[str, dict[str, Checkpoint]] = field(default_factory=dict, repr=False, compare=False)
    #: Retired checkpoints by their step (its public name is in the root's naming) and adopted key's first
    #: component: which ones a listing of the root's top level can show, without a pass over all retired.
    _retired_names: dict[int | str, dict[str, Checkpoint]] = field(default_factory=dict, repr=False, compare=False)
    _indexed: bool = field(default=False, repr=False, compare=False)

    def _index(self) -> None:
        if self._indexed:
            return
        by: dict[str, dict[str, Checkpoint]] = {}
        for c in self.checkpoints.values():  # (the tightest loop: 10,000 of them in a fresh fold)
            by.setdefault(c.lineage, {})[c.txid] = c
        live = {lid: dict(d) for lid, d in by.items()}
        retired_names: dict[int | str, dict[str, Checkpoint]] = {}
        for txid in self.retired:
            _index_retired(self.checkpoints.get(txid), live, retired_names)
        # Built aside and published before the flag: a thread reading this history beside the
        # one indexing it sees no index, or a whole one (it never saw a half-built one).
        self._by_lineage, self._live, self._retired_names = by, live, retired_names
        self._indexed = True

    def copy(self) -> "History":
        """A history equal to this one that entries can be folded into without changing this one."""
        out = History(
            self.state.copy(),
            dict(self.checkpoints),
            dict(self.retired),
            dict(self.abandoned_at),
            list(self.entries),
            self.base_seq,
            self.snapshot_seq,
        )
        if self._indexed:
            out._by_lineage = {k: dict(v) for k, v in self._by_lineage.items()}
            out._live = {k: dict(v) for k, v in self._live.items()}
            out._retired_names = {k: dict(v) for k, v in self._retired_names.items()}
            out._indexed = True
        return out

    def _add(self, c: Checkpoint) -> None:
        self.checkpoints[c.txid] = c
        if self._indexed:
            self._index_add(c)

    def _index_add(self, c: Checkpoint) -> None:
        self._by_lineage.setdefault(c.lineage, {})[c.txid] = c
        if c.txid not in self.retired:
            self._live.setdefault(c.lineage, {})[c.txid] = c

    def _retire(self, txid: str, seq: int) -> None:
        if txid not in self.retired:
            self.retired[txid] = seq
            if self._indexed:
                self._index_retire(txid)

    def _index_retire(self, txid: str) -> None:
        _index_retired(self.checkpoints.get(txid), self._live, self._retired_names)

    def retired_named(self, names: Collection[str], naming: Naming = DEFAULT_NAMING) -> list[Checkpoint]:
        """The retired checkpoints that may have a key outside tx/ starting with one of ``names``
        (the published name of their step in the root's ``naming``, or their adopted key)."""
        self._index()
        steps = {n: s for n in names if (s := naming.step_of(n)) is not None and naming.public(s) == n}
        return [c for n in names for k in {n, steps.get(n, n)} for c in self._retired_names.get(k, {}).values()]

    def apply(self, entry: dict[str, Any]) -> None:
        seq = int(entry["seq"])
        if seq != self.state.seq + 1:
            raise LogCorruptError(f"log entry {seq} follows entry {self.state.seq}; an entry is missing")
        action = entry.get("action")
        if action == "commit":
            c = entry["checkpoint"]
            self._add(
                Checkpoint(
                    c["lineage"],
                    int(c["step"]),
                    c["txid"],
                    c["digest"],
                    seq,
                    float(entry["time"]),
                    int(c.get("bytes", 0)),
                    int(c.get("files", 0)),
                )
            )
        elif action == "adopt":
            for c in entry["checkpoints"]:
                self._add(
                    Checkpoint(
                        entry["lineage"],
                        int(c["step"]),
                        c["txid"],
                        c["digest"],
                        seq,
                        float(entry["time"]),
                        int(c.get("bytes", 0)),
                        int(c.get("files", 0)),
                        adopted=True,
                        key=c.get("key"),
                    )
                )
        elif action == "retire":
            for txid in entry["txids"]:
                self._retire(txid, seq)
        new = self.state.after_entry(entry)
        if action == "fork":
            # A /1 fork entry lists what it abandons; a /2 one does not (that list grows with the
            # history), and the fold derives it from the views before and after, as the forker did.
            abandoned = (
                entry.get("abandoned")
                if "state" in entry
                else [c.txid for c in self.abandoned_by(new, self.state.head)]
            )
            for txid in abandoned or []:
                self.abandoned_at.setdefault(txid, float(entry["time"]))
        self.state = new
        self.entries.append(entry)

    def abandoned_by(self, new: State, old_head: str | None) -> list[Checkpoint]:
        """The checkpoints of ``old_head``'s view (retired ones aside) that are outside the view
        of ``new``'s head: what a fork from the folded state to ``new`` abandons."""
        if old_head is None or new.head is None:
            return []
        return self._view_minus(self.state.view(old_head), _limits(new.view(new.head)))

    def restored_by(self, new: State, old_head: str | None) -> list[Checkpoint]:
        """The checkpoints of ``new``'s head's view (retired ones aside) outside ``old_head``'s
        view: what a fork to ``new`` brings back into the current lineage (protocol §7)."""
        if new.head is None:
            return []
        old = _limits(self.state.view(old_head)) if old_head is not None and old_head in self.state.lineages else {}
        return self._view_minus(new.view(new.head), old)

    def _view_minus(self, view: list[tuple[str, float]], other: dict[str, float]) -> list[Checkpoint]:
        """The live checkpoints of ``view`` outside the view whose limits are ``other``. Only the
        lineages whose limit differs are read, so a rollback of the head costs its own lineage's
        checkpoints, not the whole view's."""
        self._index()
        out = []
        for lid, limit in view:
            low = other.get(lid, -1)
            if limit > low:
                out += [c for c in self._live.get(lid, {}).values() if low < c.step <= limit]
        return sorted(out, key=lambda c: (c.step, c.seq))

    def folds_like(self, other: "History") -> bool:
        """Whether both folds say the same of the root (entries aside): what a fold from a
        snapshot must give, against the fold of every entry."""
        return (self.state.seq, self.state.to_json(), self.checkpoints, self.retired, self.abandoned_at) == (
            other.state.seq,
            other.state.to_json(),
            other.checkpoints,
            other.retired,
            other.abandoned_at,
        )

    # ----- snapshots (protocol §4a) ------------------------------------------------------------
    def snapshot_body(self) -> dict[str, Any]:
        """What a ``txckpt-snapshot/3`` at ``state.seq`` records besides the state: the
        checkpoints as columns (one list per field, in log order), which a reader turns into
        objects without a dict per checkpoint to parse and pick apart."""
        rows = sorted(self.checkpoints.values(), key=lambda c: c.seq)
        cols = list(zip(*rows)) if rows else [() for _ in Checkpoint._fields]
        return {
            "checkpoints": {f: list(col) for f, col in zip(Checkpoint._fields, cols)},
            "retired": dict(sorted(self.retired.items())),
            "abandoned_at": dict(sorted(self.abandoned_at.items())),
        }

    @classmethod
    def from_snapshot(cls, state: State, body: dict[str, Any]) -> "History":
        """The history folded through ``state.seq``, from a snapshot body bound to that entry
        (``checkpoints``: columns, /3; a list of objects, /1 and /2). Raises
        ValueError/KeyError/TypeError on a malformed body (the caller falls back)."""
        h = cls(state=state, base_seq=state.seq, snapshot_seq=state.seq)
        found = body["checkpoints"]
        if isinstance(found, dict):  # /3: one list per field; the body's digest vouches for the types
            cols = [found[f] for f in Checkpoint._fields]
            if any(not isinstance(col, list) or len(col) != len(cols[0]) for col in cols):
                raise ValueError("its checkpoint columns are not lists of one length")
            # tuple.__new__ straight from the columns: no Python frame per checkpoint.
            rows: list[Checkpoint] = list(map(partial(tuple.__new__, Checkpoint), zip(*cols)))
            txids, seqs = cols[2], cols[4]
        else:  # /1, /2: one object per checkpoint
            rows = [
                Checkpoint(
                    str(c["lineage"]),
                    int(c["step"]),
                    str(c["txid"]),
                    str(c["digest"]),
                    int(c["seq"]),
                    float(c["time"]),
                    int(c["bytes"]),
                    int(c["files"]),
                    bool(c["adopted"]),
                    None if c["key"] is None else str(c["key"]),
                )
                for c in found
            ]
            txids, seqs = [c.txid for c in rows], [c.seq for c in rows]
        if seqs and not (0 <= min(seqs) and max(seqs) <= state.seq):
            raise ValueError(f"a checkpoint's seq is outside the snapshot's 0..{state.seq}")
        h.checkpoints = dict(zip(txids, rows))
        retired, abandoned = body["retired"], body["abandoned_at"]
        if not (isinstance(retired, dict) and isinstance(abandoned, dict)):
            raise TypeError("retired and abandoned_at must be JSON objects")
        h.retired, h.abandoned_at = dict(retired), dict(abandoned)
        return h

    # ----- queries -----------------------------------------------------------------------------
    def in_view(self, lineage: str | None, include_retired: bool = False) -> list[Checkpoint]:
        """The checkpoints of ``lineage``'s view (default: the head), oldest first. A lineage
        the log does not know raises :class:`LineageNotFoundError` (not an empty view: a typo
        must not read as "no checkpoints")."""
        if lineage is not None and lineage not in self.state.lineages:
            known = sorted(self.state.lineages, key=lambda l: -self.state.lineages[l].created_seq)
            head = self.state.head
            raise LineageNotFoundError(
                f"this root has no lineage {lineage!r}; its lineages, newest first: "
                + (", ".join(f"{l} (HEAD)" if l == head else l for l in known) or "none")
                + " (`txckpt log ROOT` shows them)",
                lineage=lineage,
                known=known,
            )
        lineage = lineage or self.state.head
        if lineage is None:
            return []
        self._index()
        index = self._by_lineage if include_retired else self._live
        out = [
            c
            for lid, limit in _limits(self.state.view(lineage)).items()
            for c in index.get(lid, {}).values()
            if c.step <= limit
        ]
        return sorted(out, key=lambda c: (c.step, c.seq))

    def live(self) -> list[Checkpoint]:  # every one not retired, from the index
        self._index()
        return [c for cs in self._live.values() for c in cs.values()]

    def abandoned(self, include_retired: bool = False) -> list[Checkpoint]:
        limits = _limits(self.state.view(self.state.head)) if self.state.head else {}
        self._index()
        index = self._by_lineage if include_retired else self._live
        return sorted(
            (c for lid, cs in index.items() for c in cs.values() if c.step > limits.get(lid, -1)),
            key=lambda c: (c.lineage, c.step),
        )

    def find(self, *, step: int | None = None, txid: str | None = None, lineage: str | None = None) -> Checkpoint:
        if txid is not None:
            c = self.checkpoints.get(txid)
            if c is None:
                raise CheckpointNotFoundError(f"no committed checkpoint with txid {txid} in this root")
            return c
        if step is None:
            raise InvalidArgumentError("give a step or a txid")
        for c in reversed(self.in_view(lineage, include_retired=True)):
            if c.step == step:
                if c.txid in self.retired:
                    raise CheckpointNotFoundError(
                        f"checkpoint step {step} was deleted by the retention policy (log entry "
                        f"{self.retired[c.txid]}); choose another step (see `txckpt ls`)"
                    )
                return c
        steps = [c.step for c in self.in_view(lineage)]
        raise CheckpointNotFoundError(
            f"no committed checkpoint at step {step} in the current lineage; committed steps: "
            f"{steps or 'none'} (see `txckpt log` for other lineages)"
        )

    def committed_digest(self, txid: str) -> str | None:
        """The manifest digest the log committed for ``txid``; None if it never committed."""
        c = self.checkpoints.get(txid)
        return c.digest if c else None

    def fork_points(self) -> set[str]:
        return {p.txid for info in self.state.lineages.values() if (p := info.parent_ref) is not None}


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as users see it."""

    step: int
    lineage: str
    txid: str
    path: str | None  # None if its data is missing
    state: str  # "current", "abandoned", "retired"
    time: float
    bytes: int
    files: int
    adopted: bool
    published: bool


# ----- what a fork abandons, as the warning says it ------------------------------------------------
def describe_checkpoints(checkpoints: list[Checkpoint], naming: Naming = DEFAULT_NAMING) -> str:
    return ", ".join(f"{naming.name_of(c.step, c.key)} (lineage {c.lineage}, txid {c.txid})" for c in checkpoints)


#: A rollback warning lists at most this many abandoned checkpoints (``txckpt log`` shows all).
ROLLBACK_LISTED = 10


def rollback_warning(
    url: str,
    parent: Parent,
    lineage: str,
    abandoned: list[Checkpoint],
    *,
    renames: bool = True,
    naming: Naming = DEFAULT_NAMING,
) -> str:
    """The warning a fork logs: a short first line, then indented lines, one per abandoned
    checkpoint (the first ROLLBACK_LISTED; ``txckpt log`` lists every one). No "txckpt:"
    prefix: the "txckpt" logger's name already says where it comes from."""
    if isinstance(parent, Ref):
        head = f"rolling back to step {parent.step} of lineage {parent.lineage}"
    elif parent is not None:
        head = f"starting lineage {lineage} from external checkpoint {parent.path}"
    else:
        head = f"starting lineage {lineage} from scratch"
    lines = [
        f"{head}: new lineage {lineage} abandons {len(abandoned)} checkpoint(s)",
        f"  root: {url}",
        "  abandoned (kept intact and never overwritten, but no longer returned by get_last_checkpoint):",
    ]
    listed = abandoned[:ROLLBACK_LISTED]
    names = [naming.name_of(c.step, c.key) for c in listed]  # an adopted checkpoint-00500 keeps its name
    width = max(map(len, names)) if names else 0
    lines += [f"    {name.ljust(width)}  (lineage {c.lineage}, txid {c.txid})" for name, c in zip(names, listed)]
    if len(abandoned) > ROLLBACK_LISTED:
        lines.append(f"    ... and {len(abandoned) - ROLLBACK_LISTED} more (`txckpt log {url}` shows every one)")
    # What happens to their paths: only rename backends publish (protocol §7). ``renames``: the
    # storage renames directories atomically.
    lines += (
        [
            f"  the new lineage's saves of the same steps get the {naming.public('N')} names,",
            "  and the abandoned ones move to .txckpt/tx/<txid>/checkpoint-N",
        ]
        if renames
        else [
            "  nothing is moved on this object store: each stays at the path it was committed at",
            "  (.txckpt/tx/<txid>/checkpoint-N; an adopted one at its checkpoint-N)",
        ]
    )
    return "\n".join(lines)
