"""Ranks that disagree on what they save, through DCP (issue 29): two real gloo ranks each call
``dcp.save(sd, storage_writer=TransactionalWriter(root_r, step_r))`` with a step or a root of
their own (or rank 1 holding a lineage that rank 0's later one superseded). Was: both ranks
returned and were told one checkpoint that mixed two steps.

Each variant starts from a copy of a root with one committed DCP checkpoint (step 5) and checks,
from this (fresh) process: every rank raised; every rank got the same failures; the error is a
txckpt error (TransactionAbortedError) that says the ranks disagree; nothing was committed (the
root's history holds step 5 alone, the newest checkpoint is unchanged); nothing is left staged
(no intent, no transaction home besides committed checkpoints', in either root); and a save on
which the ranks agree then commits, with each rank's shard attributed to it.
"""

from __future__ import annotations

import os
import shutil

from .core import Case, Ctx, Result

#: name -> (steps of ranks 0 and 1, rank 1 saves into another root, extra launch arguments)
VARIANTS: dict[str, tuple[list[int], bool, dict]] = {
    "step-higher": ([6, 7], False, {}),
    "root": ([6, 6], True, {}),
    "step-lower": ([7, 6], False, {}),
    "step-planner-drops-storage-data": ([6, 7], False, {"planner": "drops-storage-data"}),
    "lineage": ([6, 6], False, {"new_lineages": (1, 0)}),
}
QUICK = ("step-higher",)


def _staged(root: str) -> tuple[list[str], list[str]]:
    def ls(d: str) -> list[str]:
        d = os.path.join(root, ".txckpt", d)
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    return ls("intents"), ls("tx")


def _variant(ctx: Ctx, template: str, name: str) -> list[str]:
    import txckpt
    from tests.children import dcp_workers as cw
    from tests.harness import launcher

    steps, other_root, extra = VARIANTS[name]
    root, other = ctx.path(name, "root"), ctx.path(name, "other")
    shutil.copytree(template, root, symlinks=True)
    run = launcher.launch(
        2,
        cw.expect_error_per_rank,
        ctx.path(name, "run"),
        deadline=180,
        roots=[root, other if other_root else root],
        steps=steps,
        seed=6,
        **extra,
    )
    bad = [
        f"rank {r.rank}: exit {r.exitcode}, {r.error_type}: {(r.error or '')[:300]}"
        for r in run.results
        if r.exitcode != 0 or r.error_type is not None
    ]
    if bad:
        return [f"[{name}] a rank failed outside DCP's CheckpointException: {'; '.join(bad)}"]
    got = [r.ok for r in run.results]
    out = []
    if any(g is None for g in got):
        out.append(
            f"[{name}] rank(s) {[i for i, g in enumerate(got) if g is None]} returned: the save "
            f"went through although the ranks saved steps {steps}" + (" into two roots" if other_root else "")
        )
    elif got[0] != got[1]:
        out.append(f"[{name}] the ranks got different failures: {got}")
    else:
        kinds = {tuple(v)[0] for v in got[0].values()}
        messages = [tuple(v)[1] for v in got[0].values()]
        if kinds != {"TransactionAbortedError"} or not all("ranks disagree" in m for m in messages):
            out.append(f"[{name}] not the typed disagreement error: {got[0]}")
    txckpt.forget_roots()
    ever = txckpt.CheckpointRoot(root).checkpoints("all")
    if [c.step for c in ever] != [5]:
        out.append(f"[{name}] committed: the root's history holds steps {[c.step for c in ever]}, not [5]")
    last = txckpt.get_last_checkpoint(root)
    if name != "lineage" and last != os.path.join(root, "checkpoint-5"):
        out.append(f"[{name}] the newest checkpoint is {last}, not checkpoint-5")
    intents, homes = _staged(root)
    if intents or not set(homes) <= {c.txid for c in ever}:
        out.append(f"[{name}] left staged: intents {intents}, transaction homes {homes}")
    if os.path.isdir(other) and (
        _staged(other) != ([], []) or any(n.startswith("checkpoint-") for n in os.listdir(other))
    ):
        out.append(f"[{name}] rank 1's root {other} holds {sorted(os.listdir(other))}, {_staged(other)}")
    after = launcher.launch(2, cw.save, ctx.path(name, "after"), deadline=180, root=root, step=8)
    if any(r.exitcode != 0 or r.error_type for r in after.results):
        return out + [f"[{name}] the next save, on which the ranks agree, failed: {after.describe()}"]
    path = after.results[0].ok["path"]
    m = txckpt.read_manifest(path)
    shards = {n: e.rank for n, e in m.files.items() if n.endswith(".distcp")}
    if m.step != 8 or shards != {"__0_0.distcp": 0, "__1_0.distcp": 1} or txckpt.get_last_checkpoint(root) != path:
        out.append(f"[{name}] the next save committed {path} (step {m.step}, shards {shards})")
    return out


def dcp_disagreement(ctx: Ctx, case: Case, result: Result) -> None:
    from tests.children import dcp_workers as cw
    from tests.harness import launcher

    from .core import classify

    result.unit = "disagreements"
    template = ctx.path("template")
    base = launcher.launch(2, cw.baseline, ctx.path("template-run"), deadline=180, root=template, step=5)
    if any(r.exitcode != 0 or r.error_type for r in base.results):
        raise RuntimeError(f"the template save failed: {base.describe()}")
    found: list[str] = []
    for name in QUICK if ctx.quick else tuple(VARIANTS):
        found += _variant(ctx, template, name)
        result.tried += 1
        result.points += 1
    result.notes.append(f"variants: {', '.join(QUICK if ctx.quick else VARIANTS)} (2 gloo ranks each)")
    classify(result, found, case.known)


def cases() -> list[Case]:
    return [
        Case(
            "badinput/ranks/dcp-disagreement",
            "badinput",
            "2 gloo ranks' dcp.save through TransactionalWriter with a step, a root or a lineage of their own "
            "(quick: a higher step; full: also another root, a lower step, a planner that drops storage_data, "
            "a superseded lineage): every rank raises the same typed error, nothing is committed or staged, "
            "the next agreeing save commits",
            "local",
            dcp_disagreement,
            cost=50.0,
        )
    ]
