"""What the resume-equivalence tests compare (a library for tests/test_*resume_equivalence*.py):
the loss a child logged at each step, and the digest of its final weights.

A child appends ``[step, loss]`` per line to a losses file and prints ``WEIGHTS <hex>`` at its
end (tests/children/*_equivalence.py, lightning_preempt.py)."""

from __future__ import annotations

import json
import os
import re


def logged_losses(path: str | os.PathLike[str], *, rank: int, strict: bool = True) -> dict[int, float]:
    """step -> loss of one rank from its losses file. A step logged twice (re-run after a resume
    from before it) must agree where ``strict``; else the last one logged counts."""
    seen: dict[int, float] = {}
    for line in open(path):
        step, loss = json.loads(line)
        if strict:
            assert seen.setdefault(step, loss) == loss, f"rank {rank}: step {step} logged {seen[step]} and then {loss}"
        seen[step] = loss
    return seen


def final_weights(output: str) -> str:
    """The digest of a child's final weights: its last ``WEIGHTS <hex>`` line."""
    return re.findall(r"WEIGHTS ([0-9a-f]{40})", output)[-1]


__all__ = ["logged_losses", "final_weights"]
