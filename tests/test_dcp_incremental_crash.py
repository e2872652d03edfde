"""Crash sweep of incremental DCP saves (issue 30: incremental save x gc x retention x rollback
fork): 2 real gloo ranks save through ``TransactionalWriter(incremental=True)``, sharing tensor
files with committed checkpoints, and one rank is SIGKILLed before or after one of its file
operations (local root) or S3 requests (moto). After each kill, fresh ranks check
(tests/children/dcp_incremental_crash.py): every committed checkpoint of every lineage verifies,
the newest is the previous one or (only if its commit entry was written) the new one and loads
bit-exact through TransactionalReader, gc deletes no byte a committed manifest references, a
retry of the save commits and loads bit-exact at 2 ranks, and retention that retires every
checkpoint but the retry (among them the ones that first held the bytes it shares) leaves it
whole.

Scenarios:
* ``save``: steps 1, 2 committed; the killed job saves step 3 (the base shared with both,
  adapter.0 changed: packed into each rank's file 0; adapter.1 equal to step 2's, which step 2
  packed: written in a file of its own, to be shared from then on);
* ``fork+retention``: steps 1, 2, 3 committed (step 3's adapter.1 equal to step 2's: a file of
  its own); the killed job rolls back to step 1 (a fork) and re-saves step 2 with adapter.1
  equal to the abandoned step 3's (its file shared with the lineage it abandons) and adapter.0
  new; then its rank 0 retires every checkpoint but the new one (keep_last=1,
  abandoned ones at once), so the kill also lands inside that retention.

The campaign samples each rank's points: every point around the commit entry and the publication,
and a draw of the others (``DRAWN`` per rank, seeded by the run's sweep seed and printed in the
summary line, so that coverage accumulates across runs: tests/harness/sampling.py); on S3, rank
0's writes only (a point costs ~13 s there). ``TXCKPT_DCP_FULL_SWEEP=1`` (or
``TXCKPT_FULL_SWEEP=1``) runs every point of both ranks (tests/test_dcp_crash.py's switch)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from tests import conftest
from tests.children import dcp_incremental_crash as ic
from tests.harness import launcher, sampling
from tests.harness.tracer import occurrences

FULL = os.environ.get("TXCKPT_DCP_FULL_SWEEP") == "1" or sampling.FULL
# A full sweep (every point of both ranks) is an offline run: the fork+retention one passed 30 min.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(10800 if FULL else 1800)]
#: Ops of a sampled victim drawn besides the commit-critical ones (each tried before and after):
#: rank 1 has none of those (it never commits), rank 0 the commit entry and the publication.
DRAWN = {1: 2, 0: 1}
#: Ops around which the outcome flips: the commit entry, the publication (local, S3).
CRITICAL = ("link(<root>/.txckpt/log/", "rename_noreplace(", "PutObject(if-none-match) .txckpt/log/")

SCENARIOS = {
    # shares: the committed checkpoint the killed save links its shared files from (local).
    # first_holder: the template checkpoint (index among its steps) that first held bytes the save
    # shares, which the retention after the retry must be able to delete: step 1 (the base), or the
    # abandoned step 3 (adapter.1; retention keeps step 1 there, the new lineage's fork point).
    # template_seeds: {step: seeds} of the template's saves.
    "save": {
        "template": [1, 2],
        "template_seeds": {},
        "step": 3,
        "seeds": {"adapter.1": 2},
        "prev": 2,
        "resume_step": None,
        "retention": False,
        "shares": "checkpoint-2/",
        "first_holder": 0,
    },
    # adapter.0 of its own (the bytes of no committed step), adapter.1 the abandoned step 3's (its
    # file of its own there); the fork moved the abandoned checkpoints back to their homes
    # (.txckpt/tx/<txid>/checkpoint-N).
    "fork+retention": {
        "template": [1, 2, 3],
        "template_seeds": {"3": {"adapter.1": 2}},
        "step": 2,
        "seeds": {"adapter.0": 20, "adapter.1": 2},
        "prev": 1,
        "resume_step": 1,
        "retention": True,
        "shares": ".txckpt/tx/<id>/checkpoint-3/",
        "first_holder": -1,
    },
}


class Root:
    """Where a sweep's roots live: copies of one template, each a directory or an S3 prefix."""

    def __init__(self, tmp_path, s3: tuple[str, dict] | None = None):
        self.tmp, self.s3 = tmp_path, s3
        self.so = s3[1] if s3 else None
        #: The template's committed txids: a checkpoint not among them is the killed save's.
        self.before: list[str] = []

    def url(self, name: str) -> str:
        return f"{self.s3[0]}-{name}" if self.s3 else str(self.tmp / name)

    def prefix(self, url: str) -> str:
        return url.split("://", 1)[1].split("/", 1)[1] if self.s3 else ""

    def copy(self, src: str, name: str) -> str:
        dst = self.url(name)
        if self.s3:
            import s3fs

            fs = s3fs.S3FileSystem(**self.so)
            fs.copy(src, dst, recursive=True)  # server-side copies
        else:
            shutil.copytree(src, dst, symlinks=True)  # copies: a template's hard links stay its own
        return dst

    def remove(self, url: str) -> None:
        if self.s3:
            import s3fs

            s3fs.S3FileSystem(**self.so).rm(url, recursive=True)
        else:
            shutil.rmtree(url, ignore_errors=True)


