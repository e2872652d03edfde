"""What txckpt tells a user while it moves data: log records and progress bars.

* :class:`Timer` times the phases of one operation (a save, a load, a fetch). Each finished
  phase is one DEBUG record; the operation's end is one INFO record with its bytes, seconds and
  throughput. Records go to the ``"txckpt"`` logger and carry their numbers as record
  attributes (``txckpt_op``, ``txckpt_phase``, ``txckpt_bytes``, ``txckpt_seconds``,
  ``txckpt_files``) for code that wants them without parsing the message. A timer costs one
  clock read per phase and nothing per chunk. The operation's owner holds its timer and ends
  each phase (a save's committer, ``txckpt._save.transactions``, ends ``commit`` and ``publish``).
* :func:`bar` is the CLI's progress bar: a tqdm bar on stderr when tqdm is installed (it comes
  with transformers, not with txckpt), stderr is a terminal and the user did not ask for none;
  otherwise an object whose methods do nothing. Code deep inside an operation (adoption's
  hashing, gc's deletions) reports with :func:`advance`, which reaches the bar the CLI opened, if
  any, without threading a callback through every signature.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from . import deps

log = logging.getLogger("txckpt")


def human(nbytes: float, *, si: bool = False) -> str:
    """``64.0 MiB``: binary units, as throughput is usually read (log records); ``si=True``:
    decimal units, ``67.1 MB``, as ``ls -h``-style listings and the CLI's tables read."""
    base, units = (1000, ("B", "kB", "MB", "GB", "TB")) if si else (1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    value = float(nbytes)
    for unit in units:
        if value < base or unit == units[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= base
    return f"{nbytes} B"  # pragma: no cover


def rate(nbytes: float, seconds: float) -> str:
    return f"{human(nbytes / seconds)}/s" if seconds > 0 else "- /s"


class Timer:
    """The phases of one operation ``op`` ("save", "load", "fetch") on ``label`` ("step 5")."""

    __slots__ = ("op", "label", "start", "_last", "phases")  # label may change once known (a load's step)

    def __init__(self, op: str, label: str):
        self.op = op
        self.label = label
        self.start = self._last = time.perf_counter()
        #: Whether phase records are wanted (DEBUG on when the operation began): a hot path
        #: tests it and skips :meth:`phase` altogether when they are not.
        self.phases = log.isEnabledFor(logging.DEBUG)

    def phase(self, name: str, nbytes: int | None = None) -> float:
        """End phase ``name`` (it began when the previous one ended); returns its seconds."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        if log.isEnabledFor(logging.DEBUG):
            extra = {"txckpt_op": self.op, "txckpt_phase": name, "txckpt_seconds": seconds, "txckpt_bytes": nbytes}
            if nbytes is None:
                log.debug("%s %s: %s %.3fs", self.op, self.label, name, seconds, extra=extra)
            else:
                log.debug(
                    "%s %s: %s %s in %.3fs (%s)",
                    self.op,
                    self.label,
                    name,
                    human(nbytes),
                    seconds,
                    rate(nbytes, seconds),
                    extra=extra,
                )
        return seconds

    def done(self, verb: str, nbytes: int, files: int, where: str) -> float:
        """The INFO summary: ``saved step 5: 3 files, 64.0 MiB (67108864 bytes) in 1.20s
        (53.3 MiB/s): s3://bucket/run/...``. Returns the operation's seconds."""
        seconds = time.perf_counter() - self.start
        if log.isEnabledFor(logging.INFO):
            log.info(
                "%s %s: %d file%s, %s (%d bytes) in %.2fs (%s): %s",
                verb,
                self.label,
                files,
                "" if files == 1 else "s",
                human(nbytes),
                nbytes,
                seconds,
                rate(nbytes, seconds),
                where,
                extra={
                    "txckpt_op": self.op,
                    "txckpt_phase": "done",
                    "txckpt_seconds": seconds,
                    "txckpt_bytes": nbytes,
                    "txckpt_files": files,
                },
            )
        return seconds


# ----- CLI progress bars ---------------------------------------------------------------------------
class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _Bar:
    """A tqdm bar that code in worker threads may advance."""

    def __init__(self, tqdm_bar: Any):
        self._bar = tqdm_bar
        self._lock = threading.Lock()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self._bar.update(n)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


_active: list[Any] = []  # the bars open now (the CLI opens one at a time)


def bar_wanted(no_progress: bool = False, json_output: bool = False, stream: Any = None) -> bool:
    """A bar only on a terminal, and not when the user asked for none or for JSON."""
    stream = sys.stderr if stream is None else stream
    if no_progress or json_output:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _columns(stream: Any) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


class bar:
    """A progress bar on stderr: ``with bar("verify", total=n, enabled=bar_wanted(...)) as b:
    b.update(k)``, or ``b = bar(...)`` ... ``b.close()``. While open, :func:`advance` reaches it.

    ``total=None`` for work whose size is learnt on the way (a count and a rate). The bar stays on the screen when it
    closes (``leave``): a bar that erased itself at the end was never seen on a run shorter than
    its first refresh. Without tqdm, a terminal or ``enabled``, every method does nothing."""

    def __init__(self, desc: str, *, total: int | None = None, enabled: bool = True, unit: str = "B"):
        self._b: Any = _NoBar()
        if enabled:
            try:
                tqdm = deps.tqdm.tqdm  # optional: a dependency of transformers, not of txckpt
            except ImportError:
                pass
            else:
                # A pty that reports no size (0x0) gets no bar from tqdm: give it one of 80x24.
                sized = _columns(sys.stderr) > 0
                # Decimal units, as the CLI's own lines print sizes (402.7 MB).
                self._b = _Bar(
                    tqdm(
                        total=total,
                        desc=desc,
                        unit=unit,
                        unit_scale=unit == "B",
                        file=sys.stderr,
                        leave=True,
                        dynamic_ncols=sized,
                        ncols=None if sized else 80,
                        nrows=None if sized else 24,
                    )
                )  # tqdm hides bars past row 0
        _active.append(self)

    def update(self, n: int = 1) -> None:
        self._b.update(n)

    def close(self) -> None:
        if self in _active:
            _active.remove(self)
            self._b.close()

    def __enter__(self) -> "bar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BarAwareHandler(logging.StreamHandler):
    """The CLI's log handler: while a bar is open, a record is written above it (tqdm.write)
    instead of into the middle of its line. It writes to ``sys.stderr`` as it is at each record,
    not as it was when the handler was made: a caller that runs the CLI in-process and swaps
    stderr (a test's capture, a redirect) must not leave a handler writing to a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        live = [b._b for b in _active if isinstance(b._b, _Bar)]
        if not live:
            return super().emit(record)
        try:
            deps.tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # pragma: no cover - as logging does
            self.handleError(record)


def advance(n: int) -> None:
    """Advance the CLI's open bar by ``n`` (bytes, or items for an item bar); nothing if none."""
    if _active:
        _active[-1].update(n)


__all__ = ["Timer", "bar", "bar_wanted", "advance", "BarAwareHandler", "human", "rate"]
