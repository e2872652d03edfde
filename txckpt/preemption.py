"""Preemption: a termination signal (SLURM's, Kubernetes', a spot VM's SIGTERM) becomes "save at
the next step boundary, then exit", agreed by every rank. docs/preemption.md is the contract.

``install()`` replaces the signals' handlers with one that only records the signal: it sets
two module attributes and writes the signal's number to a self-pipe (a non-blocking
``os.write``; no lock, no I/O on a file, no logging: the handler interrupts the main thread
wherever it is, maybe inside the logging lock or an async save's hand-off). Everything else runs
on a watchdog thread that blocks on the pipe: it logs, and it is the one that exits when the
loop cannot (a second signal: at once; the grace ran out: after it), with ``os._exit(128 +
signum)``, the status a process killed by the signal reports to a shell.

The loop polls :func:`requested` at its step boundaries; inside a process group it is one
all-reduce (MAX) of the received signal's number on txckpt's gloo group, so every rank answers
the same at the same step. :func:`exit` then finishes the pending async saves (within the
grace), logs which committed and which were abandoned, and raises SystemExit.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, NoReturn, Sequence

from ._base import deps
from ._async.asyncsave import SaveFuture, mark_reported, recent_saves
from ._base.coordination import TorchDistributed, current_coordinator
from .errors import CoordinationTimeoutError, InvalidArgumentError, SignalNotCatchableError

log = logging.getLogger("txckpt")

DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
_SENTINEL = 0  # the byte uninstall writes: no signal has number 0
_WAKE = 0xFF  # the byte _note writes: look at the deadline again (no signal has number 255)
#: Signals no handler can replace: signal.signal raises EINVAL for them.
_UNCATCHABLE = frozenset(int(s) for s in (signal.SIGKILL, signal.SIGSTOP))

#: How the process ends when it cannot wait any longer (tests replace it).
_exit: Callable[[int], Any] = os._exit


class _Installed:
    """One install(): the previous handlers, the self-pipe, what the handler recorded and what
    the watchdog saw."""

    def __init__(self, signals: tuple[int, ...], grace_s: float | None):
        self.signals, self.grace_s = signals, grace_s
        self.previous: dict[int, Any] = {}
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.wfd, False)
        # Written by the handler only (plain attribute stores):
        self.signum = 0  # the first signal's number
        self.count = 0  # signals received
        self.t_signal: float | None = None  # time.monotonic() at the first
        # Set once by _note, the first of the watchdog, requested() and exit() to see the signal:
        self.lock = threading.Lock()
        self.noted = False
        self.deadline: float | None = None
        self.at_signal: list[SaveFuture] = []
        self.report_lock = threading.Lock()
        self.exiting = False
        self.thread: threading.Thread | None = None


_current: _Installed | None = None
_agreed = 0  # the signal every rank agreed on (requested() returned True), 0 before


def _handler(signum: int, frame: Any) -> None:
    st = _current
    if st is None:
        return
    if not st.signum:
        st.t_signal = time.monotonic()
        st.signum = signum
    st.count += 1
    try:
        os.write(st.wfd, bytes((signum & 0xFF,)))
    except OSError:  # a full pipe: the watchdog has bytes enough to act on; a closed one: uninstalled
        pass


def install(signals: Sequence[int] = DEFAULT_SIGNALS, *, grace_s: float | None = None) -> None:
    """Make ``signals`` (SIGTERM and SIGUSR1 by default) ask the training loop to save at its
    next step boundary and stop, instead of killing the process: from now on they no longer
    end it by themselves; the loop polls :func:`requested` and calls :func:`exit`.

    ``grace_s``: seconds from the first signal after which the process exits anyway, with status
    128 + signum, whatever it is doing (a loop that never polls, a save that takes too long);
    give a little less than the scheduler's grace before its SIGKILL. None: no deadline. A second
    signal exits at once (the same status), abandoning a pending save; the root keeps its last
    committed checkpoint. Call from the main thread (Python's rule for handlers), once:
    :func:`uninstall` restores the previous handlers."""
    global _current, _agreed
    sigs = tuple(int(s) for s in signals)
    if not sigs:
        raise InvalidArgumentError("txckpt.preemption.install: signals is empty")
    if grace_s is not None and not (float(grace_s) >= 0 and float(grace_s) != float("inf")):
        raise InvalidArgumentError(f"txckpt.preemption.install: grace_s must be >= 0 seconds or None, not {grace_s!r}")
    if _current is not None:
        raise InvalidArgumentError(
            "txckpt.preemption.install: already installed; call txckpt.preemption.uninstall() first"
        )
    if threading.current_thread() is not threading.main_thread():
        raise InvalidArgumentError(
            "txckpt.preemption.install must be called from the main thread (Python runs signal handlers there only)"
        )
    uncatchable = [s for s in sigs if s in _UNCATCHABLE]
    if uncatchable:
        raise SignalNotCatchableError(
            f"txckpt.preemption.install: {', '.join(_name(s) for s in uncatchable)} cannot be caught by any "
            "process (the kernel ends it at once), so no save can follow it; install the signal the scheduler "
            "sends first (SIGTERM, or SIGUSR1 with SLURM's --signal) and give grace_s a little less than "
            "the time before its SIGKILL",
            signals=list(uncatchable),
        )
    st = _Installed(sigs, None if grace_s is None else float(grace_s))
    try:
        for s in sigs:
            previous = signal.getsignal(s)
            signal.signal(s, _handler)
            st.previous[s] = previous  # recorded once replaced: only those are restored below
    except (ValueError, OSError) as e:
        for replaced, prev in st.previous.items():
            signal.signal(replaced, prev if prev is not None else signal.SIG_DFL)
        _close(st)
        raise SignalNotCatchableError(
            f"txckpt.preemption.install: cannot handle signal {_name(s)}: {e}; "
            "give signals a process may catch (SIGTERM, SIGUSR1, ...)",
            signals=[s],
        ) from e
    _current, _agreed = st, 0
    st.thread = threading.Thread(target=_watch, args=(st,), name="txckpt-preemption", daemon=True)
    st.thread.start()


def uninstall() -> None:
    """Restore the handlers install() replaced, stop its watchdog and forget the signal (and
    the agreement) it recorded. Nothing happens if it is not installed."""
    global _current, _agreed
    st = _current
    if st is None:
        return
    for s, prev in st.previous.items():
        signal.signal(s, prev if prev is not None else signal.SIG_DFL)
    _current, _agreed = None, 0
    try:
        os.write(st.wfd, bytes((_SENTINEL,)))
    except OSError:
        pass
    if st.thread is not None and st.thread is not threading.current_thread():
        st.thread.join(5)
    _close(st)


def _close(st: _Installed) -> None:
    for fd in (st.rfd, st.wfd):
        try:
            os.close(fd)
        except OSError:
            pass


def installed() -> bool:
    """Whether install() is in effect in this process (the Trainer's ``txckpt_save_on_preemption``
    installs only where the script did not)."""
    return _current is not None


def received() -> int:
    """The number of the first signal this process received since install() (0: none). Local:
    no collective."""
    st = _current
    return st.signum if st is not None else 0


def requested(*, collective: bool = True) -> bool:
    """Whether the loop should save and stop at this step boundary. Inside an initialised
    process group of more than one rank (and ``collective``, the default) it is one all-reduce
    (MAX) of the signal number each rank received, on txckpt's gloo group: True on every rank
    at the same call if any rank got a signal, so every rank saves the same step. Every rank
    must then call it at the same points, as any collective. Once True it stays True (without a
    collective). ``collective=False``: this process's own flag, no collective (what a rank
    may ask anywhere, e.g. to log). Not installed: False, still collectively."""
    global _agreed
    if _agreed:
        return True
    local = received()
    st = _current
    if local and st is not None:
        _note(st, local)
    if not collective:
        return bool(local)
    agreed = _all_ranks_max(local)
    if agreed:
        _agreed = agreed
        if not local:
            log.warning("txckpt: another rank received %s: this rank saves and stops at this step too", _name(agreed))
            if st is not None:  # its grace starts now, on this rank
                _note(st, agreed, agreed=True)
    return bool(agreed)


def _all_ranks_max(local: int) -> int:
    coord = current_coordinator(phase="preemption")
    if not isinstance(coord, TorchDistributed):
        return local
    torch, dist = deps.torch, deps.torch_distributed
    t = torch.tensor([local], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=coord.group)
    except Exception as e:
        raise CoordinationTimeoutError(
            f"txckpt.preemption.requested: the all-reduce across {coord.world_size} ranks failed on rank "
            f"{coord.rank}: {e}. Every rank must call requested() at the same points of the loop; "
            "another rank died or is slower than the coordination timeout.",
            phase="preemption",
        ) from e
    return int(t.item())


def exit_status() -> int:
    """128 + the signal's number (143 for SIGTERM; the agreed one on a rank that received none):
    the status :func:`exit` and the watchdog exit with. 0 if no signal was received or agreed."""
    signum = received() or _agreed
    return 128 + signum if signum else 0


def exit(status: int | None = None) -> NoReturn:
    """End the process after a preemption, at a step boundary: wait for this process's pending
    async saves (until the grace runs out, if install() was given one; every rank waits for its
    own part of a multi-rank save), log at WARNING each one committed during the shutdown, at
    ERROR each that failed or is abandoned, then raise SystemExit(``status``, default
    :func:`exit_status`) so the interpreter shuts down as usual. A save still pending when the
    grace runs out is abandoned: the process exits at once with os._exit (nothing more can be
    waited for), the root keeps its last committed checkpoint."""
    st = _current
    code = exit_status() if status is None else int(status)
    if st is not None and (st.signum or _agreed):
        _note(st, st.signum or _agreed, agreed=not st.signum)
    deadline = st.deadline if st is not None else None
    with st.report_lock if st is not None else threading.Lock():
        if st is not None:
            st.exiting = True
        saves = _shutdown_saves(st)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        concurrent.futures.wait(saves, timeout=timeout)
        abandoned = _report(saves, "exit")
    if abandoned:
        _hard_exit(code, f"the grace of {st.grace_s if st else 0:g} s ran out")
    raise SystemExit(code)


def _shutdown_saves(st: _Installed | None) -> list[SaveFuture]:
    """The saves a shutdown reports: those pending when the signal arrived, and every one
    requested since (finished or not)."""
    since = st.t_signal if st is not None and st.t_signal is not None else None
    saves = list(st.at_signal) if st is not None else []
    for f in recent_saves():
        if f not in saves and (not f.done() or (since is not None and f.submitted >= since)):
            saves.append(f)
    return saves


def _describe(f: SaveFuture) -> str:
    return f"{f.root} step {f.step}" if f.step is not None else str(f.root)


def _report(saves: list[SaveFuture], why: str) -> list[SaveFuture]:
    """Log each save's outcome; return those still pending (abandoned)."""
    abandoned = []
    for f in saves:
        if not f.done():
            abandoned.append(f)
            log.error(
                "txckpt: preemption (%s): abandoned the async save of %s, still pending: not committed; "
                "the root keeps its last committed checkpoint",
                why,
                _describe(f),
            )
            continue
        e = concurrent.futures.Future.exception(f)
        mark_reported(f)  # reported here: not again by wait_for_saves nor the exit hook
        if e is not None:
            log.error(
                "txckpt: preemption (%s): the async save of %s failed: %s: %s", why, _describe(f), type(e).__name__, e
            )
        else:
            log.warning("txckpt: preemption (%s): committed %s", why, concurrent.futures.Future.result(f))
    if not saves:
        log.warning("txckpt: preemption (%s): no async save was pending", why)
    return abandoned


