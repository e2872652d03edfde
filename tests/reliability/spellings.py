"""One root, many spellings (issue 29, item 2), for the concurrency campaign.

A job reaches its root through several names at once: the real directory, a symlink to it, the
symlink with a trailing slash, a relative path (local); ``s3://b/root``, ``s3://b/root/`` and
``s3://b//root`` (S3). Within one process they are one root: saves through any name are one
writer (no name shuts another out with StaleLineageError), a lookup or a synchronous save through
one name waits for the pending async save of another, and every path comes back in the name it
was asked in. Across processes the fences still hold whatever name each uses: a restart through
one name makes the old job's save through another a stale writer, and a restart SIGKILLed just
before its commit leaves nothing committed that the next restart, through a third name, sees.
"""

from __future__ import annotations

import os
from typing import Any

from tests.harness.procs import child_value

from .actors import Actor, op_resume, op_save
from .core import Case, Ctx, Result, classify
from .invariants import check, snapshot


def _spellings(ctx: Ctx, backend: str) -> tuple[str, dict | None, list[str]]:
    """(the root as the checker opens it, storage options, the names the job uses)."""
    if backend == "local":
        base = os.path.join(ctx.workdir, "spellings")
        real = os.path.join(base, "data", "root")
        os.makedirs(real)
        link = os.path.join(base, "root-link")
        os.symlink(real, link, target_is_directory=True)
        return real, None, [real, link, link + "/", os.path.relpath(real), os.path.join(real, "..", "root", ".")]
    from . import s3

    s3.apply_fake_env()
    bucket = f"spell-{abs(hash(ctx.workdir)) % 10**10}"
    s3.client(ctx.s3_endpoint).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/root"
    names = [url + "/", f"s3://{bucket}//root"]  # quick: the checker's name is the third
    return url, s3.storage_options(ctx.s3_endpoint), names if ctx.quick else [url, *names]


def _norm(p: str) -> str:
    return p.rstrip("/") if "://" in p else os.path.abspath(p)


def _in_spelling(path: str | None, name: str) -> bool:
    return path is not None and _norm(path).startswith(_norm(name) + "/")


def op_async_then_lookup(state: dict, a: str, b: str, step: int, tag: str, so: dict | None) -> tuple:
    """async_save through ``a``, then at once get_last_checkpoint through ``b``."""
    import txckpt

    from .core import payload
    from .invariants import read_tags

    future = txckpt.async_save(a, step, payload(tag, step), storage_options=so)
    last = txckpt.get_last_checkpoint(b, storage_options=so)
    return future.result(), last, sorted(read_tags(last, so)) if last else None


def op_async_then_save(state: dict, a: str, b: str, step: int, tags: tuple[str, str], so: dict | None) -> tuple:
    """async_save of ``step`` through ``a``, then at once a synchronous save of ``step + 1``
    through ``b``; returns both paths (or the error of either)."""
    import txckpt

    from .core import payload

    future = txckpt.async_save(a, step, payload(tags[0], step), storage_options=so)
    try:
        sync: Any = txckpt.save_checkpoint(b, step + 1, payload(tags[1], step + 1), storage_options=so)
    except Exception as e:  # noqa: BLE001 - reported as a violation
        sync = f"{type(e).__name__}: {e}"
    try:
        background: Any = future.result()
    except Exception as e:  # noqa: BLE001
        background = f"{type(e).__name__}: {e}"
    return background, sync


def op_lineages(state: dict, root: str, so: dict | None) -> int:
    import txckpt

    return len(txckpt.open_root(root, so).history().state.lineages)


