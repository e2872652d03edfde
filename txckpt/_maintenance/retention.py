"""Retention: which committed checkpoints may go, and their crash-safe deletion.

A :class:`RetentionPolicy` is a small, pure rule set (docs/retention.md):

* ``keep_last=N``: keep the N newest checkpoints of the current lineage;
* ``keep_every=K``: keep the current lineage's checkpoints whose step is a multiple of K;
* ``keep_best``: txids or paths to keep whatever else says (the Trainer passes
  ``best_model_checkpoint``), and ``best_metric`` to keep the best ``keep_best_n`` checkpoints
  of the current lineage by a number recorded in their manifest metadata;
* always kept: every fork point, the newest checkpoint of the current lineage (the head tip),
  and every checkpoint a live reader lease names;
* ``abandoned="keep"`` (default) keeps every checkpoint of abandoned lineages; a number of
  seconds lets an abandoned checkpoint go once it has been abandoned for that long (fork points
  excepted).

With neither ``keep_last`` nor ``keep_every`` nor ``best_metric`` set, the current lineage is kept
whole.

Deletion is two-phase (:func:`apply_retention`): one ``retire`` log entry first names every
checkpoint that goes (validated against the newest state inside the append, so a concurrent fork
or commit is never undercut), then each one's data is removed. On a local root the published
``checkpoint-N`` directory is first renamed back to its home under ``.txckpt/tx/<txid>/``, so a
half-deleted ``checkpoint-N`` is never visible; on an object store its manifest is deleted first,
so a half-deleted checkpoint is never mistaken for a committed one. A crash between the two phases
leaves retired-but-present data, which the next :func:`apply_retention` or ``txckpt gc`` removes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

from ..errors import (
    CheckpointNotFoundError,
    CheckpointRetiredError,
    InvalidArgumentError,
    SpecialFileError,
    StorageError,
)
from .._log.commit import fork
from .._log.lineage import Checkpoint, History, State
from .._storage.base import Storage
from .._base.layout import READERS_DIR, TX_DIR, parse_checkpoint_name
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import Manifest
from .._base.naming import DEFAULT as DEFAULT_NAMING, Naming
from .._log.publication import Root, manifest_txid
from .._base.refs import Ref
from .._base.reserve import FULL, ensure_reserve, full_disk_error, release_reserve

log = logging.getLogger("txckpt")

Abandoned = Union[str, int, float]


class _NothingToRetire(Exception):
    pass


@dataclass
class RetentionPolicy:
    """Which committed checkpoints to keep; everything else may be retired. See the module doc."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: Iterable[str] = field(default_factory=list)
    abandoned: Abandoned = "keep"
    best_metric: str | None = None
    keep_best_n: int = 1
    greater_is_better: bool = False
    #: keep_best counts toward keep_last (transformers' save_total_limit): a best outside the
    #: keep_last newest takes one of their places; the newest always stays.
    best_in_last: bool = False

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidArgumentError(f"{name} must be a positive int or None, not {v!r}")
        if isinstance(self.keep_best, str):
            self.keep_best = [self.keep_best]
        self.keep_best = [os.fspath(b) for b in (self.keep_best or []) if b]
        if self.abandoned != "keep":
            if isinstance(self.abandoned, bool) or not isinstance(self.abandoned, (int, float)) or self.abandoned < 0:
                raise InvalidArgumentError(
                    f'abandoned must be "keep" or a TTL in seconds (>= 0), not {self.abandoned!r}'
                )
        if not isinstance(self.keep_best_n, int) or self.keep_best_n < 1:
            raise InvalidArgumentError(f"keep_best_n must be a positive int, not {self.keep_best_n!r}")

    @classmethod
    def from_save_total_limit(
        cls, save_total_limit: int | None, best_model_checkpoint: str | None = None, **kwargs: Any
    ) -> "RetentionPolicy":
        """The Trainer's ``save_total_limit``, as transformers counts it: N checkpoints of the
        current lineage, the newest and the best among them (N-1 newest plus an older best; with
        a limit of 1 and a best that is not the newest, two remain). None keeps everything."""
        return cls(
            keep_last=save_total_limit if save_total_limit else None,
            keep_best=[best_model_checkpoint] if best_model_checkpoint else [],
            best_in_last=True,
            **kwargs,
        )

    @property
    def is_noop(self) -> bool:
        return (
            self.keep_last is None and self.keep_every is None and self.best_metric is None and self.abandoned == "keep"
        )

    # ----- the pure decision -------------------------------------------------------------------
    def decide(
        self,
        history: History,
        *,
        now: float | None = None,
        protected: Iterable[str] = (),
        metrics: dict[str, float] | None = None,
        naming: Naming = DEFAULT_NAMING,
    ) -> list[Checkpoint]:
        """The committed, not yet retired checkpoints this policy lets go, oldest first.

        ``protected``: txids kept regardless (reader leases, resolved ``keep_best`` paths).
        ``metrics``: txid -> value of ``best_metric`` (read from manifests by apply_retention).
        ``now``: the clock for the abandoned TTL (default: time.time()).
        ``naming``: the root's, by which a ``keep_best`` name gives a step (``checkpoint_5`` on
        an Accelerate root).
        """
        now = time.time() if now is None else now
        keep = set(protected) | self.always_kept(history)
        current = history.in_view(None)
        current_ids = {c.txid for c in current}
        best = self._resolve_best(history, current, naming)
        keep |= best
        rules = self.keep_last is not None or self.keep_every is not None or self.best_metric is not None
        if not rules:
            keep |= current_ids
        else:
            if self.keep_last is not None:
                last = self.keep_last
                if self.best_in_last:
                    newest = {c.txid for c in current[-last:]}
                    last = max(1, last - len({c.txid for c in current if c.txid in best} - newest))
                keep |= {c.txid for c in current[-last:]}
            if self.keep_every is not None:
                keep |= {c.txid for c in current if c.step % self.keep_every == 0}
            if self.best_metric is not None and metrics:
                scored = [c for c in current if c.txid in metrics]
                scored.sort(key=lambda c: metrics[c.txid], reverse=self.greater_is_better)
                keep |= {c.txid for c in scored[: self.keep_best_n]}
        abandoned = [c for c in history.abandoned() if c.txid not in current_ids]
        if self.abandoned == "keep":
            keep |= {c.txid for c in abandoned}
        else:
            since = history.abandoned_at
            ttl = float(self.abandoned)
            for c in abandoned:
                if now - since.get(c.txid, c.time) < ttl:
                    keep.add(c.txid)
        # The live ones, not every checkpoint ever committed: retention runs after every save,
        # and a pass over the retired ones made a 1,000-cycle soak's cycles grow with it.
        out = [c for c in history.live() if c.txid not in keep]
        return sorted(out, key=lambda c: (c.step, c.seq))

    @staticmethod
    def always_kept(history: History) -> set[str]:
        """Fork points and the head tip: never retired, whatever the policy."""
        return protected_by_state(history.state)

    def _resolve_best(self, history: History, current: list[Checkpoint], naming: Naming = DEFAULT_NAMING) -> set[str]:
        """keep_best entries -> txids, conservatively (an ambiguous name keeps every candidate)."""
        out: set[str] = set()
        for item in self.keep_best:
            if item in history.checkpoints:
                out.add(item)
                continue
            parts = item.replace("\\", "/").rstrip("/").split("/")
            hit = False
            for i, part in enumerate(parts[:-1]):
                if f"{parts[i - 1] if i > 0 else ''}/{part}" == TX_DIR and i + 1 < len(parts):
                    if parts[i + 1] in history.checkpoints:
                        out.add(parts[i + 1])
                        hit = True
            if hit:
                continue
            # The root's public name, or a home's (and a Trainer's) checkpoint-N.
            step = (
                (
                    naming.step_of(parts[-1])
                    if naming.step_of(parts[-1]) is not None
                    else parse_checkpoint_name(parts[-1])
                )
                if parts
                else None
            )
            if step is not None:
                out |= {c.txid for c in current if c.step == step}
                # A name that is no longer the current lineage's (stale path): keep every owner.
                if not any(c.step == step for c in current):
                    out |= {c.txid for c in history.checkpoints.values() if c.step == step}
        return out