def _committed_by(done: list[str]) -> bool:
    """Rank 0 commits by writing the log entry (a link locally, a conditional put on S3)."""
    return any(op.startswith(("link(<root>/.txckpt/log/", "PutObject(if-none-match) .txckpt/log/")) for op in done)


def _points(ops: list[list], backend: str) -> list[tuple[str, int]]:
    """The ops a kill is worth trying at, as (name, occurrence). S3 reads change nothing: a kill
    before or after one leaves what the previous write left. Locally, what a rank does outside
    the root (torch's temp files, named by an absolute path: the root's own are ``<root>/...``)
    is no point of the save; retention's deletions, made relative to a directory descriptor
    (``unlink(__1_9.distcp)``), are."""
    named = occurrences([name for name, _ in ops])
    return [p for p, (name, mut) in zip(named, ops) if (mut if backend == "s3" else "(/" not in name)]


def _chosen(ops: list[list], victim: int, backend: str, sweep: str) -> list[tuple[tuple[str, int], str]]:
    chosen = sampling.sample(
        f"{sweep}:rank{victim}",
        _points(ops, backend),
        lambda p: p[0].startswith(CRITICAL),
        full=FULL,
        share=0.0,
        at_least=DRAWN[victim],
        ends=False,
    )
    return [(p, w) for p in chosen for w in ("before", "after")]


def _kill_once(where: Root, template: str, sc: dict, victim: int, point, when: str, tag: str, backend: str) -> dict:
    for attempt in range(3):
        t = f"{tag}-{attempt}"
        root = where.copy(template, f"root-{t}")
        label = str(where.tmp / f"label-{t}.json")
        run = launcher.launch(
            2,
            ic.killed_save,
            str(where.tmp / f"res-{t}"),
            deadline=120,
            root=root,
            step=sc["step"],
            seeds=sc["seeds"],
            victim=victim,
            kill_at=point,
            when=when,
            backend=backend,
            prefix=where.prefix(root),
            resume_step=sc["resume_step"],
            retention=sc["retention"],
            storage_options=where.so,
            label_file=label,
        )
        hit = json.load(open(label)) if os.path.exists(label) else None
        if hit is not None or not all(r.exitcode == 0 for r in run.results):
            break
        where.remove(root)  # the op did not occur in this run (ranks race): try again
    else:
        return {"problems": [], "unreached": True}
    problems = []
    if not run[victim].killed or hit is None:
        problems.append(f"victim not killed at its op: {run.describe()}")
    survivor = run[1 - victim]
    if survivor.hung:
        problems.append(f"rank {survivor.rank} hung")
    after = launcher.launch(
        2,
        ic.after_kill,
        str(where.tmp / f"after-{tag}"),
        deadline=180,
        root=root,
        before=where.before,
        prev_step=sc["prev"],
        new_step=sc["step"],
        seeds=sc["seeds"],
        storage_options=where.so,
    )
    if not all(r.exitcode == 0 and r.error_type is None for r in after.results):
        problems.append(f"the checks after the kill failed: {after.describe()}")
        out = {"committed": None}
    else:
        out = after[0].ok
        problems += after[0].ok["violations"] + after[1].ok["violations"]
    if victim == 1 and out["committed"]:
        problems.append("committed although rank 1 died before its report reached the coordinator")
    if victim == 0 and hit is not None and out["committed"] is not None:
        done = hit["done"][:-1] if backend == "s3" and when == "before" else hit["done"]  # S3: the op is listed
        if out["committed"] != _committed_by(done):
            problems.append(
                f"committed={out['committed']}, but rank 0 had "
                f"{'' if _committed_by(done) else 'not '}written the commit entry"
            )
    first_holder_deleted = _data_deleted(root, where.so, where.before[sc["first_holder"]])
    where.remove(root)
    return {
        "problems": problems,
        "unreached": False,
        "committed": out["committed"],
        "first_holder_deleted": first_holder_deleted,
    }


