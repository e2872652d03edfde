"""Campaign 3: concurrency, with real processes (actors.py) and no sleeps.

* **Two writers on one root**: a zombie beside an operator's rollback; a zombie beside its
  restart (which resumes the newest checkpoint); the same command launched twice; two writers
  racing to commit the same step (released together from a pause just before the commit). The
  stale writer must get a clear error, never commit into the current lineage, and nothing may be
  lost.
* **Readers polling** while a writer saves and rotates (keep_last=2, gc every 5 saves): every
  lookup must return a committed checkpoint that loads and verifies, holds one save's files, is
  never older than a save that returned before the lookup began, and never goes backwards. A
  reader that loses a race with the deletion of the checkpoint it looked up must get a typed
  error (txckpt gives unleased readers no grace period, docs/retention.md).
* **Rotation vs a reader that announced itself** (txckpt._maintenance.retention reader leases): a leased
  checkpoint must not be deleted while the reader loads it; plus two interleavings, forced with
  pauses, in which it is.
* **gc beside a live writer**: its staging is kept.
"""

from __future__ import annotations

import os
from typing import Any

from tests.harness.procs import child_value

from .actors import (
    Actor,
    op_gc,
    op_lease,
    op_leases,
    op_load_first,
    op_load_rest,
    op_lookup,
    op_release,
    op_resume,
    op_retention,
    op_save,
)
from .core import Case, Ctx, Result, classify, tags_of_loaded
from .invariants import check, snapshot


def _root(ctx: Ctx, backend: str, name: str) -> tuple[str, dict | None]:
    if backend == "local":
        return os.path.join(ctx.workdir, name, "root"), None
    from . import s3

    s3.apply_fake_env()
    c = s3.client(ctx.s3_endpoint)
    bucket = f"conc-{abs(hash((ctx.workdir, name))) % 10**10}"
    c.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/root", s3.storage_options(ctx.s3_endpoint)


def _final_check(root: str, so: dict | None, allowed: list, before: dict, label: str) -> list[str]:
    out = child_value(lambda: check(root, so, {"allowed": allowed, "before": before}), f"checking {label}")
    return [f"{label}: {v}" for v in out]


def _snap(root: str, so: dict | None) -> dict:
    return child_value(lambda: snapshot(root, so), "snapshot")


def _err(out: tuple) -> str:
    return f"{out[1]}: {out[2]}" if out[0] == "err" else f"returned {out[1]!r}"


# ----- two writers ------------------------------------------------------------------------------
def zombie_after_rollback(ctx: Ctx, case: Case, result: Result) -> None:
    backend = case.backend
    root, so = _root(ctx, backend, "rollback")
    found: list[str] = []
    with Actor("zombie") as z, Actor("operator") as op:
        z.value(op_save, root, 2, "A-2", so)
        z.value(op_save, root, 4, "A-4", so)
        # The zombie's next save is staged and about to commit when the operator rolls back.
        z.pause("txckpt._save.transactions:append_commit")
        z.send(op_save, root, 6, "A-6", so)
        assert z.wait()[0] == "paused"
        op.value(op_resume, root, 2, so)
        op.value(op_save, root, 4, "B-4", so)
        before = _snap(root, so)
        z.go()
        out = z.wait()
        if out[0] != "err" or out[1] != "StaleLineageError":
            found.append(
                f"[zombie] the zombie's in-flight save after a rollback: expected StaleLineageError, {_err(out)}"
            )
        z.unpause("txckpt._save.transactions:append_commit")
        out = z.call(op_save, root, 8, "A-8", so)
        if out[0] != "err" or out[1] != "StaleLineageError":
            found.append(f"[zombie] the zombie's next save after a rollback: expected StaleLineageError, {_err(out)}")
        elif "Nothing was committed or lost" not in out[2]:
            found.append(f"[zombie] StaleLineageError does not say what happened: {out[2]}")
    found += _final_check(root, so, ["B-4"], before, "after the zombie")
    result.tried, result.points, result.unit = 1, 2, "interleavings"
    classify(result, found, case.known)


