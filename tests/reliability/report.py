"""docs/reliability.md from the campaign's results."""

from __future__ import annotations

import time

from .core import Result
from .known import FIXED, KNOWN

CAMPAIGNS = [
    (
        "crash",
        "1. Crash sweeps",
        "For each operation on each backend, a counting run lists the operation's storage operations; then a child "
        "process runs the operation on a fresh copy of the template root and is crashed at one of them, and a fresh "
        "process checks every invariant of docs/protocol.md section 12 (lookup returns a checkpoint a crash there may "
        "leave, of the head's view; it loads and verifies; nothing mixes two saves; every committed checkpoint is "
        "present and unchanged; retention retired only what its policy lets go), resumes and saves as a restarted "
        "job would, runs gc and checks that nothing leaked (staging, intents, temp files, retired data, names not "
        "reconciled). **Local**: SIGKILL before/after each Python-level file operation (open for writing, each write, "
        "fsync, link, rename, renameat2, unlink, mkdir, rmdir). **Memory** (fsspec's store lives in the writer's "
        "process): at the crash point the child dumps the store with raw os.write and SIGKILLs itself; the checker "
        "loads the dump (the state an in-process reader would see); the *memory-raise* rows instead raise a "
        "BaseException at op k (like KeyboardInterrupt) and let txckpt's error handling run. **S3**: SIGKILL before "
        "or after each HTTP request, hooked at aiobotocore's `AioEndpoint._send` (below s3fs's retries and txckpt's "
        "conditional-put client: *before* = never sent, *after* = the server answered). Quick mode keeps the points "
        "that leave distinct states (after each op, one per write run, at most 6 requests that change the bucket per S3 operation); "
        "full mode crashes before and after every op (on S3, every request that changes the bucket: around a GET the bucket is what it is around the neighbouring PUT). The Trainer row saves through a real TransactionalTrainer "
        "(tiny model, save_total_limit=1) forked from a parent that built it; torch.save and safetensors write from "
        "C code, so its points bracket those writes. The ranks row runs tests/test_distributed.py's own crash "
        "tests (gloo ranks as real processes, one SIGKILLed at a file operation, the survivors must raise and a fresh "
        "process checks the root): quick mode its 4-rank chosen points, full mode also its 2-rank sweep of every "
        "operation of both ranks. The async-atexit row runs real interpreters whose atexit handler makes the job's "
        "final async_save (a save of main still pending at exit), SIGKILLed before or after each of that save's "
        "file operations (quick mode: 6 sampled); unkilled, it must exit 0 with the save committed. Phases (staging, commit = manifest + log entry, publish, finish) are counted for "
        "the operations that save.",
    ),
    (
        "powerloss",
        "2. Simulated power loss",
        "ALICE/CrashMonkey style. A save (a first save, a fork + save) runs once on a real root while a recorder logs "
        "every file-system operation with its data (creates, writes with offsets, fsync of files and of directories, "
        "link, rename/renameat2, unlink, mkdir); replaying the log on a model of the pre-state must reproduce the "
        "real tree exactly. For a power cut after each op, crash states are built: data written after a file's last "
        "fsync may be lost, partly present or zero-filled; directory entries not covered by an fsync of their "
        "directory may be lost, in two models: **posix** (each directory keeps a prefix of its unsynced entry "
        "operations, independently: what POSIX guarantees) and **ordered** (one journal: a prefix of all metadata "
        "operations, and any fsync commits everything before it: ext4 data=ordered, xfs). Small spaces are explored "
        "exhaustively; larger ones through the systematic states (everything unsynced lost, all kept, each unit "
        "alone lost, each alone kept) plus a seeded random sample. Each state is written out and checked like a "
        "crash, plus durability: once the commit entry's link is followed by the fsync of log/, lookup must return "
        "the new checkpoint.",
    ),
    (
        "concurrency",
        "3. Concurrency",
        "Real processes driven step by step through queues (no sleeps): a test can pause one inside txckpt (just "
        "before its commit, just after retention read the leases) and release it when another process has acted. "
        "Two writers (zombies, the same job twice, racing commits), readers polling during saves with rotation, "
        "rotation against readers holding leases (txckpt._maintenance.retention implements reader leases), gc beside a live "
        "writer. Concurrent adoption of a legacy root (adopt+adopt, save+save, adopt+save): released together, both "
        "paused after hashing and released in a random order, or one paused at a random point of its adoption and "
        "SIGKILLed there (tests/reliability/adoption.py; the crash campaign's adoption-race row instead SIGKILLs one "
        "of the two at a random file operation).",
    ),
    (
        "badinput",
        "4. Bad input",
        "Each probe damages a copy of a root with two lineages (A: 2, 4, 6; rollback to 2; B: 4), then a fresh "
        "process looks up, loads what lookup returned, loads every committed checkpoint, runs gc and a restarted "
        "job's resume + save. A probe fails on an untyped exception, a silent wrong answer (content other than what "
        "was saved, or another checkpoint than the newest without a warning), or a committed file deleted. Flips "
        "XOR a byte with 0x01 (digits become other valid digits); full mode flips every byte of every JSON file.",
    ),
    (
        "soak",
        "5. Soak",
        "Restart after restart: each cycle is a new process that resumes (sometimes rolls back), saves, rotates "
        "(keep_last=3, abandoned TTL 0) and every fifth cycle runs gc; a third of the cycles are SIGKILLed at a "
        "random file operation. A fresh process checks the invariants after every cycle, and every fifth cycle "
        "runs gc and checks that the bytes on disk are those of the checkpoints retention keeps (plus the log).",
    ),
]