def _hard_exit(code: int, why: str) -> None:
    log.error("txckpt: preemption: exiting now with status %d (%s)", code, why)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    _exit(code)  # os._exit; only a test's replacement returns


def decide(signals: int, now: float, deadline: float | None) -> str:
    """The watchdog's decision after ``signals`` signals at ``now`` (monotonic): ``"exit"`` at
    once for a second signal, ``"grace"`` once the deadline passed (exit after reporting),
    ``"wait"`` otherwise (the loop is expected to poll requested())."""
    if signals >= 2:
        return "exit"
    if signals and deadline is not None and now >= deadline:
        return "grace"
    return "wait"


def _watch(st: _Installed) -> None:
    seen = 0
    while True:
        timeout = None if st.deadline is None else max(0.0, st.deadline - time.monotonic())
        try:
            ready = select.select([st.rfd], [], [], timeout)[0]
            data = os.read(st.rfd, 64) if ready else b""
        except (OSError, ValueError):  # the pipe closed under us: uninstalled
            return
        if ready and (not data or _SENTINEL in data or _current is not st):
            return
        signums = [b for b in data if b != _WAKE]
        for signum in signums:
            seen += 1
            if seen == 1:
                _note(st, signum)
        action = decide(max(seen, 1 if st.noted else 0), time.monotonic(), st.deadline)
        if action == "exit":
            _report(_shutdown_saves(st), f"a second {_name(signums[-1])}")
            _hard_exit(exit_status(), f"a second signal, {_name(signums[-1])}")
            return
        if action == "grace":
            _grace_ran_out(st)
            return