def one_root_many_spellings(ctx: Ctx, case: Case, result: Result) -> None:
    root, so, names = _spellings(ctx, case.backend)
    found: list[str] = []
    points = 0
    step = 0
    with Actor("job") as job:
        for i, a in enumerate(names):
            b = names[(i + 1) % len(names)]
            step += 1
            out = job.call(op_save, a, step, f"J-{step}", so)
            points += 1
            if out[0] != "ok":
                found.append(
                    f"[spelling] save of step {step} through {a!r} after saves through other names of the "
                    f"root: {out[1]}: {out[2]}"
                )
            elif not _in_spelling(out[1], a):
                found.append(f"[spelling] a save through {a!r} returned {out[1]!r}, not a path in that spelling")
            step += 1
            out = job.call(op_async_then_lookup, a, b, step, f"J-{step}", so)
            points += 1
            if out[0] != "ok":
                found.append(f"[spelling] async_save through {a!r}, then a lookup through {b!r}: {out[1]}: {out[2]}")
            else:
                saved, last, tags = out[1]
                if tags != [f"J-{step}"]:
                    found.append(
                        f"[spelling] a lookup through {b!r} right after async_save of step {step} through "
                        f"{a!r} returned {last!r} (tags {tags}), not the pending save"
                    )
                if not _in_spelling(saved, a) or not _in_spelling(last, b):
                    found.append(
                        f"[spelling] paths not in the spelling asked: async_save through {a!r} gave "
                        f"{saved!r}, the lookup through {b!r} gave {last!r}"
                    )
            step += 2
            out = job.call(op_async_then_save, a, b, step - 1, (f"J-{step - 1}", f"J-{step}"), so)
            points += 1
            if out[0] != "ok" or not all(_in_spelling(p, n) for p, n in zip(out[1], (a, b))):
                found.append(
                    f"[spelling] async_save of step {step - 1} through {a!r}, then a synchronous save of "
                    f"{step} through {b!r}: {out[1:3] if out[0] != 'ok' else out[1]}"
                )
        lineages = job.value(op_lineages, names[-1], so)
        if lineages != 1:
            found.append(f"[spelling] one job saving through {len(names)} names of its root made {lineages} lineages")
        # The fence across processes, whatever name each uses: a restart takes the lineage over.
        with Actor("restart") as restart:
            restart.value(op_resume, names[1], None, so)
            step += 1
            restart.value(op_save, names[0], step, f"R-{step}", so)
            out = job.call(op_save, names[2 % len(names)], step + 1, f"J-{step + 1}", so)
            points += 1
            if out[0] != "err" or out[1] != "StaleLineageError":
                found.append(
                    f"[spelling] the replaced job's save through {names[2 % len(names)]!r} after its restart "
                    f"resumed through {names[1]!r}: expected StaleLineageError, {out[:3]}"
                )
            # The restart is SIGKILLed just before the commit of a save through another name.
            restart.pause("txckpt._save.transactions:append_commit")
            restart.send(op_save, names[-1], step + 1, f"K-{step + 1}", so)
            assert restart.wait()[0] == "paused"
            restart.kill()
        points += 1
    before = child_value(lambda: snapshot(root, so), "snapshot")
    with Actor("restart-2") as again:
        out = again.call(op_resume, names[-1], None, so)
        points += 1
        if out[0] != "ok" or not _in_spelling(out[1], names[-1]):
            found.append(f"[spelling] the second restart's resume through {names[-1]!r}: {out[:3]}")
        out = again.call(op_save, names[1], step + 1, f"A-{step + 1}", so)
        if out[0] != "ok":
            found.append(f"[spelling] the second restart's save of step {step + 1} through {names[1]!r}: {out[:3]}")
    found += [
        f"after the restarts: {v}"
        for v in child_value(
            lambda: check(root, so, {"allowed": [f"A-{step + 1}"], "before": before}), "checking the root"
        )
    ]
    result.tried, result.points, result.unit = len(names), points, "calls"
    classify(result, found, case.known)


def concurrency_cases() -> list[Case]:
    return [
        Case(
            f"concurrency/{backend}/one-root-many-spellings",
            "concurrency",
            "one job saving and looking up through several names of its root (a symlink, a trailing "
            "slash, a relative path; S3 URL spellings), async beside sync; restarts through other "
            "names, one SIGKILLed before its commit",
            backend,
            one_root_many_spellings,
            cost=30 if backend == "s3" else 5,
            cost_full=50 if backend == "s3" else 10,
            needs_s3=backend == "s3",
        )
        for backend in ("local", "s3")
    ]