def protected_by_state(state: State) -> set[str]:
    """txids no retire entry may name: every fork point and the newest of the current lineage."""
    out = {p.txid for info in state.lineages.values() if (p := info.parent_ref) is not None}
    tip = state.head_tip
    if tip is not None and tip.txid:
        out.add(tip.txid)
    # Every lineage's tip is the newest checkpoint of that lineage's view; a lineage that has not
    # saved yet has the fork point as its tip (already covered).
    return out


# ----- reader leases ---------------------------------------------------------------------------
# Taking and giving back a lease is txckpt._maintenance.leases' (an incremental save leases what it shares);
# what a deleter reads of them is here.
def lease_clock_skew() -> float:
    """Seconds by which a deleter's clock may run ahead of a reader's without undercutting the
    reader's lease (``TXCKPT_LEASE_CLOCK_SKEW``, default 300). A lease's ``expires`` is the
    reader's clock; a deleter compares it with its own, so it takes a lease for expired only
    this long after ``expires``. Released leases are deleted at once, so the margin delays only
    the deletion of checkpoints whose readers died holding a lease."""
    try:
        return max(0.0, float(os.environ.get("TXCKPT_LEASE_CLOCK_SKEW", "") or 300.0))
    except ValueError:
        return 300.0


def read_leases(storage: Storage, now: float | None = None) -> tuple[set[str], list[str]]:
    """(txids under a live lease, keys of expired or unreadable leases).

    ``now``: the deleter's clock. A lease is live until ``expires`` plus
    :func:`lease_clock_skew`: the two clocks are different machines' (docs/protocol.md §11)."""
    now = (time.time() if now is None else now) - lease_clock_skew()
    live: set[str] = set()
    expired: list[str] = []
    for name in storage.list_dir(READERS_DIR):
        if not name.endswith(".json"):
            continue
        key = f"{READERS_DIR}/{name}"
        try:
            record = json.loads(storage.read_bytes(key))
            txid, expires = str(record["txid"]), float(record["expires"])
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, SpecialFileError):
            expired.append(key)
            continue
        if expires > now:
            live.add(txid)
        else:
            expired.append(key)
    return live, expired


