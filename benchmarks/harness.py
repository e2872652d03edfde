"""Shared machinery: settings, interleaved timing, the machine description, the case runner."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from typing import Any, Callable, Iterator

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass
class Settings:
    quick: bool = False
    #: Smoke-test mode: tiny sizes, one round; keeps the harness working, measures nothing.
    tiny: bool = False
    #: Where write benchmarks put their files: a directory on the project disk, never tmpfs.
    scratch: str = ""
    #: Caches that survive between runs (the 10,000-commit root).
    cache: str = ""
    #: Sizes of the synthetic checkpoint state, in bytes.
    sizes: tuple[int, ...] = ()
    #: Rounds per size.
    reps: dict[int, int] = dataclasses.field(default_factory=dict)


_settings: Settings | None = None


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


_load_at_start = _loadavg()


def default_scratch() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get("TXCKPT_BENCH_DIR") or os.path.join(here, ".bench-tmp")


def configure(quick: bool, tiny: bool = False, scratch: str | None = None, sizes: list[int] | None = None) -> Settings:
    global _settings
    scratch = os.path.abspath(scratch or default_scratch())
    if tiny:
        # One size: the smoke test runs every case end to end and measures nothing, and each
        # size costs every case a pass (the tiny run was the campaign's slowest test, ~190 s).
        default_sizes = [1 * MiB]
        reps = {s: 2 for s in default_sizes}
    elif quick:
        default_sizes = [64 * MiB]
        reps = {64 * MiB: 5}
    else:
        default_sizes = [64 * MiB, 256 * MiB, 1 * GiB]
        if free_bytes(scratch) > 40e9:
            default_sizes.append(4 * GiB)
        reps = {64 * MiB: 9, 256 * MiB: 7, 1 * GiB: 5, 4 * GiB: 3}
    chosen = tuple(sizes or default_sizes)
    for s in chosen:
        reps.setdefault(s, 2 if tiny else 5)
    _settings = Settings(
        quick=quick or tiny, tiny=tiny, scratch=scratch, cache=os.path.join(scratch, "cache"), sizes=chosen, reps=reps
    )
    os.makedirs(_settings.scratch, exist_ok=True)
    os.makedirs(_settings.cache, exist_ok=True)
    return _settings


def settings() -> Settings:
    if _settings is None:
        return configure(quick=True)
    return _settings


def proc_status(field: str) -> int:
    """A byte count of this process from /proc/self/status (``VmRSS``, ``VmHWM``: kB there)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def free_bytes(path: str) -> int:
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def fresh_dir(tag: str) -> str:
    """A new, empty directory under the scratch directory (every save writes to a fresh one)."""
    d = os.path.join(settings().scratch, "run", f"{tag}-{uuid.uuid4().hex[:8]}")
    os.makedirs(d)
    return d


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def settle() -> None:
    """Push every dirty page to disk before the next measured operation, so that write-back
    of an earlier round (or a deletion) is never charged to the operation being timed."""
    os.sync()
    gc.collect()


def fmt_size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return str(n)
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f} {unit}"
    return f"{n} B"


# ----- interleaved timing ----------------------------------------------------------------------


@dataclasses.dataclass
class Method:
    """One side of a comparison. ``setup()`` prepares (untimed) and returns a context, ``run(ctx)``
    is timed, ``cleanup(ctx)`` undoes (untimed)."""

    name: str
    run: Callable[[Any], Any]
    setup: Callable[[], Any] = lambda: None
    cleanup: Callable[[Any], None] = lambda ctx: None
    #: Whether to sync dirty pages before the timed part (write benchmarks: yes).
    settle: bool = True
    #: ``run`` times itself and returns the seconds that count (a lazy save: its call plus the
    #: next optimizer step's wait, not the forward and backward between them).
    self_timed: bool = False