LIMITS = [
    "Process crashes run on tmpfs (/dev/shm): a SIGKILL loses no page cache, so fsync reaching a disk does not "
    "matter there, and fsync on this VM's disk (~8 ms) would make the sweeps ten times slower. Durability against "
    "power loss is campaign 2's subject, and it is modelled (crash states built from a recorded run), not "
    "provoked on hardware; its two models bound what real file systems do, they are not any one of them.",
    "Power loss is explored on local roots only: on S3 a request that returned is durable, and a crash there is "
    "a process crash (campaign 1).",
    "On local roots the injector sees Python-level file operations. Writes made inside C or Rust code (torch.save "
    "to a path, safetensors' save_file: the Trainer uses both) are not interposed; crash points before and "
    "after the neighbouring operations bracket them.",
    "The memory backend lives inside the writer's process: its crash points dump the store at the crash point "
    "and then SIGKILL (or raise at op k, the memory-raise rows).",
    "Ranks: quick mode runs tests/test_distributed.py's 4-rank chosen points; full mode adds its 2-rank sweep "
    "of every file operation of both ranks. Ranks crash on local roots only.",
    "GCS and Azure roots are not covered (their emulators are not installed here).",
    "Readers that do not take a lease get no grace period (docs/retention.md): one that loses a race with the "
    "deletion of the checkpoint it looked up gets a typed error; these are counted in the notes, not as "
    "violations.",
    "The commit log is never compacted: the soak's notes give its size, which grows with every save and "
    "rotation (each entry a bounded size since txckpt-log/2: the head lineage's record, not every lineage's). "
    "Retention bounds the checkpoints, not the log.",
]


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render(results: list[Result], info: dict[str, str], *, quick: bool, wall: float, command: str) -> str:
    by_c: dict[str, list[Result]] = {}
    for r in results:
        by_c.setdefault(r.campaign, []).append(r)
    new = sum(len(r.violations) for r in results)
    errors = [r for r in results if r.error]
    known_ids = sorted({k for r in results for k in r.known})
    out: list[str] = []
    w = out.append
    w("# Reliability scorecard")
    w("")
    w(
        "<!-- Generated by `python -m tests.reliability`; do not edit by hand: change tests/reliability/ and regenerate. -->"
    )
    w("")
    w(
        f"Generated by `{command}` ({'quick' if quick else 'full'} mode) on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"in {wall / 60:.1f} minutes of wall time on the machine below (two cases run at a time). `make reliability` "
        "runs the full campaign; CI runs the quick mode through `tests/test_reliability.py`, which fails on any "
        "violation not explained by a known issue, and holds one `xfail(strict=True)` reproducer per known issue."
    )
    w("")
    w(
        f"**{new} unexplained violations, {len(errors)} harness errors. {len(known_ids)} known issues of the core "
        f"account for {sum(len(r.known_violations) for r in results)} violations** (listed at the end, each with its "
        "reproducer and a proposed fix)."
    )
    w("")
    w("## Summary")
    w("")
    w("| campaign | cases | tried | explored | violations | known-issue violations | time (case-seconds) |")
    w("|---|---|---|---|---|---|---|")
    for cid, title, _ in CAMPAIGNS:
        rs = by_c.get(cid, [])
        if not rs:
            continue
        units: dict[str, int] = {}
        for r in rs:
            units[r.unit] = units.get(r.unit, 0) + r.points
        explored = ", ".join(f"{v} {k}" for k, v in units.items())
        w(
            f"| {title} | {len(rs)} | {sum(r.tried for r in rs)} | {explored} | {sum(len(r.violations) for r in rs)}"
            f"{' + ' + str(sum(1 for r in rs if r.error)) + ' errors' if any(r.error for r in rs) else ''} | "
            f"{sum(len(r.known_violations) for r in rs)} | {sum(r.seconds for r in rs):.0f} |"
        )
    w("")
    w("## Machine")
    w("")
    w("| | |")
    w("|---|---|")
    for k, v in info.items():
        w(f"| {k} | {_cell(v)} |")
    w("")
    for cid, title, method in CAMPAIGNS:
        rs = by_c.get(cid, [])
        if not rs:
            continue
        w(f"## {title}")
        w("")
        w(method)
        w("")
        w("| case | backend | tried | explored | violations | known | notes |")
        w("|---|---|---|---|---|---|---|")
        for r in rs:
            viol = str(len(r.violations)) + (" + ERROR" if r.error else "")
            known = f"{len(r.known_violations)} ({', '.join(r.known)})" if r.known_violations else "0"
            w(
                f"| `{r.id.split('/', 1)[1]}`: {_cell(r.title)} | {r.backend} | {r.tried} | {r.points} {r.unit} | "
                f"{viol} | {known} | {_cell('; '.join(r.notes))} |"
            )
        w("")
        shown = [(r, v) for r in rs for v in r.violations[:5]]
        if shown or any(r.error for r in rs):
            w("Unexplained violations and errors:")
            w("")
            for r, v in shown:
                w(f"- `{r.id}`: {_cell(v[:500])}")
            for r in rs:
                if r.error:
                    w(f"- `{r.id}`: harness error: {_cell(r.error[:800])}")
            w("")
    w("## Scope and limits")
    w("")
    for line in LIMITS:
        w(f"- {line}")
    w("")
    w("## Known issues (violations found in the core)")
    w("")
    if not known_ids:
        w("None.")
    for kid in known_ids:
        k = KNOWN.get(kid)
        if k is None:  # results of an older run, for an issue fixed since
            w(f"### {kid}")
            w("")
            w("(no longer registered in tests/reliability/known.py: fixed since this run?)")
            w("")
            continue
        seen = [r for r in results if kid in r.known]
        example = next((v for r in seen for v in r.known_violations), "")
        w(f"### {kid}: {k.title}")
        w("")
        w(f"- **Where**: {k.where}")
        w(f"- **Scenario**: {k.scenario}")
        w(
            f"- **Reproducer**: `tests/test_reliability.py::{k.reproducer}` (`xfail(strict=True)`: it passes the day "
            "the issue is fixed, which fails CI until the mark is removed)"
        )
        w(f"- **Proposed fix**: {k.fix}")
        w(
            f"- **Seen in**: {', '.join(f'`{r.id}` ({len(r.known_violations)})' for r in seen)}; e.g. "
            f"{_cell(example[:400])}"
        )
        w("")
    w("## Found by this campaign and fixed since")
    w("")
    w(
        "The core was fixed after these were reported; their reproducers in `tests/test_reliability.py` are "
        "regression tests now, and the rows above show the campaign finding nothing there any more."
    )
    w("")
    w("| issue | what it was | fixed in | regression test |")
    w("|---|---|---|---|")
    for f in FIXED:
        w(f"| {f.id} | {_cell(f.title)} | {f.fixed_in} | `{f.regression}` |")
    w("")
    return "\n".join(out) + "\n"
