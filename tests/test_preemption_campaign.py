"""The preemption campaign (issue 32): a scheduler's SIGTERM at a random moment, then its SIGKILL
after a random grace of 0-5 s, against two gloo ranks of tests/children/preempt_loop.py (a plain
training loop under txckpt.preemption), on a local root and on an S3 root (moto on 127.0.0.1).

Each case draws, from one seeded RNG (the seed is printed; ``TXCKPT_CAMPAIGN_SEED`` replays it):

- the moment: *during a step* (the loop holds inside step H), *during a sync save* (the loop's
  save_checkpoint of step B holds inside CheckpointRoot.save) or *while an async save is pending*
  (the background save of step B holds there); each is reached through the handshake file the
  child writes there (``instep-rank{r}`` / ``blocked-rank{r}``), never a sleep: the parent waits
  for both ranks' file, signals, then writes ``release`` (in one case in five it never does: a
  step or a save that hangs, which txckpt's grace or the SIGKILL must end);
- which rank(s) get SIGTERM (0, 1 or both), the scheduler's grace (0-5 s, half of them short:
  both ranks still alive then are SIGKILLed; in a quarter of the cases it counts from the first
  ``final-rank{r}`` file, so the SIGKILL lands inside the final save) and the grace the loop gives
  txckpt.preemption.install (none, or a little less than the scheduler's, as docs/preemption.md
  advises);
- the save period and the held step.

After each case, in this process, the invariants (each check is a *point*; a failed one a
*violation*):

0. each rank exits with 143 or dies of the SIGKILL (or exits 1 from a save's broken collective
   where the other rank was forced out or killed); txckpt forces a rank out only where install()
   was given a grace, and not before it ran out;
1. every committed checkpoint (every lineage) verifies: each file's size and checksum match its
   manifest (load_checkpoint checks them all first), the manifest is the log's (same txid and step), it holds both ranks' files and
   nothing else, and both files hold that step's state (w == step): never torn, never mixed;
2. only steps the loop saved are committed, and every save a rank saw return or finish (``done-*``
   files: ``ok``) is still committed: no committed step lost;
3. get_last_checkpoint is the newest committed step;
4. if both ranks exited by themselves within the grace (status 143, no forced exit by txckpt's own
   grace): both stopped at the same step, that step is committed and is the newest, and so is a
   save pending at the signal. Whoever stopped, stopped at the step the moment implies (H; B + 1
   after a held sync save) where each signalled rank wrote ``signalled-rank{r}`` before the release
   (its handler ran while held: Python may run it later when another thread took the signal);
5. a restart (both ranks, ``--resume``) resumes from exactly get_last_checkpoint's step (0 when
   nothing is committed) with that step's state, trains on and commits a later step; 1-3 hold
   again after it.

Marked ``slow`` (the campaign tier): 12 local + 6 S3 cases a run, drawn afresh from each run's
seed, so that the cases accumulate across runs (16 + 8 took 98 s + 140 s on a campaign worker
beside another, clean-clone trial at a761ff8); ``TXCKPT_CAMPAIGN_CASES=N`` runs N cases on each
root instead.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

import pytest

import txckpt
from tests import conftest
from tests.harness.zygote import popen_python

pytestmark = [pytest.mark.process, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(REPO, "tests", "children", "preempt_loop.py")
SIGTERM_STATUS = 128 + signal.SIGTERM
WORLD = 2
#: Cases a root: a local case costs ~2 s on the 2-core machine, an S3 one ~10 s (moto serves from
#: this process); ``TXCKPT_CAMPAIGN_CASES`` (a number) runs that many on each root instead.
CASES = {"local": 12, "s3": 6}
MOMENTS = ("step", "sync-save", "async-pending")
SHORT_GRACE_S = {"local": 0.25, "s3": 0.8}
SLOW_AFTER_S = 2.0
FINAL_SAVE_S = {"local": 0.06, "s3": 0.5}  # about how long the final 2-rank save takes on the 2-core machine
#: What txckpt.preemption logs when its own grace ran out (or a second signal came): a forced exit.
FORCED_EXIT = "txckpt: preemption: exiting now with status"
HANDSHAKE_DEADLINE_S = 90.0


def campaign_seed() -> int:
    text = os.environ.get("TXCKPT_CAMPAIGN_SEED", "")
    return int(text) if text else random.SystemRandom().randrange(1 << 31)


SEED = campaign_seed()


@dataclass
class Case:
    index: int
    kind: str
    moment: str
    sync: bool
    every: int
    at: int  # the held step: H (step) or B (the save held)
    targets: tuple[int, ...]
    grace_s: float  # the scheduler's: SIGKILL after it
    loop_grace_s: float | None  # txckpt.preemption.install(grace_s=...)
    stalled: bool  # the held step or save is never released
    aimed: bool  # the grace counts from the final save's start (``final-rank{r}``), not from the signal

    @property
    def name(self) -> str:
        return (
            f"{self.kind}-{self.index:02d} {self.moment}@{self.at} {'sync' if self.sync else 'async'} "
            f"every {self.every} SIGTERM->rank{'+'.join(map(str, self.targets))} grace {self.grace_s:g} s "
            f"(loop {'none' if self.loop_grace_s is None else f'{self.loop_grace_s:g} s'})"
            f"{' stalled' if self.stalled else ''}{' from the final save' if self.aimed else ''}"
        )


def plan(rng: random.Random, kind: str, n: int) -> list[Case]:
    moments = [MOMENTS[i % len(MOMENTS)] for i in range(n)]  # each moment n // 3 times at least
    rng.shuffle(moments)
    cases = []
    for i, moment in enumerate(moments):
        every = rng.randint(2, 4)
        sync = moment == "sync-save" or (moment == "step" and rng.random() < 0.5)
        at = rng.randint(2, 3 * every) if moment == "step" else every * rng.randint(1, 3)
        # Half the graces short (a sixth of all exactly 0), about what the shutdown's own saves take
        # (a local 2-rank save ~0.1 s, an S3 one ~0.5 s): SIGKILLs land inside them, not only before.
        draw, short = rng.random(), SHORT_GRACE_S[kind]
        grace = 0.0 if draw < 0.15 else round(rng.uniform(0.0, short) if draw < 0.5 else rng.uniform(short, 5.0), 2)
        loop_grace = None if rng.random() < 0.5 else round(grace * rng.uniform(0.5, 0.9), 2)
        stalled, aimed = rng.random() < 0.2, rng.random() < 0.25
        if aimed and not stalled:  # the SIGKILL within about the final save's time after a rank began it
            grace, loop_grace = round(rng.uniform(0.0, FINAL_SAVE_S[kind]), 3), None
        cases.append(
            Case(
                i,
                kind,
                moment,
                sync,
                every,
                at,
                rng.choice([(0,), (1,), (0, 1)]),
                grace,
                loop_grace,
                stalled,
                aimed and not stalled,
            )
        )
    return cases


class Rank:
    """One rank of the loop, a real process forked by the suite's zygote (torch preloaded)."""

    def __init__(self, run_dir: str, rank: int, args: list[str]) -> None:
        self.hs, self.rank = os.path.join(run_dir, "hs"), rank
        os.makedirs(self.hs, exist_ok=True)
        self.log = os.path.join(run_dir, f"rank{rank}.log")
        self.exited_after: float | None = None  # seconds from the signal to its exit, if it exited by itself
        env = dict(os.environ, PYTHONPATH=REPO, TXCKPT_COORDINATION_TIMEOUT="60", PYTHONUNBUFFERED="1")
        with open(self.log, "w") as out:
            self.proc = popen_python(
                [
                    LOOP,
                    "--hs",
                    self.hs,
                    "--rank",
                    str(rank),
                    "--world",
                    str(WORLD),
                    "--store",
                    os.path.join(run_dir, "store"),
                    *args,
                ],
                env=env,
                stdout=out,
                stderr=out,
            )

    def file(self, name: str) -> str:
        return os.path.join(self.hs, name.format(r=self.rank))

    def read(self, name: str) -> str | None:
        try:
            with open(self.file(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def result(self) -> dict | None:
        text = self.read("result-rank{r}.json")
        return json.loads(text) if text else None

    def output(self, tail: int = 3000) -> str:
        with open(self.log) as f:
            return f.read()[-tail:]


def wait_for_files(ranks: list[Rank], name: str, deadline_s: float = HANDSHAKE_DEADLINE_S) -> str | None:
    """Poll (with a deadline) until every rank wrote ``name``; None, or why not."""
    end = time.monotonic() + deadline_s
    while True:
        if all(os.path.exists(r.file(name)) for r in ranks):
            return None
        for r in ranks:
            if r.proc.poll() is not None:
                return f"rank {r.rank} exited ({r.proc.returncode}) before {name}:\n{r.output()}"
        if time.monotonic() > end:
            return f"no {name} from every rank after {deadline_s} s:\n" + "\n".join(r.output() for r in ranks)
        time.sleep(0.01)  # polling a handshake file with a deadline


def all_files(ranks: list[Rank], name: str, until: float) -> bool:
    """Whether every rank of ``ranks`` wrote ``name`` (polled until ``until``, or until one exited)."""
    while True:
        if all(os.path.exists(r.file(name)) for r in ranks):
            return True
        if time.monotonic() >= until or any(r.proc.poll() is not None for r in ranks):
            return False
        time.sleep(0.005)  # polling a handshake file with a deadline


def first_file(ranks: list[Rank], name: str, until: float) -> float | None:
    """time.monotonic() when the first rank's ``name`` was seen (polled until ``until``, or until
    every rank exited); None if none was."""
    while time.monotonic() < until:
        if any(os.path.exists(r.file(name)) for r in ranks):
            return time.monotonic()
        if all(r.proc.poll() is not None for r in ranks):
            return None
        time.sleep(0.005)  # polling a handshake file with a deadline
    return None


def kill_all(ranks: list[Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    for r in ranks:
        r.proc.wait()


def saves_seen(rank: Rank) -> dict[int, str]:
    """{step: "ok <path>" or "error <why>"} of the saves this rank saw finish (``done-*`` files).
    A save may fail when the other rank was killed or forced out (its collective breaks): then
    nothing of it may be committed, which the root's checks see; "ok" means committed."""
    out = {}
    for name in os.listdir(rank.hs):
        if name.startswith("done-") and name.endswith(f"-rank{rank.rank}"):
            out[int(name.split("-")[1])] = rank.read(name) or ""
    return out


@dataclass
class Campaign:
    kind: str
    so: dict | None
    cases: int = 0
    sigterms: int = 0
    sigkills: int = 0
    killed_cases: int = 0
    killed_in_final_save: int = 0
    stalls: int = 0
    #: Not stalled, no grace of txckpt's own, a grace >= SLOW_AFTER_S, and still SIGKILLed: a
    #: shutdown slower than the grace (a hang, or a loaded machine). Counted, not asserted (a time).
    slow_shutdowns: int = 0
    covered: int = 0
    committed_at_signal: int = 0
    restarts: int = 0
    points: int = 0
    violations: list[str] = field(default_factory=list)
    case_name: str = ""

    def check(self, ok: bool, what: str) -> bool:
        self.points += 1
        if not ok:
            self.violations.append(f"[{self.case_name}] {what}")
        return ok

    # ----- the root's invariants (1-3) -----------------------------------------------------------
    def committed(self, url: str, saved_steps: set[int], ranks: list[Rank]) -> dict[int, str]:
        """Check every committed checkpoint; return {step: path} of the current lineage's."""
        so = self.so
        txckpt.forget_roots()
        try:
            infos = txckpt.CheckpointRoot(url, so).checkpoints("all")
        except txckpt.errors.RootNotFoundError:
            infos = []  # nothing ever written (a kill before the first save on a local root)
        current: dict[int, str] = {}
        for info in infos:
            where = f"checkpoint step {info.step} ({info.path}, txid {info.txid})"
            if not self.check(info.path is not None, f"{where}: committed but its data is missing"):
                continue
            try:  # load_checkpoint verifies every file's size and checksum first, as verify_checkpoint does
                # (one read of each file instead of two: on moto a check costs ~16 requests a checkpoint)
                data = txckpt.load_checkpoint(info.path, storage_options=so)
                manifest = txckpt.read_manifest(info.path, storage_options=so)
            except Exception as e:  # noqa: BLE001 - a torn checkpoint is what this looks for
                self.check(False, f"{where} does not verify: {type(e).__name__}: {e}")
                continue
            self.check(
                manifest.txid == info.txid and manifest.step == info.step,
                f"{where}: its manifest is txid {manifest.txid} step {manifest.step}",
            )
            self.check(manifest.world_size == WORLD, f"{where}: world_size {manifest.world_size}")
            self.check(sorted(data) == [f"rank{r}.pt" for r in range(WORLD)], f"{where}: files {sorted(data)}")
            for name, state in sorted(data.items()):
                self.check(
                    state["step"] == info.step and bool(state["w"].eq(info.step).all()),
                    f"{where}: {name} holds step {state['step']}'s state, w={state['w'].tolist()} (mixed)",
                )
            self.check(info.step in saved_steps, f"{where}: the loop never saved step {info.step}")
            if info.state == "current":
                current[info.step] = info.path
        steps = set(current)
        for r in ranks:  # every save a rank saw return or finish is still committed
            for step, outcome in saves_seen(r).items():
                if outcome.startswith("ok "):
                    self.check(
                        step in steps,
                        f"rank {r.rank} saw step {step} committed ({outcome}); committed now: {sorted(steps)}",
                    )
        try:
            last = txckpt.get_last_checkpoint(url, storage_options=so, missing_ok=True)
        except Exception as e:  # noqa: BLE001
            self.check(False, f"get_last_checkpoint raised {type(e).__name__}: {e}")
            return current
        last_step = txckpt.read_manifest(last, storage_options=so).step if last else None
        self.check(
            last_step == (max(steps) if steps else None),
            f"get_last_checkpoint is step {last_step}, the newest committed is {max(steps, default=None)}",
        )
        return current

    # ----- one case ------------------------------------------------------------------------------
    def run_case(self, case: Case, run_dir: str, url: str) -> None:
        self.cases += 1
        self.case_name = case.name
        args = ["--root", url, "--every", str(case.every)]
        if self.so:
            args += ["--storage-options", json.dumps(self.so)]
        if case.sync:
            args.append("--sync")
        first = args + (["--hold-step", str(case.at)] if case.moment == "step" else ["--block-step", str(case.at)])
        if case.loop_grace_s is not None:
            first += ["--grace", str(case.loop_grace_s)]
        ranks = [Rank(os.path.join(run_dir, "run"), r, first) for r in range(WORLD)]
        acked = False  # every signalled rank handled its signal while held (step, sync save)
        try:
            why = wait_for_files(ranks, "instep-rank{r}" if case.moment == "step" else "blocked-rank{r}")
            if not self.check(why is None, f"the moment was not reached: {why}"):
                return
            t_signal = time.monotonic()
            for r in case.targets:
                ranks[r].proc.send_signal(signal.SIGTERM)
                self.sigterms += 1
            end = t_signal + case.grace_s
            if case.moment != "async-pending":  # the loop's main thread is held: it must handle the signal
                acked = all_files(
                    [ranks[r] for r in case.targets], "signalled-rank{r}", until=t_signal + 5.0 if case.aimed else end
                )
            if not case.stalled:
                open(os.path.join(ranks[0].hs, "release"), "w").close()
            if case.aimed:  # from the moment the first rank begins its final save (5 s at most in all)
                began = first_file(ranks, "final-rank{r}", until=t_signal + 5.0)
                end = min((began or t_signal + 5.0) + case.grace_s, t_signal + 5.0)
            for r in ranks:  # the scheduler's grace: whatever is alive after it gets SIGKILL
                try:
                    r.proc.wait(max(0.0, end - time.monotonic()))
                    r.exited_after = time.monotonic() - t_signal  # an upper bound: it may have exited before
                except subprocess.TimeoutExpired:  # still running: the SIGKILL below
                    pass
        finally:
            alive = [r for r in ranks if r.proc.poll() is None]
            kill_all(ranks)
        self.stalls += case.stalled
        self.slow_shutdowns += (
            bool(alive)
            and not case.stalled
            and not case.aimed
            and case.loop_grace_s is None
            and case.grace_s >= SLOW_AFTER_S
        )
        self.sigkills += len(alive)
        self.killed_cases += bool(alive)
        final = [r.read("final-rank{r}") for r in ranks]  # the final save had begun on that rank
        self.killed_in_final_save += any(
            r in alive and f and f"done-{f}-rank{r.rank}" not in os.listdir(r.hs) for r, f in zip(ranks, final)
        )
        codes = [r.proc.returncode for r in ranks]
        forced = [r.rank for r in ranks if FORCED_EXIT in r.output(tail=1 << 20)]
        for r, code in zip(ranks, codes):
            # 143, or SIGKILL; or 1 where the other rank was forced out or killed in the middle of a
            # save both make: the save's collective raises CoordinationTimeoutError in the loop (a plain
            # loop does not catch it), before this rank's own grace ran out.
            peer_gone = any(o.rank != r.rank and (o.rank in forced or o in alive) for o in ranks)
            self.check(
                code in (SIGTERM_STATUS, -signal.SIGKILL)
                or (code == 1 and peer_gone and "CoordinationTimeoutError" in r.output(tail=1 << 20)),
                f"rank {r.rank} exited with {code}, not {SIGTERM_STATUS} or SIGKILL:\n{r.output()}",
            )
        results = [r.result() for r in ranks]
        expected = {"step": case.at, "sync-save": case.at + 1}.get(case.moment)
        agreed = [res["stopped_at"] for res in results if res]
        self.check(len(set(agreed)) <= 1, f"the ranks stopped at different steps: {agreed}")
        for step in agreed:
            if expected is not None and acked:
                self.check(step == expected, f"stopped at step {step}, the moment implies {expected}")
            else:
                self.check(step > case.at, f"stopped at step {step}, before the held save of step {case.at}")
        at_signal = agreed[0] if agreed else expected
        saved = self.saved_steps(case, at_signal, 0)
        current = self.committed(url, saved, ranks)
        if at_signal is not None and at_signal in current:
            self.committed_at_signal += 1
        for r in forced:  # txckpt exits by itself only when the grace install() was given ran out
            after = ranks[r].exited_after
            self.check(
                case.loop_grace_s is not None and (after is None or after >= case.loop_grace_s),
                f"rank {r} was forced out {after} s after the signal, its grace is {case.loop_grace_s} s:\n"
                f"{ranks[r].output()}",
            )
        if codes == [SIGTERM_STATUS] * WORLD and not forced:  # the grace covered the whole shutdown
            self.covered += 1
            self.check(len(agreed) == WORLD, f"both ranks exited by themselves, results {results}")
            self.check(
                at_signal in current and at_signal == max(current),
                f"the grace covered it but step {at_signal} is not the newest committed: {sorted(current)}",
            )
            for r in ranks:
                failed = {s: o for s, o in saves_seen(r).items() if not o.startswith("ok ")}
                self.check(not failed, f"the grace covered it but rank {r.rank}'s saves failed: {failed}")
            if case.moment == "async-pending":
                self.check(
                    case.at in current,
                    f"the save of step {case.at} pending at the signal is not committed: {sorted(current)}",
                )
        self.restart(case, run_dir, url, args, current, ranks)

    def saved_steps(self, case: Case, stopped_at: int | None, start: int, finish: int | None = None) -> set[int]:
        """The steps the loop may have committed (its periodic saves, the step it stopped at, its
        finish); a superset beyond the run's end costs nothing: no later step exists."""
        top = max(x for x in (stopped_at, finish, case.at + 3 * case.every, start) if x is not None)
        out = {s for s in range(case.every, top + 1, case.every)}
        return out | {s for s in (stopped_at, finish) if s is not None}

    # ----- the restart (5) -----------------------------------------------------------------------
    def restart(
        self, case: Case, run_dir: str, url: str, args: list[str], current: dict[int, str], before: list[Rank]
    ) -> None:
        self.restarts += 1
        last = max(current, default=0)
        finish = last + case.every + 1
        ranks = [
            Rank(os.path.join(run_dir, "restart"), r, args + ["--resume", "--finish-at", str(finish)])
            for r in range(WORLD)
        ]
        try:
            for r in ranks:
                r.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.check(False, "the restart hung for 120 s:\n" + "\n".join(r.output() for r in ranks))
            return
        finally:
            kill_all(ranks)
        for r in ranks:
            if not self.check(
                r.proc.returncode == 0, f"restart rank {r.rank} exited with {r.proc.returncode}:\n{r.output()}"
            ):
                return
            resumed = json.loads(r.read("resumed-rank{r}.json") or "{}")
            self.check(
                resumed.get("from") == last,
                f"restart rank {r.rank} resumed from {resumed}, get_last_checkpoint's step is {last}",
            )
        saved = self.saved_steps(case, None, last, finish) | set(current)
        after = self.committed(url, saved, before + ranks)  # the first run's saves are still there
        self.check(
            finish in after and max(after) == finish,
            f"the restart from step {last} did not commit step {finish}: {sorted(after)}",
        )

    def summary(self, wall: float) -> str:
        return (
            f"preemption campaign ({self.kind} root, seed {SEED}): {self.cases} cases, "
            f"{self.sigterms + self.sigkills + self.stalls} faults ({self.sigterms} SIGTERMs, {self.sigkills} "
            f"SIGKILLs in {self.killed_cases} cases, {self.killed_in_final_save} inside the final save, "
            f"{self.stalls} stalls), {self.covered} covered by the grace, {self.slow_shutdowns} slow shutdowns, "
            f"{self.committed_at_signal} committed the step at the signal, {self.restarts} restarts, "
            f"{self.points} points checked, {len(self.violations)} violations; {wall:.0f} s"
        )


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def campaign_root(request, tmp_path):
    """(kind, base URL, storage options): a directory, or a fresh bucket on moto's server."""
    if request.param == "local":
        return "local", str(tmp_path / "roots"), None
    url, so = request.getfixturevalue("s3_root")
    return "s3", url, so


@pytest.mark.timeout(600)
def test_preemption_campaign(campaign_root, tmp_path):
    kind, base, so = campaign_root
    print(f"preemption campaign seed {SEED} (TXCKPT_CAMPAIGN_SEED={SEED} replays it)")
    rng = random.Random(f"{SEED}-{kind}")
    campaign = Campaign(kind, so)
    t0 = time.monotonic()
    n = int(os.environ.get("TXCKPT_CAMPAIGN_CASES") or CASES[kind])
    for case in plan(rng, kind, n):
        url = f"{base}-{case.index:02d}" if so else os.path.join(base, f"case{case.index:02d}")
        before = len(campaign.violations)
        campaign.run_case(case, str(tmp_path / f"case{case.index:02d}"), url)
        print(f"{case.name}: {len(campaign.violations) - before} violations")
    line = campaign.summary(time.monotonic() - t0)
    conftest.SUMMARY_LINES.append(line)
    print(line)
    assert campaign.cases == n and campaign.points > 0
    assert not campaign.violations, f"{line}\n" + "\n".join(campaign.violations[:10])