def zombie_beside_restart(ctx: Ctx, case: Case, result: Result) -> None:
    """The restart resumes the newest checkpoint (resume_from_checkpoint=True, or
    txckpt.resume(root)), as a job scheduler's restart does, while the old job still runs."""
    backend = case.backend
    root, so = _root(ctx, backend, "restart")
    found: list[str] = []
    points = 0
    with Actor("zombie") as z, Actor("restart") as r:
        z.value(op_save, root, 2, "Z-2", so)
        z.value(op_save, root, 4, "Z-4", so)
        # (a) in flight: the zombie's save of 6 is staged when the restart takes over.
        z.pause("txckpt._save.transactions:append_commit")
        z.send(op_save, root, 6, "Z-6", so)
        assert z.wait()[0] == "paused"
        r.value(op_resume, root, None, so)
        r.value(op_save, root, 6, "R-6", so)
        z.go()
        out = z.wait()
        points += 1
        if out[0] != "err" or out[1] not in ("StaleLineageError", "ConcurrentWriterError", "StepConflictError"):
            found.append(
                f"[zombie] the zombie's in-flight save of step 6 after its restart saved 6: expected a "
                f"clear error, {_err(out)}"
            )
        z.unpause("txckpt._save.transactions:append_commit")
        # (b) the zombie's next save, a step the restart has not reached yet.
        before = _snap(root, so)
        out = z.call(op_save, root, 8, "Z-8", so)
        points += 1
        if out[0] == "ok":
            found.append(
                "[zombie] the stale writer (the job its restart replaced) committed step 8 into the "
                "current lineage, after the restart resumed it and saved step 6"
            )
        elif out[1] != "StaleLineageError":
            found.append(f"[zombie] the zombie's next save: expected StaleLineageError, {_err(out)}")
        out = r.call(op_save, root, 8, "R-8", so)
        points += 1
        if out[0] != "ok":
            found.append(
                f"[zombie] the restarted job's save of step 8 was refused ({_err(out)}): the zombie took "
                "its place in the lineage"
            )
    allowed = ["R-8", "Z-8"]
    found += _final_check(root, so, allowed, before, "after zombie and restart")
    result.tried, result.points, result.unit = 1, points, "interleavings"
    classify(result, found, case.known)


def same_command_twice(ctx: Ctx, case: Case, result: Result) -> None:
    """Two copies of one job start on an empty root and save steps 2, 4, 6 in lockstep; each
    first save is paused just before its commit, then both are released."""
    backend = case.backend
    found: list[str] = []
    points = 0
    for order in ("ab", "ba"):
        root, so = _root(ctx, backend, f"twice-{order}")
        with Actor("a") as a, Actor("b") as b:
            actors = {"a": a, "b": b}
            for x in actors.values():
                x.pause("txckpt._save.transactions:append_commit")
                x.send(op_save, root, 2, f"{x.name}-2", so)
                assert x.wait()[0] == "paused"
            outs = {}
            for name in order:
                actors[name].go()
                outs[name] = actors[name].wait()
                actors[name].unpause("txckpt._save.transactions:append_commit")
            points += 1
            winners = [n for n, o in outs.items() if o[0] == "ok"]
            if len(winners) != 1:
                found.append(f"[twice] order {order}: {len(winners)} of the two first saves committed: {outs}")
                continue
            loser = "b" if winners[0] == "a" else "a"
            if outs[loser][1] not in ("StaleLineageError", "ConcurrentWriterError", "StepConflictError"):
                found.append(f"[twice] order {order}: the loser got {_err(outs[loser])}")
            # Both jobs go on (a training loop that logs the failed save and continues).
            for step in (4, 6):
                for name in order:
                    out = actors[name].call(op_save, root, step, f"{name}-{step}", so)
                    points += 1
                    if name == loser and out[0] == "ok":
                        found.append(
                            f"[twice] order {order}: the copy whose first save lost ({loser}) committed "
                            f"step {step} into the lineage of the other"
                        )
            before = _snap(root, so)
        found += _final_check(root, so, [f"{winners[0]}-6"], before, f"same command twice ({order})")
    result.tried, result.points, result.unit = 2, points, "interleavings"
    classify(result, found, case.known)


