"""Cases, results, the scheduler that runs cases two at a time, and process helpers.

Every case runs in a process of its own, forked from the campaign's parent (which has imported
torch, txckpt and, when needed, transformers), and forks further children for crash points and
fresh-process checks. Results travel back as JSON through pipes. Nothing here sleeps to wait for
anything: children are reaped with blocking ``waitpid`` (the scheduler waits on its own cases' pidfds),
and the only clock is the campaign's budget, past which the scheduler SIGKILLs (by pid) the
cases still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from tests.harness.procs import after_fork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------
# Scratch space
# ---------------------------------------------------------------------------------------------
def scratch_base() -> str:
    """tmpfs when there is one: process-crash sweeps do not depend on fsync reaching a disk (a
    SIGKILL loses no page cache), and fsync on this VM's disk costs ~8 ms, which would make the
    sweeps 10x slower. Power loss is modelled (campaign 2), not provoked, so tmpfs is fine there."""
    base = os.environ.get("TXCKPT_RELIABILITY_DIR")
    if base:
        return base
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best):
                        best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


# ---------------------------------------------------------------------------------------------
# Cases and results
# ---------------------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What every case gets: its scratch directory, the mode, the S3 endpoint (if any)."""

    workdir: str
    quick: bool
    seed: int = 0
    s3_endpoint: str | None = None

    def path(self, *parts: str) -> str:
        p = os.path.join(self.workdir, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p


@dataclass
class Result:
    id: str
    campaign: str
    title: str
    backend: str
    tried: int = 0  # scenarios / inputs / cycles tried
    points: int = 0  # crash points, crash states, interleavings, ... explored
    unit: str = "crash points"
    violations: list[str] = field(default_factory=list)  # unexplained: fail CI
    known_violations: list[str] = field(default_factory=list)  # matched to a KnownIssue
    known: list[str] = field(default_factory=list)  # ids of the known issues this case shows
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # the harness itself failed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Result":
        return cls(**d)


@dataclass
class Case:
    id: str  # "crash/local/save"
    campaign: str  # "crash", "powerloss", "concurrency", "badinput", "soak"
    title: str
    backend: str
    run: Callable[[Ctx, "Case", Result], None]
    #: Known issues this case is expected to show (violations matching their patterns are "known").
    known: tuple[str, ...] = ()
    #: Rough seconds in quick mode, to start long cases first (full mode: ``cost_full``, default 4x).
    cost: float = 5.0
    cost_full: float | None = None
    needs_s3: bool = False
    params: dict[str, Any] = field(default_factory=dict)


def classify(result: Result, found: list[str], known_ids: tuple[str, ...]) -> None:
    """Split ``found`` violations into known (matching a KnownIssue of the case) and new ones."""
    from .known import KNOWN

    for v in found:
        hit = None
        for kid in known_ids:
            if kid in KNOWN and re.search(KNOWN[kid].pattern, v):
                hit = kid
                break
        if hit is None:
            result.violations.append(v)
        else:
            result.known_violations.append(v)
            if hit not in result.known:
                result.known.append(hit)


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------
def _run_case(case: Case, ctx: Ctx) -> Result:
    result = Result(case.id, case.campaign, case.title, case.backend)
    t0 = time.monotonic()
    try:
        case.run(ctx, case, result)
    except BaseException as e:  # the harness failed: reported, and counted as a failure
        result.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    result.seconds = time.monotonic() - t0
    return result


#: The longest one case may run, quick and full mode: many times the slowest case's time
#: (quick: ~30 s; full: ~10 min), so only a case that hangs reaches it. A case past it is killed
#: with every process it started and reported as a harness error that names it, instead of the
#: whole campaign waiting on it (CI once lost its campaign tier to one hung case).
CASE_LIMIT_S = {True: 300.0, False: 3600.0}


def _kill_case(pid: int) -> None:
    """SIGKILL a case's process and every process it started (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def run_cases(
    cases: list[Case],
    base_ctx: Ctx,
    *,
    workers: int = 2,
    budget: float | None = None,
    progress: Callable[[str], None] = print,
    case_limit: float | None = None,
) -> list[Result]:
    """Run every case in a forked worker process, ``workers`` at a time, longest first; a case
    still running ``case_limit`` seconds after it started (default :data:`CASE_LIMIT_S`) is
    killed and reported as an error."""
    order = sorted(cases, key=lambda c: -(c.cost if base_ctx.quick else (c.cost_full or 4 * c.cost)))
    pending = list(order)
    running: dict[int, tuple[Case, str, float]] = {}
    pidfds: dict[int, int] = {}  # pidfd -> pid of a running case
    results: dict[str, Result] = {}
    deadline = None if budget is None else time.monotonic() + budget
    limit = CASE_LIMIT_S[base_ctx.quick] if case_limit is None else case_limit

    def start(case: Case) -> None:
        wd = os.path.join(base_ctx.workdir, re.sub(r"[^A-Za-z0-9_.-]+", "_", case.id))
        os.makedirs(wd, exist_ok=True)
        ctx = Ctx(wd, base_ctx.quick, base_ctx.seed, base_ctx.s3_endpoint)
        out = os.path.join(wd, "result.json")
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # a group of its own: a case past its limit is killed whole
            after_fork()  # one torch thread: the parent's OpenMP pool did not survive the fork
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            code = 0
            try:
                res = _run_case(case, ctx)
                with open(out + ".tmp", "w") as f:
                    json.dump(res.to_json(), f)
                os.replace(out + ".tmp", out)
            except BaseException:  # pragma: no cover
                traceback.print_exc()
                code = 1
            os._exit(code)
        with contextlib.suppress(OSError):  # in both processes, so that no kill comes before it
            os.setpgid(pid, pid)
        running[pid] = (case, out, time.monotonic())
        pidfds[os.pidfd_open(pid)] = pid

    try:
        while pending or running:
            while pending and len(running) < workers:
                start(pending.pop(0))
            now = time.monotonic()
            first_limit = min(t0 + limit for _, _, t0 in running.values())
            left = max(min(first_limit, deadline if deadline is not None else first_limit) - now, 0.0)
            # Wait on the pidfds of this scheduler's own cases, never on "any child" (os.wait):
            # that would reap what else this process started (the multiprocessing forkserver
            # of tests/harness/launcher.py, an emulator), whose owner then fails with ECHILD.
            ready, _, _ = select.select(list(pidfds), [], [], left)
            now = time.monotonic()
            for fd, pid in list(pidfds.items()):
                case, out, t0 = running[pid]
                if fd in ready or now < t0 + limit:
                    continue
                _kill_case(pid)
                os.close(fd)
                del pidfds[fd], running[pid]
                r = Result(case.id, case.campaign, case.title, case.backend)
                r.error = (
                    f"killed after {now - t0:.0f} s: the case passed its {limit:.0f}-second limit "
                    f"(it hangs, or it needs a larger CASE_LIMIT_S in tests/reliability/core.py)"
                )
                r.seconds = now - t0
                results[case.id] = r
                progress(f"  {case.id}: KILLED (case limit)")
            if not ready and deadline is not None and now >= deadline:  # the campaign's budget ran out
                for pid, (case, _out, t0) in list(running.items()):
                    _kill_case(pid)
                    r = Result(case.id, case.campaign, case.title, case.backend)
                    r.error = f"killed: the campaign's time budget ({budget:.0f} s) ran out"
                    r.seconds = time.monotonic() - t0
                    results[case.id] = r
                    progress(f"  {case.id}: KILLED (budget)")
                running.clear()
                for case in pending:
                    r = Result(case.id, case.campaign, case.title, case.backend)
                    r.error = "not run: the campaign's time budget ran out"
                    results[case.id] = r
                pending.clear()
                break
            for fd in ready:
                pid = pidfds.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                case, out, t0 = running.pop(pid)
                try:
                    with open(out) as f:
                        res = Result.from_json(json.load(f))
                except (OSError, ValueError):
                    res = Result(case.id, case.campaign, case.title, case.backend)
                    res.error = f"the case's process died (status {status}) without a result"
                    res.seconds = time.monotonic() - t0
                results[case.id] = res
                flag = (
                    "ERROR"
                    if res.error
                    else f"{len(res.violations)} violations"
                    + (f", {len(res.known_violations)} known" if res.known_violations else "")
                )
                progress(f"  {case.id}: {res.points} {res.unit}, {flag} ({res.seconds:.0f} s)")
    finally:
        for fd in pidfds:
            os.close(fd)
    return [results[c.id] for c in cases if c.id in results]


# ---------------------------------------------------------------------------------------------
# The checkpoint payload used everywhere: four files, one per kind, each carrying a tag
# ---------------------------------------------------------------------------------------------
PAYLOAD_NAMES = ("model.safetensors", "optimizer.pt", "trainer_state.json", "extra.dat")


def payload(tag: str, step: int, n: int = 64) -> dict[str, Any]:
    """A checkpoint whose every file (one of each kind txckpt knows) carries ``tag``, so that a
    checkpoint mixing two saves is detected."""
    import torch

    return {
        "model.safetensors": {
            "w": torch.full((n,), float(step)),
            "tag": torch.tensor(list(tag.encode()), dtype=torch.uint8),
        },
        "optimizer.pt": {"state": torch.full((n // 2,), float(step)), "tag": tag},
        "trainer_state.json": {"global_step": step, "tag": tag},
        "extra.dat": f"tag={tag};".encode() * 8,
    }


def tags_of_loaded(data: dict[str, Any]) -> set[str]:
    tags = set()
    if "model.safetensors" in data:
        tags.add(bytes(data["model.safetensors"]["tag"].tolist()).decode())
    if "optimizer.pt" in data:
        tags.add(data["optimizer.pt"]["tag"])
    if "trainer_state.json" in data:
        tags.add(data["trainer_state.json"]["tag"])
    if "extra.dat" in data:
        raw = data["extra.dat"]
        tags.add(raw.decode().split(";")[0][len("tag=") :])
    return tags


def tags_of_raw(read: Callable[[str], bytes]) -> set[str]:
    """Tags of a checkpoint read file by file without a manifest (a legacy checkpoint)."""
    import io

    import torch
    from safetensors.torch import load as st_load

    return tags_of_loaded(
        {
            "model.safetensors": st_load(read("model.safetensors")),
            "optimizer.pt": torch.load(io.BytesIO(read("optimizer.pt")), weights_only=True),
            "trainer_state.json": json.loads(read("trainer_state.json")),
            "extra.dat": read("extra.dat"),
        }
    )


def write_legacy(storage: Any, key: str, tag: str, step: int) -> dict[str, bytes]:
    """A stock Trainer-style checkpoint directory (no txckpt manifest) at ``key``; returns
    {key/name: bytes}."""
    import io

    import torch
    from safetensors.torch import save as st_save

    files = payload(tag, step)
    blobs = {
        "model.safetensors": st_save(files["model.safetensors"]),
        "trainer_state.json": json.dumps(files["trainer_state.json"]).encode(),
        "extra.dat": files["extra.dat"],
    }
    buf = io.BytesIO()
    torch.save(files["optimizer.pt"], buf)
    blobs["optimizer.pt"] = buf.getvalue()
    out = {}
    for name, data in blobs.items():
        storage.create_exclusive(f"{key}/{name}", data, durable=False)
        out[f"{key}/{name}"] = data
    return out


# ---------------------------------------------------------------------------------------------
# Machine description for the report
# ---------------------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    from benchmarks.harness import host

    info = host()
    for mod in ("torch", "transformers", "s3fs", "aiobotocore", "moto", "fsspec"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception:
            info[mod] = "not installed"
    base = scratch_base()
    info["Scratch"] = f"{base} ({fs_type(base)})"
    try:
        import subprocess

        rev = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--", "txckpt"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        info["txckpt"] = f"git {rev}" + (" + uncommitted changes in txckpt/" if dirty else "")
    except Exception:
        pass
    return info


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def warm_up(trainer: bool = False, s3: bool = False) -> None:
    """Import and exercise everything once in the parent, so that each of the thousands of
    forked children starts warm (a cold ``import torch`` alone costs ~3 s here)."""
    import io

    import torch  # noqa: F401
    from safetensors.torch import load as _l, save as _s  # noqa: F401

    import txckpt
    import txckpt.cli  # noqa: F401
    import txckpt._maintenance.gc
    import txckpt._maintenance.retention  # noqa: F401
    from txckpt._root.root import CheckpointRoot

    d = tempfile.mkdtemp(dir=scratch_base(), prefix="txckpt-warm-")
    try:
        root = os.path.join(d, "root")
        p = txckpt.save_checkpoint(root, 1, payload("W", 1))
        txckpt.load_checkpoint(p)
        with txckpt.transaction(root, 2) as tx:
            tx.save("a.pt", {"x": 1})
        txckpt._maintenance.gc.collect_garbage(CheckpointRoot(root))
        txckpt.resume(root, step=1)
        torch.load(io.BytesIO(b"not a checkpoint") if False else _buf(), weights_only=True)
        mem = f"memory://txckpt-warm-{os.getpid()}/root"
        txckpt.save_checkpoint(mem, 1, payload("W", 1))
        txckpt.load_checkpoint(txckpt.get_last_checkpoint(mem))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        txckpt.forget_roots()
    if s3:
        import aiobotocore.endpoint  # noqa: F401
        import boto3  # noqa: F401
        import s3fs  # noqa: F401
    if trainer:
        import transformers  # noqa: F401
        from transformers import Trainer  # noqa: F401

        import txckpt.integrations.transformers  # noqa: F401


def _buf():
    import io

    import torch

    b = io.BytesIO()
    torch.save({"x": torch.ones(1)}, b)
    b.seek(0)
    return b
