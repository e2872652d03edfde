"""get_last_checkpoint on a root with many commits across many lineages, against transformers'
get_last_checkpoint (listdir + regex) on a directory with as many checkpoint-N directories."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from . import harness as h

TITLE = "Lookup"


def _shape() -> tuple[int, int]:
    s = h.settings()
    if s.tiny:
        return 60, 3
    if s.quick:
        return 1000, 10
    return 10_000, 50


def _stamp(commits: int, lineages: int) -> dict[str, Any]:
    from txckpt._log import log as commit_log
    from txckpt._manifest import manifest

    # The snapshot format too: a root built before txckpt-snapshot/3 has no snapshot every
    # SNAPSHOT_EVERY commits, and would measure the old writer, not the reader.
    return {
        "commits": commits,
        "lineages": lineages,
        "log": commit_log.FORMAT,
        "manifest": manifest.FORMAT,
        "snapshot": commit_log.SNAPSHOT_FORMAT,
    }


def build_root(path: str, commits: int, lineages: int) -> dict[str, Any]:
    """Through the real API: ``CheckpointRoot.save`` of one tiny file per commit (durable=False),
    and ``resume(step=...)`` forks (a rollback of half a lineage) between lineages."""
    from txckpt import CheckpointRoot

    per = commits // lineages
    logger = logging.getLogger("txckpt")
    level = logger.level
    logger.setLevel(logging.ERROR)  # every fork warns about the checkpoints it abandons
    t0 = time.perf_counter()
    try:
        root = CheckpointRoot(path, durable=False)
        step = 0
        for lin in range(lineages):
            if lin:
                step -= per // 2
                root.resume(step=step)
            for _ in range(per):
                step += 1
                root.save(step, {"trainer_state.json": {"global_step": step}})
    finally:
        logger.setLevel(level)
    return {"tip": step, "build_s": time.perf_counter() - t0}


def _cached_root(commits: int, lineages: int) -> tuple[str, dict[str, Any]]:
    import txckpt

    base = os.path.join(h.settings().cache, f"lookup-root-{commits}x{lineages}")
    stamp_file = base + ".json"
    want = _stamp(commits, lineages)
    if os.path.exists(stamp_file) and os.path.isdir(base):
        with open(stamp_file) as f:
            stamp = json.load(f)
        if {k: stamp.get(k) for k in want} == want:
            txckpt.forget_roots()
            try:
                last = txckpt.get_last_checkpoint(base)
            except Exception as e:  # a cache built by an older txckpt, or damaged: build it again
                h.log(f"lookup: the cached root is unusable ({type(e).__name__}: {e}); rebuilding it")
                last = None
            if last and last.endswith(f"checkpoint-{stamp['tip']}"):
                stamp["cached"] = True
                return base, stamp
    shutil.rmtree(base, ignore_errors=True)
    h.log(f"lookup: building a root of {commits} commits across {lineages} lineages (cached afterwards)")
    info = build_root(base, commits, lineages)
    stamp = {**want, **info}
    with open(stamp_file, "w") as f:
        json.dump(stamp, f)
    stamp["cached"] = False
    return base, stamp


def _fresh_process(code: list[str]) -> None:
    """A fresh interpreter running ``code`` (``-m txckpt ls ROOT`` or ``-c ...``) with this
    checkout's txckpt: imports included, as a user at a shell sees it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, *code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=here
    )


def _history_rows(big: str, big_stamp: dict[str, Any], label: str, reps: int) -> list[dict[str, Any]]:
    """Fresh-process `txckpt ls ROOT` and `resume(root, step=tip-3)` (a rollback, on a fresh copy
    of the root each time, copied untimed) on the big root against the same on a root of 50
    commits in one lineage: history costs nothing when the ratio is near 1."""
    from txckpt._cli.views import LS_DEFAULT_COUNT

    small, small_stamp = _cached_root(50, 1)
    scratch = h.fresh_dir("lookup-history")

    def ls(root: str) -> h.Method:
        return h.Method(root, lambda _ctx: _fresh_process(["-m", "txckpt", "ls", root]), settle=False)

    def resume(root: str, stamp: dict[str, Any]) -> h.Method:
        copy = os.path.join(scratch, os.path.basename(root))

        def setup() -> None:
            h.remove(copy)
            shutil.copytree(root, copy, symlinks=True)

        code = (
            "import logging, txckpt; logging.getLogger('txckpt').setLevel(logging.ERROR); "
            f"txckpt.resume({copy!r}, step={stamp['tip'] - 3})"
        )
        return h.Method(
            root,
            lambda _ctx: _fresh_process(["-c", code]),
            setup=setup,
            cleanup=lambda _ctx: h.remove(copy),
            settle=False,
        )

    ls_times = h.interleave([ls(big), ls(small)], reps, warmup=1)
    resume_times = h.interleave([resume(big, big_stamp), resume(small, small_stamp)], reps, warmup=1)
    h.remove(scratch)
    against = f"{label} ÷ 50 commits / 1 lineage"
    return [
        h.compare(
            "`txckpt ls ROOT` in a fresh process: this root ÷ a root of 50 commits",
            against,
            ls_times,
            big,
            small,
            1.5,
            note=f"the same command on both: the {LS_DEFAULT_COUNT} most recently committed checkpoints "
            "(`--all` lists every one)",
        ),
        h.compare(
            "`txckpt.resume(root, step=tip-3)` (a rollback) in a fresh process: this root ÷ 50 commits",
            against,
            resume_times,
            big,
            small,
            1.5,
            note="a fresh copy of the root each time, copied untimed",
        ),
    ]