def race_same_step(ctx: Ctx, case: Case, result: Result) -> None:
    """Two writers of one lineage stage the same step and are released together at the commit:
    exactly one commits, the other gets a clear error, and its staging is removed."""
    backend = case.backend
    rounds = 3 if ctx.quick else 10
    found: list[str] = []
    root, so = _root(ctx, backend, "race")
    with Actor("a") as a, Actor("b") as b:
        a.value(op_save, root, 1, "a-1", so)
        b.value(op_resume, root, None, so)
        step = 2
        for i in range(rounds):
            for x in (a, b):
                x.value(op_resume, root, None, so)  # both follow the newest (as restarts do)
                x.pause("txckpt._save.transactions:append_commit")
                x.send(op_save, root, step, f"{x.name}-{step}", so)
                assert x.wait()[0] == "paused"
            first, second = (a, b) if i % 2 == 0 else (b, a)
            first.go()
            second.go()  # both race for the log entry
            outs = {first.name: first.wait(), second.name: second.wait()}
            for x in (a, b):
                x.unpause("txckpt._save.transactions:append_commit")
            wins = [n for n, o in outs.items() if o[0] == "ok"]
            if len(wins) != 1:
                found.append(f"[race] step {step}: {len(wins)} writers committed: {outs}")
            for n, o in outs.items():
                if o[0] == "err" and o[1] not in ("ConcurrentWriterError", "StepConflictError", "StaleLineageError"):
                    found.append(f"[race] step {step}: the loser {n} got {_err(o)}")
            step += 1
        before = _snap(root, so)
        last = a.value(op_lookup, root, so)
    tag = child_value(
        lambda: sorted(__import__("tests.reliability.invariants", fromlist=["x"]).read_tags(last, so)), "tags"
    )[0]
    found += _final_check(root, so, [tag], before, "after the races")
    result.tried, result.points, result.unit = 1, rounds, "races"
    classify(result, found, case.known)


# ----- readers while a writer saves and rotates -------------------------------------------------
def op_poll(state: dict, root: str, so: dict | None, max_iters: int) -> dict[str, Any]:
    import txckpt
    from txckpt.errors import TxckptError

    stop, last = state["inherit"]["stop"], state["inherit"]["last"]
    stats: dict[str, Any] = {"iters": 0, "loaded": 0, "none": 0, "lost_race": 0, "violations": []}
    prev = -1
    state["inherit"]["first"].wait(600)  # start polling once the writer's first save returned
    v = stats["violations"]
    while not stop.is_set() and stats["iters"] < max_iters:
        stats["iters"] += 1
        floor = last.value
        try:
            path = txckpt.get_last_checkpoint(root, storage_options=so)
        except Exception as e:
            v.append(f"[reader] lookup raised {type(e).__name__}: {e}")
            continue
        if path is None:
            stats["none"] += 1
            if floor >= 1:
                v.append(f"[reader] lookup returned None after step {floor} was saved")
            continue
        try:
            m = txckpt.read_manifest(path, storage_options=so)
            data = txckpt.load_checkpoint(path, storage_options=so)
        except TxckptError as e:
            # Typed. Why: retired and deleted between the lookup and the load, or moved (published
            # from its home to checkpoint-N) after the lookup returned its home path.
            try:
                from txckpt._root.root import CheckpointRoot

                r = CheckpointRoot(root, so)
                h = r.history()
                t = next(
                    (
                        c
                        for c in h.checkpoints.values()
                        if path.rstrip("/").endswith(f"checkpoint-{c.step}")
                        and (c.txid in path or f"checkpoint-{c.step}" == path.rstrip("/").rsplit("/", 1)[-1])
                    ),
                    None,
                )
                moved = "/.txckpt/tx/" in path and t is not None and t.txid not in h.retired
            except Exception:
                moved = False
            if moved:
                stats["moved"] = stats.get("moved", 0) + 1
                if stats["moved"] <= 3:
                    v.append(
                        f"[reader] the home path lookup returned moved (published) before the load, which "
                        f"then failed: {type(e).__name__}: {e}"[:400]
                    )
            else:
                stats["lost_race"] += 1
            continue
        except Exception as e:
            v.append(f"[reader] loading {path} raised an untyped {type(e).__name__}: {e}")
            continue
        stats["loaded"] += 1
        tags = tags_of_loaded(data)
        if tags != {f"W-{m.step}"}:
            v.append(f"[reader] {path} (step {m.step}) holds {sorted(tags)}")
        if m.step < floor:
            v.append(f"[reader] lookup returned step {m.step} after step {floor} had been saved")
        if m.step < prev:
            v.append(f"[reader] lookup went backwards: step {prev}, then {m.step}")
        prev = max(prev, m.step)
        if len(v) > 20:
            break
    return stats


