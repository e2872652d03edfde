"""A child process the test drives by handshake files (a library for the preemption tests).

The child writes small files into its handshake directory (``hs``) at the moments the test
needs (a step finished, a save begun, a result); the test polls them with a deadline, never
sleeping to synchronise, and fails with the child's output when it exits or stalls first.
Subclasses start ``proc`` (their own command line) in their ``__init__``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any


def put(path: str, text: str) -> None:
    """The child's side: write handshake file ``path`` whole (a temp file renamed into place), so
    the test's poll never reads it half written."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def newest_verified(root: str) -> tuple[str, Any]:
    """``root``'s newest committed checkpoint and its manifest, every file verified (what a
    preemption test checks once its child is gone)."""
    import txckpt

    txckpt.forget_roots()
    path = txckpt.get_last_checkpoint(root)
    assert path is not None, f"{root} has no committed checkpoint"
    return path, txckpt.verify_checkpoint(path)


class HandshakeChild:
    #: How long wait_for and finish wait when not told.
    deadline_s = 120.0
    hs: str
    rank: int
    log: str
    proc: Any  # subprocess.Popen, or the zygote's popen_python handle

    def _start(
        self, script: str, tmp_path: Any, args: Any, *, rank: int, name: str = "", env: dict | None = None
    ) -> None:
        """Start ``script`` (a tests/children file) through the zygote as the preemption tests'
        children run: ``--hs``, ``args``, ``--rank``; one thread, a coordination timeout well
        inside the deadline; stdout and stderr into the log."""
        from tests.harness.zygote import popen_python

        self._dirs(tmp_path, rank, name)
        environ = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TXCKPT_COORDINATION_TIMEOUT="120")
        environ.update(env or {})
        with open(self.log, "w") as out:
            self.proc = popen_python(
                [script, "--hs", self.hs, *args, "--rank", str(rank)], env=environ, stdout=out, stderr=out
            )

    def _dirs(self, tmp_path: Any, rank: int, name: str = "") -> None:
        self.hs, self.rank = str(tmp_path / f"hs{name}"), rank
        os.makedirs(self.hs, exist_ok=True)
        self.log = str(tmp_path / f"rank{rank}{name}.log")

    def path(self, name: str) -> str:
        return os.path.join(self.hs, name.format(r=self.rank))

    def wait_for(self, name: str, at_least: int | None = None, deadline: float | None = None) -> str:
        """The handshake file's text once it exists (and, with ``at_least``, holds a step >= it)."""
        deadline = self.deadline_s if deadline is None else deadline
        path, end = self.path(name), time.monotonic() + deadline
        while True:
            if os.path.exists(path):
                text = open(path).read()
                if at_least is None or (text and int(text) >= at_least):
                    return text
            if self.proc.poll() is not None:
                raise AssertionError(f"the child exited ({self.proc.returncode}) before {name}:\n{self.output()}")
            if time.monotonic() > end:
                self.proc.kill()
                raise AssertionError(f"no {name} after {deadline} s:\n{self.output()}")
            time.sleep(0.01)  # polling a file with a deadline

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self, deadline: float | None = None) -> int:
        deadline = self.deadline_s if deadline is None else deadline
        try:
            return self.proc.wait(deadline)
        except (subprocess.TimeoutExpired, TimeoutError):
            self.proc.kill()
            raise AssertionError(f"the child did not exit within {deadline} s:\n{self.output()}") from None

    def json(self, name: str) -> dict:
        return json.loads(open(self.path(name)).read())

    def output(self) -> str:
        return open(self.log).read()