def _cached_plain(n: int) -> str:
    base = os.path.join(h.settings().cache, f"lookup-plain-{n}")
    if not (os.path.isdir(base) and len(os.listdir(base)) == n):
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        for i in range(1, n + 1):
            os.mkdir(os.path.join(base, f"checkpoint-{i}"))
    return base


def run(quick: bool) -> dict[str, Any]:
    import txckpt
    from transformers.trainer_utils import get_last_checkpoint as hf_last
    from txckpt import CheckpointRoot

    s = h.settings()
    commits, lineages = _shape()
    root, stamp = _cached_root(commits, lineages)
    plain = _cached_plain(commits)
    expected = os.path.join(root, f"checkpoint-{stamp['tip']}")

    def tx(_ctx):
        txckpt.forget_roots()  # as a fresh process: no cached root object or history
        got = txckpt.get_last_checkpoint(root)
        assert got == expected, (got, expected)

    def hf(_ctx):
        assert hf_last(plain) is not None

    def fold(_ctx):
        CheckpointRoot(root, durable=False).history()

    reps = 5 if s.tiny else (15 if s.quick else 41)
    times = h.interleave(
        [h.Method("txckpt", tx, settle=False), h.Method("transformers", hf, settle=False)], reps, warmup=2
    )
    fold_times = h.interleave(
        [h.Method("fold", fold, settle=False), h.Method("transformers", hf, settle=False)],
        3 if s.quick else 5,
        warmup=1,
    )
    label = f"{commits:,} commits / {lineages} lineages"
    rows = [
        h.compare(
            "txckpt.get_last_checkpoint ÷ transformers get_last_checkpoint", label, times, "txckpt", "transformers", 2.0
        ),
        {
            **h.compare(
                "CheckpointRoot.history() (fold of every log entry) ÷ transformers get_last_checkpoint",
                label,
                fold_times,
                "fold",
                "transformers",
                None,
            ),
            "note": "report only: what `resume(step=...)`, `txckpt ls` and retention read",
        },
    ]
    rows += _history_rows(root, stamp, label, 3 if s.tiny else (5 if s.quick else 7))
    log_dir = os.path.join(root, ".txckpt", "log")
    entries = sorted(os.listdir(log_dir))
    log_bytes = sum(os.path.getsize(os.path.join(log_dir, e)) for e in entries)
    largest = max(os.path.getsize(os.path.join(log_dir, e)) for e in entries)
    rows[1]["note"] += (
        f"; the log holds {len(entries):,} entries, {log_bytes / h.MiB:.1f} MiB: each entry carries "
        f"what its action changed and the head lineage's record ({largest / 1024:.1f} KiB the largest,"
        f" {os.path.getsize(os.path.join(log_dir, entries[-1])) / 1024:.1f} KiB the newest), and the "
        "fold starts from the newest history snapshot (protocol §4a)"
    )
    snap_dir = os.path.join(root, ".txckpt", "snapshots")
    snaps = sorted(os.listdir(snap_dir)) if os.path.isdir(snap_dir) else []  # (none under 100 entries)
    if snaps:
        rows[1]["note"] += (
            f"; the newest snapshot (txckpt-snapshot/3, one column per field) is "
            f"{os.path.getsize(os.path.join(root, '.txckpt', 'snapshots', snaps[-1])) / h.MiB:.2f} MiB"
        )
    built = "reused from the cache" if stamp.get("cached") else "built in this run"
    about = (
        f"The txckpt root holds {commits:,} commits across {lineages} lineages, {built} through the real "
        f"API ({stamp.get('build_s', 0):.0f} s, {1e3 * stamp.get('build_s', 0) / commits:.1f} ms per commit, "
        "durable=False): `CheckpointRoot.save` of one tiny file per step, and `resume(step=...)` rolling "
        "back half a lineage between lineages. The transformers directory holds as many empty "
        "`checkpoint-N` directories. Each txckpt lookup starts from a fresh root object "
        "(`txckpt.forget_roots()`, timed), as a restarted process does. Warm dentry cache on both sides. "
        "The two history rows run the same command in fresh interpreters (imports included, as at a "
        "shell) on this root and on a root of 50 commits in one lineage, built the same way, interleaved: "
        "`python -m txckpt ls ROOT` (its default listing) and `txckpt.resume(root, step=tip-3)`, a "
        "rollback that abandons three checkpoints, on a fresh copy of the root each time (copied untimed)."
    )
    return {"id": "lookup", "title": "get_last_checkpoint", "rows": rows, "about": about}