def op_write_loop(state: dict, root: str, so: dict | None, n: int) -> int:
    stop, last = state["inherit"]["stop"], state["inherit"]["last"]
    try:
        for s in range(1, n + 1):
            op_save(state, root, s, f"W-{s}", so)
            last.value = s
            state["inherit"]["first"].set()
            op_retention(state, root, 2, so)
            if s % 5 == 0:
                op_gc(state, root, so)
    finally:
        state["inherit"]["first"].set()
        stop.set()
    return n


def readers_polling(ctx: Ctx, case: Case, result: Result) -> None:
    import multiprocessing

    backend = case.backend
    n = (30 if backend == "local" else 10) if ctx.quick else (200 if backend == "local" else 25)
    root, so = _root(ctx, backend, "poll")
    mp = multiprocessing.get_context("fork")
    inherit = {"stop": mp.Event(), "first": mp.Event(), "last": mp.Value("i", 0)}
    found: list[str] = []
    readers = [Actor(f"reader{i}", inherit=inherit, timeout=1800) for i in range(2)]
    writer = Actor("writer", inherit=inherit, timeout=1800)
    try:
        for r in readers:
            r.send(op_poll, root, so, 1_000_000)
        writer.send(op_write_loop, root, so, n)
        wout = writer.wait()
        if wout[0] != "ok":
            found.append(f"[writer] the writer failed: {_err(wout)}")
        stats = [r.wait() for r in readers]
    finally:
        for a in readers + [writer]:
            a.stop()
    tot = {"iters": 0, "loaded": 0, "lost_race": 0, "none": 0, "moved": 0}
    for s in stats:
        if s[0] != "ok":
            found.append(f"[reader] a reader failed: {_err(s)}")
            continue
        for k in tot:
            tot[k] += s[1].get(k, 0)
        found += s[1]["violations"]
    before = _snap(root, so)
    found += _final_check(root, so, [f"W-{n}"], before, "after polling")
    result.tried = 1
    result.points = tot["iters"]
    result.unit = "reader lookups"
    result.notes.append(
        f"{n} saves with keep_last=2 rotation and gc every 5; 2 readers: {tot['iters']} lookups, "
        f"{tot['loaded']} loads verified, {tot['lost_race']} lost a race with a deletion (typed "
        f"error), {tot['moved']} got a typed error because the home path lookup returned was "
        f"published (renamed) before the load, {tot['none']} found nothing"
    )
    classify(result, found, case.known)


def reader_outpaced(ctx: Ctx, case: Case, result: Result) -> None:
    """The readers-polling race made to happen every time: a reader reads the log (the tip is
    step 3), then is held between that request and its next while the writer saves 4 and 5,
    rotates (keep_last=2: 3 is retired and deleted) and runs gc. Released, its lookup must
    return a committed checkpoint that loads (or raise a typed error), never None."""
    backend = case.backend
    root, so = _root(ctx, backend, "outpaced")
    found: list[str] = []
    spec = "txckpt._log.log:read_state"
    with Actor("writer") as w, Actor("reader") as r:
        for s in (1, 2, 3):
            w.value(op_save, root, s, f"W-{s}", so)
            w.value(op_retention, root, 2, so)
        r.pause(spec, when="after")
        r.send(op_lookup, root, so)
        assert r.wait() == ("paused", spec)
        for s in (4, 5):
            w.value(op_save, root, s, f"W-{s}", so)
            w.value(op_retention, root, 2, so)
        w.value(op_gc, root, so)
        r.go()
        out = r.wait()
        r.unpause(spec)
        if out[0] == "ok" and out[1] is None:
            found.append(
                "[reader] lookup returned None after step 5 was saved (its first read of the log "
                "saw step 3, which rotation then deleted)"
            )
        elif out[0] == "err" and not out[4]:
            found.append(f"[reader] lookup raised an untyped {out[1]}: {out[2]}")
        elif out[0] == "ok":
            tags = child_value(
                lambda: sorted(__import__("tests.reliability.invariants", fromlist=["x"]).read_tags(out[1], so)), "tags"
            )
            if tags != ["W-5"]:
                found.append(f"[reader] lookup returned {out[1]} holding {tags}, not the newest save W-5")
    result.tried, result.points, result.unit = 1, 1, "interleavings"
    classify(result, found, case.known)


