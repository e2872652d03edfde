"""A process that takes a preemption signal and exits through txckpt.preemption.exit(), then,
while the interpreter finalizes (after every atexit hook, when Python has reset its signal
handlers), says so through a pipe and waits there for the parent's second signal: the window
where a second SIGTERM used to kill the process by the signal (-15) instead of its status 143.

Usage: preempt_shutdown.py READY_FD GO_FD [--no-first-signal]
  READY_FD: written one byte once the interpreter is finalizing; GO_FD: read one byte (the
  parent writes it after its signal), then the finalization goes on.
  --no-first-signal: install, receive nothing, end normally (status 0)."""

from __future__ import annotations

import os
import signal
import sys

from txckpt import preemption


class LastWords:
    """Dropped when the interpreter clears ``__main__``: after the atexit hooks and after the
    finalization has reset the signal handlers (CPython's _PySignal_Fini)."""

    def __init__(self, ready_fd: int, go_fd: int) -> None:
        self.ready_fd, self.go_fd = ready_fd, go_fd

    def __del__(self, write=os.write, read=os.read) -> None:  # os may be gone by then: bound now
        write(self.ready_fd, b"r")
        read(self.go_fd, 1)


last_words = LastWords(int(sys.argv[1]), int(sys.argv[2]))
preemption.install()
if "--no-first-signal" not in sys.argv:
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.requested()
    preemption.exit()  # SystemExit(143): the interpreter shuts down as usual