def _data_deleted(root: str, so: dict | None, txid: str) -> bool:
    """Whether checkpoint ``txid`` (the one that first held bytes the save shares) was retired and
    its data deleted: a stale lease of the killed save (docs/incremental.md) defers that deletion,
    so not every point gets that far."""
    import txckpt
    from txckpt._root.root import open_root

    txckpt.forget_roots()
    return any(
        c.txid == txid and c.state == "retired" and c.path is None for c in open_root(root, so).checkpoints("all")
    )


def _sweep(where: Root, scenario: str, backend: str, victims=(1, 0)) -> str:
    sc = SCENARIOS[scenario]
    template = where.url(f"template-{scenario}")
    launcher.launch(
        2,
        ic.saves,
        str(where.tmp / f"res-template-{scenario}"),
        root=template,
        steps=sc["template"],
        storage_options=where.so,
        seeds=sc["template_seeds"],
    ).oks()
    where.before = [c.txid for c in ic._committed(template, where.so)]
    t0 = time.monotonic()
    points = unreached = commits = first_holder_deleted = 0
    violations: list[str] = []
    counted = {}
    for victim in victims:
        root = where.copy(template, f"count-{scenario}-{victim}")
        ops_file = str(where.tmp / f"ops-{scenario}-{victim}.json")
        launcher.launch(
            2,
            ic.killed_save,
            str(where.tmp / f"res-count-{scenario}-{victim}"),
            deadline=180,
            root=root,
            step=sc["step"],
            seeds=sc["seeds"],
            victim=victim,
            kill_at=None,
            when="before",
            backend=backend,
            prefix=where.prefix(root),
            resume_step=sc["resume_step"],
            retention=sc["retention"],
            storage_options=where.so,
            ops_file=ops_file,
        ).oks()
        ops = json.load(open(ops_file))
        counted[victim] = (
            f"{len(ops)} ops ({len(_points(ops, backend))} {'writes' if backend == 's3' else 'in the root'})"
        )
        names = [name for name, _ in ops]
        # The save shares committed files: a link (local) or a server-side copy (S3) is among its ops;
        # locally, the save scenario also writes a tensor's file of its own (adapter.1, which stopped
        # changing), not only the packed __<rank>_0.
        assert any(n.startswith((f"link(<root>/{sc['shares']}", "CopyObject")) for n in names), names
        assert (
            backend == "s3"
            or scenario != "save"
            or any(
                n.startswith("open(<root>/.txckpt/tx/") and n.endswith(".distcp, wb)") and "_0.distcp" not in n
                for n in names
            )
        ), names
        where.remove(root)
        for i, (point, when) in enumerate(_chosen(ops, victim, backend, f"dcp-incremental:{scenario}:{backend}")):
            out = _kill_once(where, template, sc, victim, point, when, f"{scenario}-{victim}-{i}-{when}", backend)
            if out["unreached"]:
                unreached += 1
                continue
            points += 1
            commits += bool(out["committed"])
            first_holder_deleted += out["first_holder_deleted"]
            violations += [f"rank {victim} {when} {point[0]} #{point[1]}: {p}" for p in out["problems"]]
    line = (
        f"incremental DCP crash sweep [{scenario}, {backend}, "
        f"{'full' if FULL else f'sampled, seed {sampling.sweep_seed()}'}]: rank 1 "
        f"{counted.get(1, '-')}, rank 0 {counted.get(0, '-')}; {points} crash points "
        f"({unreached} not reached in 3 runs), {commits} left the new checkpoint committed, retention after "
        f"the retry deleted the first holder of the shared bytes at {first_holder_deleted}, {len(violations)} "
        f"violations, {time.monotonic() - t0:.0f} s"
    )
    print(line)
    conftest.SUMMARY_LINES.append(line)
    assert not violations, "\n".join(violations[:20])
    assert unreached == 0, line
    assert commits > 0, line  # rank 0 dying after its commit entry leaves the new checkpoint
    assert first_holder_deleted > 0, line  # the retry outlived the deletion of the bytes' first home
    return line


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_incremental_dcp_crash_sweep_local(tmp_path, scenario):
    _sweep(Root(tmp_path), scenario, "local")


@pytest.mark.s3
def test_incremental_dcp_crash_sweep_s3(tmp_path, s3_root):
    _sweep(Root(tmp_path, s3_root), "save", "s3", victims=(1, 0) if FULL else (0,))  # ~13 s a point