# ----- rotation vs readers that announced themselves --------------------------------------------
def leased_reader(ctx: Ctx, case: Case, result: Result) -> None:
    backend = case.backend
    root, so = _root(ctx, backend, "lease")
    found: list[str] = []
    with Actor("writer") as w, Actor("reader") as r:
        path = w.value(op_save, root, 1, "W-1", so)
        txid = r.value(op_lease, root, path, True, so)
        r.value(op_load_first, path, so)
        for s in (2, 3, 4):
            w.value(op_save, root, s, f"W-{s}", so)
            w.value(op_retention, root, 1, so)
        w.value(op_gc, root, so)
        out = r.call(op_load_rest, so)
        if out[0] != "ok":
            found.append(f"[lease] a checkpoint under a reader lease could not be loaded after rotation: {_err(out)}")
        r.value(op_release, root, so)
        w.value(op_retention, root, 1, so)  # the lease kept it from being retired; now it goes
        gone = child_value(
            lambda: (
                __import__("txckpt")
                .CheckpointRoot(root, so)
                .locate(__import__("txckpt").CheckpointRoot(root, so).history().checkpoints[txid].ref)
                is None
            ),
            "locate",
        )
        if not gone:
            found.append("[lease] the released checkpoint was not deleted by the next rotation")
    result.tried, result.points, result.unit = 1, 1, "interleavings"
    classify(result, found, case.known)


def lease_during_deletion(ctx: Ctx, case: Case, result: Result) -> None:
    """Rotation has appended its retire entry and read the leases; the reader takes its lease (as
    docs/retention.md shows: acquire, then read); rotation deletes. Expected: the lease is refused
    (CheckpointNotFoundError) and not left behind; a granted lease must keep the checkpoint."""
    backend = case.backend
    root, so = _root(ctx, backend, "lease-race")
    found: list[str] = []
    with Actor("writer") as w, Actor("reader") as r:
        paths = [w.value(op_save, root, s, f"W-{s}", so) for s in (1, 2, 3)]
        # finish_retired's read of the leases is the second read_leases of apply_retention.
        w.pause("txckpt._maintenance.retention:read_leases", "after", nth=2)
        w.send(op_retention, root, 1, so)
        assert w.wait()[0] == "paused"
        out = r.call(op_lease, root, paths[1], False, so)
        if out[0] == "ok":
            found.append(
                "[lease] acquire_reader_lease granted a lease on checkpoint step 2 although a retire "
                "entry already named it (its deletion had begun)"
            )
            r.call(op_load_first, paths[1], so)
            w.go()
            w.wait()
            out = r.call(op_load_rest, so)
            if out[0] != "ok":
                found.append(
                    f"[lease] rotation deleted checkpoint step 2 while a reader that had announced itself "
                    f"(lease taken before the deletion) was loading it: {_err(out)}"
                )
        else:
            # Refused, as documented: the reader does not read a checkpoint it could not lease.
            if out[1] != "CheckpointNotFoundError":
                found.append(
                    f"[lease] a lease on a retired checkpoint was refused with {_err(out)}, not CheckpointNotFoundError"
                )
            w.go()
            out = w.wait()
            if out[0] != "ok":
                found.append(f"[lease] the rotation failed after a refused lease: {_err(out)}")
            left = r.value(op_leases, root, so)
            if left:
                found.append(f"[lease] a refused lease was left behind (it keeps gc from deleting): {left}")
    result.tried, result.points, result.unit = 1, 1, "interleavings"
    classify(result, found, case.known)


def lease_three_parties(ctx: Ctx, case: Case, result: Result) -> None:
    """A careful reader (lease, then re-check that the checkpoint is not retired, then load);
    rotation P (a trainer's apply_retention) decides before the lease and retires after it;
    finisher D (another apply_retention, e.g. `txckpt gc --keep-last`) read the leases before the
    lease and the retired set after P's retire entry."""
    backend = case.backend
    root, so = _root(ctx, backend, "lease3")
    found: list[str] = []
    with Actor("writer") as w, Actor("reader") as r, Actor("finisher") as d:
        paths = [w.value(op_save, root, s, f"W-{s}", so) for s in (1, 2, 3)]
        d.pause("txckpt._maintenance.retention:read_leases", "after", nth=2)
        d.send(op_retention, root, 100, so)  # keeps everything; its finish_retired deletes retired data
        assert d.wait()[0] == "paused"
        w.pause("txckpt._maintenance.retention:read_leases", "after", nth=1)  # P has decided
        w.send(op_retention, root, 1, so)
        assert w.wait()[0] == "paused"
        out = r.call(op_lease, root, paths[1], True, so)
        if out[0] != "ok":
            found.append(f"[harness] the careful reader's lease was refused: {_err(out)}")
        r.call(op_load_first, paths[1], so)
        w.go()
        w.wait()  # P retires 1 and 2, sees the lease, deletes only 1
        d.go()
        d.wait()  # D deletes 2
        out = r.call(op_load_rest, so)
        if out[0] != "ok":
            found.append(
                f"[lease] rotation deleted checkpoint step 2 while a reader holding a lease (taken, and "
                f"re-checked, before the retire entry) was loading it: {_err(out)}"
            )
    result.tried, result.points, result.unit = 1, 1, "interleavings"
    classify(result, found, case.known)


