"""Campaign 5: soak. Save/rotate cycles with random SIGKILLs and restarts.

Each cycle is a new process (a restart): it resumes the root's current lineage (about one cycle in
14 instead rolls back to a random older checkpoint of it, forking a lineage), saves the next step,
applies retention (keep_last=3, abandoned checkpoints may go at once: TTL 0; fork points are
always kept) and, every fifth cycle, runs gc. About a third of the cycles are SIGKILLed at a
random file operation (injectors.LocalInjector). The cycle reports, through a pipe, each save the
moment it returns.

After every cycle a fresh process checks: lookup returns a committed checkpoint of the head's
view that loads, verifies and holds one save's files; it is at least as new as the last save that
returned in the current lineage; every committed checkpoint that was not retired is present,
unchanged and verifies; every ``retire`` entry of the log names only checkpoints the policy let go
at that point of the log (never a fork point, the head's tip, or one of the 3 newest); after a
cycle whose retention completed, at most keep_last + fork points are not retired. (The check
extends the history it read after the previous cycle with the entries appended since: reading the
whole log every cycle would make a 1000-cycle soak quadratic.) Every fifth cycle it also runs gc and
checks that nothing leaked (no uncommitted staging, retired data, intent or temp file left) and
that the bytes on disk are those of the checkpoints retention keeps plus the log.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from tests.harness.procs import run_child

from .core import Case, Ctx, Result, classify, payload
from .injectors import LocalInjector
from .invariants import leaks, read_tags

KEEP_LAST = 3


def _policy():
    from txckpt._maintenance.retention import RetentionPolicy

    return RetentionPolicy(keep_last=KEEP_LAST, abandoned=0)


def cycle(root: str, c: int, seed: int, kill_at: int | None, when: str, report_fd: int, gc_now: bool) -> None:
    """One restart of the job (in a child)."""
    import txckpt
    from txckpt._maintenance.gc import collect_garbage
    from txckpt._maintenance.retention import apply_retention
    from txckpt._root.root import CheckpointRoot

    def report(**kw: Any) -> None:
        os.write(report_fd, (json.dumps(kw) + "\n").encode())

    rnd = random.Random(seed)
    inj = LocalInjector(kill_at=kill_at, when=when, under=os.path.dirname(root)) if kill_at else None
    if inj:
        inj.install()
    txckpt.forget_roots()
    r = CheckpointRoot(root)
    r.resume()
    if rnd.random() < 0.07:  # a rollback to a random older checkpoint of the current lineage
        current = r.checkpoints("current")
        if len(current) >= 3:
            target = rnd.choice(current[:-1])
            r.resume(target.step)
            report(event="forked", step=target.step, head=r.state().head)
    tip = r.state().head_tip
    step = (tip.step if tip else 0) + 1 + (rnd.random() < 0.3)
    path = r.save(step, payload(f"S{c}", step))
    m = txckpt.read_manifest(path)
    report(event="saved", step=step, txid=m.txid, lineage=m.lineage, tag=f"S{c}")
    apply_retention(r, _policy())
    report(event="retained", seq=r.state().seq)
    if gc_now:
        collect_garbage(r, policy=_policy(), now=time.time() + 7200)
    if inj:
        inj.uninstall()


def check_cycle(root: str, last: dict[str, Any] | None, full_gc: bool, retained: bool, memo: str) -> dict[str, Any]:
    """The soak's invariants (see the module doc), in a fresh process.

    ``memo``: a pickle of the history the previous check read, which this check extends with the
    entries appended since (entries are created once and carry a digest; reading all of them every
    cycle would make the soak quadratic in the log's length). ``retained``: the cycle's retention
    completed, so exactly what the policy keeps may remain."""
    import pickle

    import txckpt
    from txckpt._maintenance.gc import collect_garbage
    from txckpt._log import log as commit_log
    from txckpt._log.lineage import History
    from txckpt._root.root import CheckpointRoot

    v: list[str] = []
    txckpt.forget_roots()
    r = CheckpointRoot(root)
    saved = None
    if os.path.exists(memo):
        with open(memo, "rb") as f:
            saved = pickle.load(f)
        r.folded_history = saved["hist"]
    else:  # the whole log, not a snapshot: this check must see every entry
        r.folded_history = commit_log.read_history(r.storage, snapshots=False)
    hist = r.history()
    # What a fresh process folds from the newest history snapshot must be what the whole log says.
    quick = commit_log.read_history(r.storage)
    if quick.state.seq == hist.state.seq and not quick.folds_like(hist):
        v.append(f"[snapshot] the history read from snapshot {quick.base_seq} differs from the log's")
    snapshots_used = quick.base_seq
    # Lookup.
    path = txckpt.get_last_checkpoint(root)
    if hist.state.head_tip is not None:
        if path is None:
            v.append("[lookup] lookup returned None although the head has a tip")
        else:
            m = txckpt.read_manifest(path)
            if m.txid != hist.state.head_tip.txid:
                v.append(f"[lookup] lookup returned {m.txid}, not the head's tip {hist.state.head_tip.txid}")
            try:
                tags = read_tags(path, None)
                if len(tags) != 1:
                    v.append(f"[mix] {path} mixes {sorted(tags)}")
            except Exception as e:
                v.append(f"[load] {path}: {type(e).__name__}: {e}")
            if last and last["lineage"] == hist.state.head and m.step < last["step"]:
                v.append(
                    f"[lookup] lookup returned step {m.step}, older than step {last['step']}, which a save "
                    "returned in this lineage"
                )
    # Committed, not retired: present, verifies, matches its commit entry's digest.
    kept = 0
    kept_bytes = 0
    for c in hist.checkpoints.values():
        if c.txid in hist.retired:
            continue
        kept += 1
        kept_bytes += c.bytes
        key = r.publication.locate(c.ref)
        if key is None:
            v.append(f"[kept] committed {c.txid} (step {c.step}) is gone")
            continue
        try:
            mm = txckpt.verify_checkpoint(r.storage.full_path(key))
            if mm.digest != c.digest:
                v.append(f"[changed] {c.txid}'s manifest differs from its commit entry")
        except Exception as e:
            v.append(f"[changed] {c.txid} does not verify: {type(e).__name__}: {e}")
    # Every retire entry named only what the policy let go at that point of the log.
    h = saved["replay"] if saved else History()
    pol = _policy()
    for e in (e for e in hist.entries if e["seq"] > h.state.seq):
        if e.get("action") == "retire":
            allowed = {c.txid for c in pol.decide(h, now=float("inf"))}
            bad = [t for t in e["txids"] if t not in allowed]
            if bad:
                v.append(f"[retire] log entry {e['seq']} retired {bad}, which the policy kept at that point")
        h.apply(e)
    forks = len(hist.fork_points())
    if retained and kept > KEEP_LAST + forks:
        v.append(
            f"[bound] {kept} checkpoints are not retired after a completed retention; the policy keeps "
            f"{KEEP_LAST} + {forks} fork points"
        )
    # The next check needs only the entries after this one's (the replay is at hist's seq).
    hist.entries = []
    h.entries = []
    with open(memo + ".tmp", "wb") as f:
        pickle.dump({"hist": hist, "replay": h}, f)
    os.replace(memo + ".tmp", memo)
    used = _bytes(root)
    out = {
        "violations": v,
        "kept": kept,
        "forks": forks,
        "bytes": used,
        "kept_bytes": kept_bytes,
        "seq": hist.state.seq,
        "log_bytes": used - _bytes(root, skip_log=True),
        "snapshot": snapshots_used,
    }
    if full_gc:
        rep = collect_garbage(r, now=time.time() + 7200)
        for item in rep.errors:
            v.append(f"[gc] {item.key}: {item.error}")
        txckpt.forget_roots()
        r = CheckpointRoot(root)
        hist = r.history()
        v += leaks(r, hist, {})
        after = _bytes(root, skip_log=True)
        kept_now = sum(c.bytes for c in hist.checkpoints.values() if c.txid not in hist.retired)
        # Manifests (~1 KiB each), the hint: small change; staging or retired data would be whole checkpoints.
        if after > kept_now + 4096 * (kept + 1):
            v.append(f"[bound] after gc {after} bytes outside the log, but the kept checkpoints hold {kept_now}")
        out["bytes_after_gc"] = after
    return out


def _bytes(root: str, skip_log: bool = False) -> int:
    n = 0
    for d, _, files in os.walk(root):
        if skip_log and any(os.sep + ".txckpt" + os.sep + sub + os.sep in d + os.sep for sub in ("log", "snapshots")):
            continue
        for f in files:
            if skip_log and f == "reserve" and os.path.basename(d) == ".txckpt":
                continue  # .txckpt/reserve: fixed space held back for a full disk (protocol §11), not growth
            try:
                n += os.lstat(os.path.join(d, f)).st_size
            except FileNotFoundError:
                pass
    return n


def soak(ctx: Ctx, case: Case, result: Result) -> None:
    n = case.params["quick"] if ctx.quick else case.params["full"]
    root = os.path.join(ctx.workdir, "soak", "root")
    os.makedirs(os.path.dirname(root), exist_ok=True)
    memo = os.path.join(ctx.workdir, "soak-history.pickle")
    rnd = random.Random(ctx.seed + 7)
    found: list[str] = []
    last: dict[str, Any] | None = None
    stats = {"killed": 0, "saves_returned": 0, "forks": 0, "max_bytes": 0, "checks": 0, "gc_checks": 0}
    bound_note = ""
    for c in range(1, n + 1):
        kill = rnd.random() < 0.35
        kill_at = rnd.randint(1, 140) if kill else None
        when = rnd.choice(("before", "after"))
        rfd, wfd = os.pipe()
        seed = rnd.randrange(1 << 30)
        gc_now = c % 5 == 0

        def child(wfd=wfd, c=c, seed=seed, kill_at=kill_at, when=when, gc_now=gc_now):
            os.close(rfd)
            cycle(root, c, seed, kill_at, when, wfd, gc_now)
            return "done"

        pid_code, out = _run_with_pipe(child, rfd, wfd)
        code, lines = pid_code
        if code == -9:
            stats["killed"] += 1
        elif code != 0:
            found.append(f"cycle {c}: [cycle] the job failed: {out}")
        retained = False
        for ev in lines:
            if ev["event"] == "saved":
                stats["saves_returned"] += 1
                last = ev
            elif ev["event"] == "forked":
                stats["forks"] += 1
            elif ev["event"] == "retained":
                retained = True
        full = c % 5 == 0 or c == n
        ccode, verdict = run_child(lambda: check_cycle(root, last, full, retained, memo), timeout=300)
        stats["checks"] += 1
        if ccode != 0:
            found.append(f"cycle {c}: [harness] the check failed: {verdict and verdict.get('error')}")
            continue
        res = verdict["ok"]
        stats["max_bytes"] = max(stats["max_bytes"], res["bytes"])
        if full:
            stats["gc_checks"] += 1
        found += [f"cycle {c}: {x}" for x in res["violations"]]
        if c == n:
            bound_note = (
                f"end: {res['kept']} checkpoints kept ({res['forks']} fork points), "
                f"{res.get('bytes_after_gc', 0)} bytes outside the log after gc vs "
                f"{res['kept_bytes']} in kept checkpoints; the log has {res['seq'] + 1} entries, "
                f"{res['log_bytes']} bytes (never compacted: it grows with every save and rotation, "
                f"each entry of bounded size: the head lineage's record, protocol §4)"
            )
        if len(found) > 50:
            found.append("[harness] more than 50 violations: stopped")
            break
    result.tried = n
    result.points = n
    result.unit = "cycles"
    result.notes.append(
        f"{n} cycles: {stats['killed']} SIGKILLed at a random file op, {stats['saves_returned']} "
        f"saves returned, {stats['forks']} rollbacks (forks); {stats['checks']} fresh-process checks, "
        f"{stats['gc_checks']} with gc and the leak/bytes check; max {stats['max_bytes']} bytes on "
        f"disk between gcs. {bound_note}"
    )
    classify(result, found, case.known)


def _run_with_pipe(fn, rfd: int, wfd: int) -> tuple[tuple[int, list[dict]], Any]:
    """run_child, plus the JSON lines the child wrote to ``wfd`` (read after it exits)."""
    import threading

    chunks: list[bytes] = []

    def reader():
        while True:
            b = os.read(rfd, 65536)
            if not b:
                return
            chunks.append(b)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    code, out = run_child(fn, timeout=300)
    os.close(wfd)
    t.join(60)
    os.close(rfd)
    lines = [json.loads(ln) for ln in b"".join(chunks).decode().splitlines() if ln.strip()]
    return (code, lines), out


def cases() -> list[Case]:
    return [
        Case(
            "soak/local/save-rotate-kill",
            "soak",
            "save/rotate cycles (keep_last=3, abandoned TTL 0, gc every 5) with random SIGKILLs, restarts "
            "and rollbacks",
            "local",
            soak,
            cost=40,
            cost_full=900,
            params={"quick": 60, "full": 1000},
        )
    ]