def interleave(methods: list[Method], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every method once per round, in an order rotated each round (A B C, B C A, C A B...),
    after ``warmup`` untimed rounds. Returns each method's times in round order."""
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    n = len(methods)
    for r in range(warmup + reps):
        k = r % n
        order = methods[k:] + methods[:k]
        for m in order:
            ctx = m.setup()
            if m.settle:
                settle()
            else:
                gc.collect()
            t0 = time.perf_counter()
            try:
                got = m.run(ctx)
                dt = time.perf_counter() - t0
                if m.self_timed:
                    dt = float(got)
                # Dropped before the next method runs: a load's result (GiBs of tensors) held
                # through the next timed call would make that call draw fresh pages beside it.
                got = None
            finally:
                m.cleanup(ctx)
            if r >= warmup:
                times[m.name].append(dt)
    return times


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, queue: Any, timeout_s: float = 600) -> Iterator[None]:
    """A benchmark rank's body, run inside a gloo group on 127.0.0.1:``port``: an error is also
    reported to the parent through ``queue`` by rank 0 (the parent reads rank 0's result there),
    and the group is destroyed at the end, whatever happened."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        if rank == 0:
            queue.put({"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def order_balanced(paired: list[float]) -> list[float]:
    """Per-round ratios of rounds whose two methods ran in alternating order, folded pairwise:
    the geometric mean of rounds 2k and 2k+1 (one in each order). The second method of a round
    inherits the first one's aftermath (its write-back, a freed gigabyte, a cold cache), and a
    median over an odd count of rounds gives one order the majority."""
    return [math.sqrt(paired[i] * paired[i + 1]) for i in range(0, len(paired) - 1, 2)]


def compare(
    case: str,
    size: Any,
    times: dict[str, list[float]],
    a: str,
    b: str,
    goal: float | None,
    note: str = "",
    *,
    alternating: bool = False,
) -> dict[str, Any]:
    """A table row: method ``a`` (txckpt) against ``b`` from the same interleaved rounds
    (``alternating``: the two ran in an order that alternates from round to round)."""
    ta, tb = times[a], times[b]
    ma, mb = median(ta), median(tb)
    paired = [x / y for x, y in zip(ta, tb) if y > 0]
    # The headline ratio is the median of the per-round ratios: the two sides of one round run
    # back to back, so a burst of load from other processes hits both; medians of each side
    # taken separately can pair a quiet round of one with a busy round of the other.
    headline = order_balanced(paired) if alternating and len(paired) >= 2 else paired
    return {
        "case": case,
        "size": size,
        "txckpt": ma,
        "other": mb,
        "ratio": median(headline) if headline else float("nan"),
        "ratio_of_medians": ma / mb if mb > 0 else float("nan"),
        "goal": goal,
        "reps": len(ta),
        "paired": paired,
        "note": note,
    }


# ----- running the cases -----------------------------------------------------------------------


def run_case(name: str, quick: bool) -> list[dict[str, Any]]:
    """Import ``benchmarks.<name>`` and run it. Never raises: a missing module is pending, an
    error is failed, each as a table that says so."""
    modname = f"benchmarks.{name}"
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name == modname:
            return [{"title": name, "status": "pending", "reason": f"`{modname}` is not written yet", "rows": []}]
        return [_failed(name, e)]
    except Exception as e:
        return [_failed(name, e)]
    try:
        result = mod.run(quick)
    except Exception as e:
        return [_failed(getattr(mod, "TITLE", name), e)]
    tables = result.get("tables") if isinstance(result, dict) and "tables" in result else [result]
    out = []
    for t in tables:
        if not isinstance(t, dict):
            t = {"title": name, "status": "failed", "reason": f"run() returned {type(t).__name__}", "rows": []}
        t.setdefault("title", getattr(mod, "TITLE", name))
        t.setdefault("status", "ok")
        t.setdefault("rows", [])
        t["module"] = modname
        t["elapsed"] = time.perf_counter() - t0
        out.append(t)
    return out


def _failed(title: str, e: BaseException) -> dict[str, Any]:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {
        "title": title,
        "status": "failed",
        "reason": f"{type(e).__name__}: {e}",
        "traceback": "".join(tb[-6:]),
        "rows": [],
    }


# ----- the machine -----------------------------------------------------------------------------


def host() -> dict[str, str]:
    """CPU, RAM, kernel and Python of this machine: the head of every report's machine table
    (this one's and the reliability campaign's scorecard)."""
    info: dict[str, str] = {}
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["CPU"] = f"{cpu or platform.processor() or 'unknown'}, {os.cpu_count()} logical cores"
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["RAM"] = f"{kb / (1 << 20):.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    info["Kernel"] = f"{platform.system()} {platform.release()}"
    info["Python"] = platform.python_version()
    return info


def machine() -> dict[str, str]:
    info = host()
    info["Disk"] = _disk(settings().scratch)
    from importlib import metadata

    for dist in ("torch", "transformers", "safetensors", "xxhash", "matplotlib"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    try:
        import txckpt

        info["txckpt"] = f"{txckpt.__version__} ({_git_rev()})"
    except Exception:
        pass
    try:
        info["Load average"] = f"{_load_at_start} at start, {_loadavg()} at the end (1/5/15 min)"
    except Exception:
        pass
    info["Date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info["Command"] = (
        "python -m benchmarks run"
        + (" --quick" if settings().quick and not settings().tiny else "")
        + (" --tiny" if settings().tiny else "")
    )
    return info


def _disk(path: str) -> str:
    try:
        out = subprocess.run(["df", "-hT", path], capture_output=True, text=True, timeout=10).stdout.splitlines()
        dev, fstype, size, used, avail = out[-1].split()[:5]
        desc = f"{dev} ({fstype}), {size} total, {avail} free; scratch directory {path}"
        name = os.path.basename(os.path.realpath(dev))
        rot = f"/sys/block/{name}/queue/rotational"
        if os.path.exists(rot):
            with open(rot) as f:
                desc += f", /sys/block/{name}/queue/rotational = {f.read().strip()}"
        return desc
    except Exception:
        return path


def _git_rev() -> str:
    try:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--", "txckpt"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return f"git {rev}{' + uncommitted changes in txckpt/' if dirty else ''}"
    except Exception:
        return "git unknown"


def module_main(
    prog: str, run: Callable[[bool], dict[str, Any]], show: Callable[[dict[str, Any]], str], argv: list[str] | None
) -> int:
    """``python -m benchmarks.<case> [--quick|--tiny]``: one case's table, each row printed by
    ``show``, then the seconds the run took."""
    import argparse

    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    configure(quick=args.quick, tiny=args.tiny)
    t0 = time.perf_counter()
    for row in run(args.quick)["rows"]:
        print(show(row))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