def gc_beside_live_writer(ctx: Ctx, case: Case, result: Result) -> None:
    backend = case.backend
    root, so = _root(ctx, backend, "gc-live")
    found: list[str] = []
    with Actor("writer") as w, Actor("gc") as g:
        w.value(op_save, root, 1, "W-1", so)
        w.pause("txckpt._save.transactions:append_commit")
        w.send(op_save, root, 2, "W-2", so)
        assert w.wait()[0] == "paused"
        for grace in (3600.0, 0.0):
            items = g.value(op_gc, root, so, grace)
            staged = [k for kind, k in items if kind == "staging"]
            if staged:
                found.append(f"[gc] gc (grace {grace:.0f} s) removed the staging of a live writer: {staged}")
        w.go()
        out = w.wait()
        if out[0] != "ok":
            found.append(f"[gc] the live writer's save failed after gc ran: {_err(out)}")
        before = _snap(root, so)
    found += _final_check(root, so, ["W-2"], before, "after gc beside a writer")
    result.tried, result.points, result.unit = 1, 2, "interleavings"
    classify(result, found, case.known)


def cases() -> list[Case]:
    out = []
    for backend in ("local", "s3"):
        s3 = backend == "s3"
        out += [
            Case(
                f"concurrency/{backend}/zombie-after-rollback",
                "concurrency",
                "a zombie writer (staged, and next save) after an operator's rollback",
                backend,
                zombie_after_rollback,
                cost=6 if s3 else 3,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/zombie-beside-restart",
                "concurrency",
                "a zombie writer beside its restart, which resumed the newest checkpoint",
                backend,
                zombie_beside_restart,
                known=(),
                cost=6 if s3 else 3,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/same-command-twice",
                "concurrency",
                "the same job launched twice on an empty root, first saves racing",
                backend,
                same_command_twice,
                cost=8 if s3 else 4,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/race-same-step",
                "concurrency",
                "two writers of one lineage released together at the commit of the same step",
                backend,
                race_same_step,
                cost=10 if s3 else 4,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/readers-polling",
                "concurrency",
                "2 readers polling lookup+load while a writer saves, rotates (keep_last=2) and runs gc",
                backend,
                readers_polling,
                cost=40 if s3 else 25,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/reader-outpaced",
                "concurrency",
                "a reader held between its read of the log and its read of the tip while the writer "
                "saves, rotates the tip away (keep_last=2) and runs gc",
                backend,
                reader_outpaced,
                cost=4 if s3 else 2,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/leased-reader",
                "concurrency",
                "a reader holding a lease loads while rotation and gc run; gc deletes after the release",
                backend,
                leased_reader,
                cost=6 if s3 else 3,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/lease-during-deletion",
                "concurrency",
                "a reader leases (acquire, then read, as documented) between rotation's read of the leases "
                "and its deletion",
                backend,
                lease_during_deletion,
                cost=5 if s3 else 2,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/lease-three-parties",
                "concurrency",
                "a reader that leases and re-checks; one rotation retires after the lease, another deletes "
                "with a lease list read before it",
                backend,
                lease_three_parties,
                cost=5 if s3 else 2,
                needs_s3=s3,
            ),
            Case(
                f"concurrency/{backend}/gc-beside-live-writer",
                "concurrency",
                "gc (grace 3600 s and 0 s) while a writer's staging waits for its commit",
                backend,
                gc_beside_live_writer,
                cost=5 if s3 else 2,
                needs_s3=s3,
            ),
        ]
    from .adoption import concurrency_cases
    from .spellings import concurrency_cases as spelling_cases

    return out + concurrency_cases() + spelling_cases()