def _note(st: _Installed, signum: int, *, agreed: bool = False) -> None:
    """Start the shutdown once: the deadline (from the handler's time; on a rank that received
    no signal, from the agreement: now), the saves pending now, the log line."""
    with st.lock:
        if st.noted:
            return
        st.noted = True
        if st.t_signal is None or agreed:
            st.t_signal = time.monotonic()
        if st.grace_s is not None:
            st.deadline = st.t_signal + st.grace_s
        st.at_signal = [f for f in recent_saves() if not f.done()]
    try:
        os.write(st.wfd, bytes((_WAKE,)))  # the watchdog now has a deadline to wait for
    except OSError:
        pass
    log.warning(
        "txckpt: %s %s: the training loop saves and stops at its next step boundary "
        "(txckpt.preemption.requested()); %d async save(s) pending; %s; a second signal exits at once",
        "agreed on" if agreed else "received",
        _name(signum),
        len(st.at_signal),
        "no deadline" if st.grace_s is None else f"exiting anyway in {st.grace_s:g} s",
    )


def _grace_ran_out(st: _Installed) -> None:
    # exit() may be reporting: its wait ends at the same deadline, and it then exits itself.
    with st.report_lock:
        if not st.exiting:
            _report(_shutdown_saves(st), "the grace ran out")
    _hard_exit(exit_status(), f"the grace of {st.grace_s:g} s ran out")


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) has no watchdog and shares the parent's pipe: its
    # own SIGTERM must not count as the parent's second signal. It gets the handlers back.
    global _current, _agreed
    st = _current
    _current, _agreed = None, 0
    if st is None:
        return
    try:
        for s, prev in st.previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    _close(st)


def _at_interpreter_exit() -> None:
    """After a signal, keep the exit status 128 + signum through the interpreter's finalization.

    Once the atexit hooks have run, the watchdog can no longer act on a second signal (a daemon
    thread stops when it next needs the interpreter), and the finalization resets every Python
    handler to SIG_DFL: a second SIGTERM landing there killed the process by the signal (-15 to
    Popen and torchrun) instead of letting it end with the 143 that exit() raised. The process is
    already exiting, so from here on the installed signals are ignored (SIG_IGN, which the
    finalization keeps). Registered when this module is imported, so it runs after the atexit
    hooks registered later (torch.distributed's, the script's): during those the watchdog
    still exits at once on a second signal. Without a signal received, nothing changes."""
    st = _current
    if st is None or not (st.signum or _agreed):
        return
    for s in st.signals:
        try:
            signal.signal(s, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread's interpreter: nothing to keep
            pass


atexit.register(_at_interpreter_exit)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = [
    "install",
    "uninstall",
    "installed",
    "requested",
    "received",
    "exit",
    "exit_status",
    "decide",
    "DEFAULT_SIGNALS",
]