# ----- applying a policy -----------------------------------------------------------------------
def _resolve_paths(root: Root, items: Iterable[str]) -> set[str]:
    """keep_best paths that name a checkpoint under this root -> the txid in its manifest."""
    out = set()
    for item in items:
        key = root.storage.key_of(item) if ("/" in item or os.sep in item) else None
        if not key:
            continue
        txid = manifest_txid(root.storage, key)
        if txid:
            out.add(txid)
    return out


def _read_metrics(root: Root, history: History, metric: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in history.in_view(None):
        key = root.publication.locate(c.ref)
        if key is None:
            continue
        try:
            m = Manifest.decode(root.storage.read_bytes(f"{key}/{MANIFEST_NAME}"))
            value = m.metadata.get(metric)
            if value is None and isinstance(m.metadata.get("metrics"), dict):
                value = m.metadata["metrics"].get(metric)
            if value is not None:
                out[c.txid] = float(value)
        except Exception:  # unreadable: not scored (and so not kept by the metric rule alone)
            continue
    return out


def plan_retention(
    root: Root,
    policy: RetentionPolicy,
    history: History | None = None,
    *,
    now: float | None = None,
    protect: Iterable[str] = (),
) -> list[Checkpoint]:
    """What ``policy`` lets go now, with leases, keep_best paths and metrics resolved.
    ``protect``: txids kept whatever the policy says; so are those the root's session's
    ``retention_guards`` name (a tiered root's fast tier: what is not durable yet, protocol §14)."""
    history = history or root.history()
    leased, _ = read_leases(root.storage, now)
    protected = leased | _resolve_paths(root, policy.keep_best) | set(protect)
    for guard in list(root.shared.retention_guards.values()):
        protected |= guard()
    metrics = _read_metrics(root, history, policy.best_metric) if policy.best_metric else None
    return policy.decide(history, now=now, protected=protected, metrics=metrics, naming=root.publication.naming)


def retire(
    root: Root,
    txids: Iterable[str],
    *,
    policy: RetentionPolicy | None = None,
    decided_at: int | None = None,
    now: float | None = None,
    protect: Iterable[str] = (),
) -> list[str]:
    """Append one ``retire`` entry naming ``txids`` (phase one). Returns the txids it retired.

    The append validates against the newest state: a fork point or the head tip is never
    retired, nor an unknown or already retired txid. With ``policy`` given, if the log moved past
    ``decided_at`` (the seq the txids were decided at), the policy decides again against the
    fresh history and only txids it still lets go are retired. Returns [] when nothing is left.
    """
    wanted = list(dict.fromkeys(txids))
    if not wanted:
        return []
    chosen: list[str] = []

    def build(state: State, seq: int, t: float) -> dict[str, Any]:
        nonlocal chosen
        hist = root.history()  # incremental: reads only the entries appended since last time
        names = wanted
        if policy is not None and decided_at is not None and hist.state.seq != decided_at:
            allowed = {c.txid for c in plan_retention(root, policy, hist, now=now, protect=protect)}
            names = [x for x in wanted if x in allowed]
        forbidden = protected_by_state(state) | protected_by_state(hist.state)
        chosen = [x for x in names if x in hist.checkpoints and x not in hist.retired and x not in forbidden]
        if not chosen:
            raise _NothingToRetire()
        return {"action": "retire", "txids": chosen, "state": state.to_json()}

    try:
        # On a full disk the entry goes into the space .txckpt/reserve held back for it.
        root.append_entry(build, on_full=lambda: release_reserve(root.storage))
    except _NothingToRetire:
        return []
    except StorageError as e:
        if e.errno in FULL:
            raise full_disk_error(e, root.url) from e
        raise
    return chosen


def delete_checkpoint_data(root: Root, c: Checkpoint) -> list[str]:
    """Remove a retired checkpoint's data (phase two). Returns the keys removed.

    Local roots: a published ``checkpoint-N`` (or an adopted checkpoint's own directory) is first
    renamed into ``.txckpt/tx/<txid>/``, so no reader ever sees a half-deleted ``checkpoint-N``;
    then ``.txckpt/tx/<txid>`` goes. Object stores: the manifest is deleted first, so a partly
    deleted checkpoint is never taken for a committed one. Safe to repeat after a crash. Where
    the data is, and how it leaves, is the publication's (:meth:`InPlacePublication.remove`).

    Only call it for a txid the log has retired.
    """

    def resolve(txid: str | None) -> tuple[Ref, bool] | None:
        # A rename caught another checkpoint (a race with a publication): is it committed, and current?
        history = root.history()
        other = history.checkpoints.get(txid or "")
        if other is None:
            return None
        return other.ref, other.txid in {x.txid for x in history.in_view(None, include_retired=True)}

    return root.publication.remove(c.ref, resolve)


def apply_retention(
    root: Root, policy: RetentionPolicy, *, dry_run: bool = False, now: float | None = None, protect: Iterable[str] = ()
) -> list[Any]:
    """Retire and delete what ``policy`` lets go; returns their :class:`~txckpt.CheckpointInfo`
    as it was before (state "current" or "abandoned"). ``dry_run`` only reports. Also finishes
    the deletion of checkpoints retired earlier whose data a crash left behind. ``protect``: as
    :func:`plan_retention`'s."""
    protect = set(protect)
    history = root.history(snapshot=not dry_run)
    decided_at = history.state.seq
    going = plan_retention(root, policy, history, now=now, protect=protect)
    infos = {i.txid: i for i in root.describe(going, history=history)} if going else {}
    if dry_run:
        return [infos[c.txid] for c in going if c.txid in infos]
    retired = set(retire(root, [c.txid for c in going], policy=policy, decided_at=decided_at, now=now, protect=protect))
    finish_retired(root, now=now)
    ensure_reserve(root.storage, durable=root.durable)  # again, if a full disk used it up
    return [infos[c.txid] for c in going if c.txid in retired and c.txid in infos]


def rewind(root: Root, keep: str, *, now: float | None = None) -> list[Checkpoint]:
    """Make committed checkpoint ``keep`` (a txid, or a path under the root) of the current
    lineage its newest, and let go of the newer ones; returns the checkpoints retired.

    This is how the Trainer keeps only the best checkpoint at the end of training with
    ``save_total_limit=1`` (upstream deletes every other checkpoint, the newest included, so
    that a restart resumes the best). The head tip is never retired, so it is done in the
    protocol's own steps, each of which a crash may end the sequence after:

    1. a ``fork`` entry whose parent is ``keep`` (a rollback, §10): from then on lookups and
       ``resume`` return ``keep``; the newer checkpoints of the lineage are abandoned, still intact;
    2. one ``retire`` entry naming the checkpoints that fork abandoned, except fork points of
       other lineages and leased ones; if the log moved in between, only those still abandoned
       are retired (an undone rollback makes them current again, and they stay);
    3. their data is deleted (:func:`finish_retired`; a crash leaves it to the next retention or gc).

    Other lineages' checkpoints are never named. ``keep`` already the newest: nothing happens.
    """
    history = root.history()
    txid = keep if keep in history.checkpoints else next(iter(_resolve_paths(root, [keep])), None)
    view = {c.txid: c for c in history.in_view(None)}
    if txid is None or txid not in view:
        raise CheckpointNotFoundError(
            f"{keep} is not a committed, kept checkpoint of the current lineage of {root.url}; "
            "nothing was rolled back (see `txckpt ls`)"
        )
    tip = history.state.head_tip
    if tip is not None and tip.txid == txid:
        return []
    fork(root, view[txid].ref, history, reason="fork", announce=False)
    fresh = root.history()
    still = {c.txid for c in fresh.in_view(None)}
    leased, _ = read_leases(root.storage, now)
    going = [c for t, c in view.items() if t not in still and t not in leased]
    # Re-decided inside the append if anything was appended after the fork: only what is still
    # abandoned then (abandoned=0 lets every abandoned checkpoint go, the current lineage stays).
    retired = set(
        retire(root, [c.txid for c in going], policy=RetentionPolicy(abandoned=0), decided_at=fresh.state.seq, now=now)
    )
    finish_retired(root, now=now)
    gone = [c for c in going if c.txid in retired]
    if gone:
        log.info(
            "rolled the current lineage of %s back to step %d (txid %s) and retired the %d "
            "newer checkpoint(s) it left: %s",
            root.url,
            view[txid].step,
            txid,
            len(gone),
            ", ".join(f"step {c.step}" for c in gone),
        )
    return gone


def retired_present(root: Root, history: History | None = None) -> list[Checkpoint]:
    """Retired checkpoints whose data (or an empty ``.txckpt/tx/<txid>``) is still on storage.

    Retention runs after every save and a long run retires thousands of checkpoints, so this
    does not check each one ever retired: two listings (the root's top level and ``tx/``) show
    which could still have data, and only those are checked. A name that appears after the
    listings is found by the next call, as one that appears after a check would be."""
    history = history or root.history()
    if not history.retired:
        return []
    s = root.storage
    homes = set(s.list_dir(TX_DIR))
    top_names = set(s.list_dir(""))
    retired = {t: history.checkpoints[t] for t in homes if t in history.retired and t in history.checkpoints}
    naming = root.publication.naming
    retired.update((c.txid, c) for c in history.retired_named(top_names, naming))

    def elsewhere(c: Checkpoint) -> bool:
        # Anywhere outside tx/ it can be (a published ``checkpoint-N``, an adopted checkpoint's
        # own directory) is a key whose first component is a name at the root's top level.
        return any(
            key.split("/", 1)[0] in top_names
            for key in root.publication.candidates(c.ref)
            if not key.startswith(TX_DIR + "/")
        )

    def may_be_elsewhere(c: Checkpoint) -> bool:
        # What ``elsewhere`` asks, cheaply: the keys outside tx/ that a publication's candidates
        # hold are the published name and the adopted key. This runs over every checkpoint ever
        # retired after every save, so it must not build refs or candidate lists for each.
        return naming.public(c.step) in top_names or (c.key is not None and c.key.split("/", 1)[0] in top_names)

    # A txid the listing of tx/ shows is present already; any other needs its data located.
    return sorted(
        (
            c
            for c in retired.values()
            if c.txid in homes or (may_be_elsewhere(c) and elsewhere(c) and root.publication.locate(c.ref) is not None)
        ),
        key=lambda c: history.retired[c.txid],
    )


def finish_retired(root: Root, *, now: float | None = None) -> list[Checkpoint]:
    """Delete the data of every retired checkpoint still present, except leased ones.

    The retired set is read first and the leases after it (as ``collect_garbage`` does): a
    reader writes its lease, then checks that the checkpoint is not retired
    (:func:`acquire_reader_lease`). A retire entry that the reader's check missed was appended
    after the lease existed, so if this read of the retired set sees that entry, the read of
    the leases that follows sees the lease. Read the other way round, a lease taken between the
    two reads would be missed and its checkpoint deleted under the reader.
    """
    present = retired_present(root)
    leased, _ = read_leases(root.storage, now)
    done = []
    for c in present:
        if c.txid in leased:
            log.info("%s is retired but leased by a reader; deleting it later", c.txid)
            continue
        delete_checkpoint_data(root, c)
        done.append(c)
    return done


__all__ = [
    "RetentionPolicy",
    "apply_retention",
    "plan_retention",
    "retire",
    "rewind",
    "delete_checkpoint_data",
    "finish_retired",
    "retired_present",
    "read_leases",
    "lease_clock_skew",
    "protected_by_state",
]


# ----- a path that names a retired checkpoint ----------------------------------------------------
def retired_error(root: Root, history: History, c: Checkpoint, path: str) -> CheckpointRetiredError:
    """What a read of ``path``, where retired checkpoint ``c`` was, raises: it was committed,
    then retired (not "never committed"), and where it is still listed."""
    seq = history.retired[c.txid]
    return CheckpointRetiredError(
        f"{path} was committed (step {c.step}, lineage {c.lineage}, txid {c.txid}), then retired by the "
        f"retention policy (log entry {seq}), which deletes its data: it cannot be loaded. `txckpt ls "
        f"{root.url} --all` lists it with the other retired checkpoints; resume from one that still has "
        f"its data (`txckpt ls {root.url}`), or keep more (RetentionPolicy, docs/retention.md)",
        path=path,
        root=root.url,
        step=c.step,
        lineage=c.lineage,
        txid=c.txid,
        retired_seq=seq,
    )


def retired_error_at(root: Root, history: History, key: str, path: str) -> CheckpointRetiredError | None:
    """:func:`retired_error` for the retired checkpoint whose data was at ``key`` (its home, its
    published name, its adopted key; the most recently retired of several), or None if none was.
    Asked only once a read found nothing at ``key``: one pass over the retired checkpoints."""
    key = key.rstrip("/")
    found = [
        c
        for txid in history.retired
        if (c := history.checkpoints.get(txid)) is not None and key in root.publication.candidates(c.ref)
    ]
    if not found:
        return None
    return retired_error(root, history, max(found, key=lambda c: history.retired[c.txid]), path)


def missing_checkpoint_error(root: Root, history: History, key: str, path: str) -> CheckpointNotFoundError:
    """What a resume from ``path`` (key ``key`` of ``root``), which has no manifest, raises."""
    return retired_error_at(root, history, key, path) or CheckpointNotFoundError(
        f"{path} has no txckpt manifest: it is not a committed checkpoint of {root.url} (list them with `txckpt ls`)"
    )
