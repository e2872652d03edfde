"""Concurrent adoption of a legacy root ("Trust at the edges", item 1), for two campaigns.

Every round starts from a fresh copy of one legacy root (``checkpoint-10/20/30`` written by a
stock Trainer, no ``.txckpt``) and runs two processes on it: ``txckpt adopt`` twice, the same
first save (step 40) launched twice, or one of each. The invariant: whatever the interleaving and
whoever is SIGKILLed, the adopted checkpoints stay committed, intact and locatable, lookup returns
the newest of them (or the committed step 40), no legacy byte changes, a restarted job resumes and
saves, and gc reclaims what a killed process left and deletes nothing it must keep (invariants.py).

* :func:`concurrency_rounds` (concurrency campaign): real processes (actors.py) interleaved
  through pauses inside txckpt: released together, both paused once they hashed the directories
  and then released in a random order, or one paused at a random point of its adoption (after
  hashing, after its k-th manifest, after listing the other adopters, before or after entry 0)
  and SIGKILLed there while the other runs to completion.
* :func:`crash_rounds` (crash campaign): both processes released together by one event; one of
  them is SIGKILLed by the fault injector at a random one of its file operations (injectors.py),
  the other runs to completion.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
from typing import Any

from tests.harness.procs import child_value, run_child

from .core import Case, Ctx, Result, classify, write_legacy
from .invariants import check

PAIRS = (("adopt", "adopt"), ("save", "save"), ("adopt", "save"))
#: The outcomes a copy of the same job may see when the other copy won (a save's loser).
EXPECTED_ERRORS = ("StaleLineageError", "ConcurrentWriterError", "StepConflictError")
LEGACY_STEPS = (10, 20, 30)

#: (function, when, nth) where a victim is paused and SIGKILLed.
KILL_POINTS = (
    ("txckpt._root.adoption:plan_adoption", "after", 1),
    ("txckpt._root.adoption:_create_or_match", "after", 1),
    ("txckpt._root.adoption:_create_or_match", "after", 2),
    ("txckpt._root.adoption:_create_or_match", "after", 3),
    ("txckpt._root.adoption:_other_live_adopters", "after", 1),
    ("txckpt._root.adoption:_append_adopt_entry", "before", 1),
    ("txckpt._root.adoption:_append_adopt_entry", "after", 1),
    ("txckpt._save.transactions:append_commit", "before", 1),
)


def op_run(state: dict, root: str, mode: str, tag: str, so: dict | None = None) -> Any:
    """One copy of the job: ``txckpt adopt`` (mode "adopt") or its first save of step 40."""
    import txckpt
    from txckpt._root.root import CheckpointRoot

    from .core import payload

    if mode == "adopt":
        return CheckpointRoot(root, so).adopt()
    return txckpt.save_checkpoint(root, 40, payload(f"{tag}-40", 40), storage_options=so)


def _legacy_root(ctx: Ctx, backend: str, name: str) -> tuple[str, dict | None, dict[str, str]]:
    """A fresh legacy root (checkpoint-10/20/30 of a stock Trainer); returns (url, options, the
    legacy files as {key: base64})."""
    from .concurrency import _root

    url, so = _root(ctx, backend, name)

    def build() -> dict[str, str]:
        from txckpt._storage import open_storage

        st = open_storage(url, so)
        out = {}
        for s in LEGACY_STEPS:
            out.update(write_legacy(st, f"checkpoint-{s}", f"L-{s}", s))
        return {k: base64.b64encode(v).decode() for k, v in out.items()}

    return url, so, child_value(build, f"building legacy root {name}")


def _template(ctx: Ctx) -> tuple[str, dict[str, str]]:
    template = os.path.join(ctx.workdir, "template")

    def build() -> dict[str, str]:
        from txckpt._storage import open_storage

        os.makedirs(template)
        st = open_storage(template)
        out = {}
        for s in LEGACY_STEPS:
            out.update(write_legacy(st, f"checkpoint-{s}", f"L-{s}", s))
        return {k: base64.b64encode(v).decode() for k, v in out.items()}

    return template, child_value(build, "building the legacy template")


def _verdict(
    root: str, legacy: dict[str, str], modes: tuple[str, str], label: str, so: dict | None = None
) -> list[str]:
    allowed = [f"L-{LEGACY_STEPS[-1]}"] + [f"{n}-40" for n, m in zip("ab", modes) if m == "save"]
    code, out = run_child(lambda: check(root, so, {"allowed": allowed, "before": {}, "legacy": legacy}), timeout=300)
    if code != 0 or not out or "ok" not in out:
        return [f"{label}: [harness] the checker failed: {out and out.get('error')}"]
    return [f"{label}: {v}" for v in out["ok"]]


def _outcome_problems(label: str, name: str, out: tuple) -> list[str]:
    if out[0] == "ok" or (out[0] == "err" and out[1] in EXPECTED_ERRORS):
        return []
    return [f"{label}: [adopt] {name} got {out[1]}: {str(out[2])[:300]}"]


# ----- the concurrency campaign ------------------------------------------------------------------
def concurrency_rounds(ctx: Ctx, case: Case, result: Result) -> None:
    from .actors import Actor

    backend = case.backend
    # every (pair, style) combination once per 9 rounds
    rounds = (9 if ctx.quick else 63) if backend == "local" else (3 if ctx.quick else 18)
    rnd = random.Random(ctx.seed)
    found: list[str] = []
    styles: dict[str, int] = {}
    killed = 0
    actors = {"a": Actor("a"), "b": Actor("b")}
    try:
        for i in range(rounds):
            modes = PAIRS[i % 3]
            style = ("together", "paused-after-hashing", "kill")[(i + i // 3) % 3]
            styles[style] = styles.get(style, 0) + 1
            root, so, legacy = _legacy_root(ctx, backend, f"adopt-round-{i}")
            label = f"round {i} ({modes[0]}+{modes[1]}, {style})"
            for n in "ab":
                if not actors[n].proc.is_alive():
                    actors[n] = Actor(n)
            a, b = actors["a"], actors["b"]
            outs: dict[str, tuple] = {}
            if style == "together":
                a.send(op_run, root, modes[0], "a", so)
                b.send(op_run, root, modes[1], "b", so)
                outs = {"a": a.wait(), "b": b.wait()}
            elif style == "paused-after-hashing":
                spec = "txckpt._root.adoption:plan_adoption"
                for x, m in zip((a, b), modes):
                    x.pause(spec, "after")
                    x.send(op_run, root, m, x.name, so)
                    got = x.wait()
                    if got[0] != "paused":
                        found.append(f"{label}: [harness] {x.name} did not reach {spec}: {got}")
                first, second = (a, b) if rnd.random() < 0.5 else (b, a)
                first.go()
                second.go()
                outs = {first.name: first.wait(), second.name: second.wait()}
                for x in (a, b):
                    x.unpause(spec)
            else:
                victim, survivor = (a, b) if rnd.random() < 0.5 else (b, a)
                vmode, smode = (modes[0], modes[1]) if victim is a else (modes[1], modes[0])
                spec, when, nth = rnd.choice(KILL_POINTS)
                label += f", {victim.name} ({vmode}) SIGKILLed {when} {spec.split(':')[1]} #{nth}"
                victim.pause(spec, when, nth)
                victim.send(op_run, root, vmode, victim.name, so)
                got = victim.wait()
                survivor.send(op_run, root, smode, survivor.name, so)
                outs[survivor.name] = survivor.wait()
                if got[0] == "paused":
                    victim.kill()
                    killed += 1
                else:  # it finished before that point (it lost early): nothing to kill
                    outs[victim.name] = got
                    victim.unpause(spec)
            for n, o in outs.items():
                found += _outcome_problems(label, n, o)
            found += _verdict(root, legacy, modes, label, so)
            if so is None:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        for x in actors.values():
            x.stop()
    result.tried, result.points, result.unit = rounds, rounds, "rounds"
    result.notes.append(
        f"{rounds} rounds over adopt+adopt, save+save, adopt+save: "
        + ", ".join(f"{v} {k}" for k, v in styles.items())
        + f"; {killed} victims SIGKILLed at their pause point, the others finished before it "
        "(they lost early)"
    )
    classify(result, found, case.known)


# ----- the crash campaign ------------------------------------------------------------------------
def _one(root: str, mode: str, tag: str, go: Any, kill_at: int | None, when: str, out_path: str) -> None:
    """A child: wait for ``go``, run one copy of the job, under the injector (counting, or
    SIGKILLing itself at op ``kill_at``); write the outcome (or the op list) to ``out_path``."""
    import json
    import logging

    import txckpt

    from .injectors import make_injector

    logging.getLogger("txckpt").propagate = False
    txckpt.forget_roots()
    go.wait(120)
    inj = make_injector("local", kill_at=kill_at, when=when, under=root).install()
    try:
        op_run({}, root, mode, tag)
        out: dict[str, Any] = {"outcome": ["ok"]}
    except Exception as e:
        out = {"outcome": ["err", type(e).__name__, str(e)]}
    finally:
        inj.uninstall()
    out["ops"] = len(inj.ops)
    with open(out_path, "w") as f:
        json.dump(out, f)


def _pair(root: str, modes: tuple[str, ...], kill: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """Run the copies ("a", "b") released together; ``kill``: name -> (op, when). Returns name ->
    {"exit", "outcome", "ops"}."""
    import json
    import multiprocessing

    mp = multiprocessing.get_context("fork")
    go = mp.Event()
    procs = {}
    for n, m in zip("ab", modes):
        k, w = kill.get(n, (None, "before"))
        procs[n] = (mp.Process(target=_one, args=(root, m, n, go, k, w, f"{root}.{n}.json")), f"{root}.{n}.json")
        procs[n][0].start()
    go.set()
    res = {}
    for n, (p, path) in procs.items():
        p.join(300)
        if p.is_alive():
            p.kill()
            p.join(10)
        try:
            with open(path) as f:
                res[n] = dict(json.load(f), exit=p.exitcode)
            os.unlink(path)
        except FileNotFoundError:
            res[n] = {"exit": p.exitcode, "outcome": None, "ops": None}
    return res


def crash_rounds(ctx: Ctx, case: Case, result: Result) -> None:
    rounds = 6 if ctx.quick else 63
    rnd = random.Random(ctx.seed)
    template, legacy = _template(ctx)
    # How many file operations each kind of job makes alone (the kill point is drawn below it;
    # with a concurrent peer a job may make fewer, and then completes: checked all the same).
    counts = {}
    for mode in ("adopt", "save"):
        root = os.path.join(ctx.workdir, f"count-{mode}")
        shutil.copytree(template, root)
        counts[mode] = _pair(root, (mode,), {})["a"]["ops"]
        shutil.rmtree(root, ignore_errors=True)
    found: list[str] = []
    killed = 0
    for i in range(rounds):
        modes = PAIRS[i % 3]
        victim = rnd.choice("ab")
        vmode = modes["ab".index(victim)]
        k, when = rnd.randint(1, counts[vmode]), rnd.choice(("before", "after"))
        root = os.path.join(ctx.workdir, f"round-{i}")
        shutil.copytree(template, root)
        label = f"round {i} ({modes[0]}+{modes[1]}, {victim} SIGKILLed {when} op {k}/{counts[vmode]})"
        res = _pair(root, modes, {victim: (k, when)})
        for n, r in res.items():
            if n == victim and r["exit"] == -9:
                killed += 1
                continue
            if r["exit"] != 0 or r["outcome"] is None:
                found.append(f"{label}: [harness] {n} exited {r['exit']}")
                continue
            found += _outcome_problems(label, n, tuple(r["outcome"]))
        found += _verdict(root, legacy, modes, label)
        shutil.rmtree(root, ignore_errors=True)
    result.tried, result.points, result.unit = rounds, rounds, "rounds"
    result.notes.append(
        f"{rounds} rounds over adopt+adopt, save+save, adopt+save; alone, an adoption makes "
        f"{counts['adopt']} file ops and a first save {counts['save']}; {killed} victims were "
        f"SIGKILLed at their drawn op, the others finished first (fewer ops beside a peer)"
    )
    classify(result, found, case.known)


def concurrency_cases() -> list[Case]:
    return [
        Case(
            f"concurrency/{backend}/adoption-race",
            "concurrency",
            "two processes adopt one legacy root (adopt+adopt, save+save, adopt+save): released together, "
            "paused after hashing, or one SIGKILLed at a pause point",
            backend,
            concurrency_rounds,
            cost=25 if backend == "s3" else 10,
            cost_full=150 if backend == "s3" else 60,
            needs_s3=backend == "s3",
        )
        for backend in ("local", "s3")
    ]


def crash_cases() -> list[Case]:
    return [
        Case(
            "crash/local/adoption-race",
            "crash",
            "two processes adopt one legacy root (adopt+adopt, save+save, adopt+save), one SIGKILLed at a "
            "random file op",
            "local",
            crash_rounds,
            cost=25,
            cost_full=250,
        )
    ]
