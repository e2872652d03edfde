"""txckpt's log records in a Trainer's output: at transformers' verbosity, where transformers
prints its own lines, each labelled with its level and origin. Here and not in txckpt._base.progress
because it imports transformers, which the core never does.

* Every record shows as ``[txckpt] LEVEL: message`` (transformers labels its own ``[transformers]
  ...``; with ``TRANSFORMERS_VERBOSITY=detail`` both use transformers' detailed format, which
  names the logger), so a rollback warning or a reclaim is never mistaken for transformers'.
* A resume is one INFO line (as transformers' own "Loading model from ..."), on the logger
  ``txckpt.resume``. It shows at the Trainer's default verbosity too (``log_level="passive"``,
  nothing chosen): which checkpoint a run continues is what a restarted job's log must say, and
  txckpt, not the directory listing, decides it. A verbosity the script chose (``log_level``,
  ``TRANSFORMERS_VERBOSITY``) rules it as any other record.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

from transformers.utils import logging as hf_logging

import txckpt

log = logging.getLogger("txckpt")
resume_log = logging.getLogger("txckpt.resume")

_FORMAT = "[txckpt] %(levelname)s: %(message)s"
#: transformers' own format under TRANSFORMERS_VERBOSITY=detail (transformers/utils/logging.py).
_DETAIL = "%(levelname)s [%(name)s:%(lineno)s] %(asctime)s %(message)s"


class _TrainerOutput(logging.StreamHandler):
    """Prints txckpt's records on stderr, where transformers' handler prints the Trainer's lines,
    labelled ``[txckpt] LEVEL:``; only while the application configured no root handler (one
    that would print them its own way)."""

    def __init__(self) -> None:
        super().__init__()
        detail = os.environ.get("TRANSFORMERS_VERBOSITY") == "detail"
        self.setFormatter(logging.Formatter(_DETAIL if detail else _FORMAT))

    @property
    def stream(self) -> TextIO:  # the stderr of the moment, as logging.lastResort writes to
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def follow_transformers_verbosity(args: Any = None) -> None:
    """Make txckpt's records show the way transformers' do: at its verbosity
    (``transformers.logging.set_verbosity_info()``, ``TRANSFORMERS_VERBOSITY``, a Trainer's
    ``log_level``), on its stream, labelled. The Trainer mixin calls this before a resume and
    at each save. A level the application set on the ``txckpt`` logger (or ``txckpt.resume``)
    itself is left alone. ``args``: the Trainer's TrainingArguments, which tell whether its
    verbosity was chosen (the resume line shows unless it was)."""
    hf_logging.get_logger()  # configures transformers' handler if nothing did yet
    if log.level in (logging.NOTSET, getattr(log, "_txckpt_level_from_transformers", None)):
        log.setLevel(hf_logging.get_verbosity())
        log._txckpt_level_from_transformers = log.level  # type: ignore[attr-defined]
    if resume_log.level in (logging.NOTSET, getattr(resume_log, "_txckpt_level_from_transformers", None)):
        # Chosen: by the Trainer's log_level, the environment, a level the application set on
        # the txckpt logger, or the application's own root handler (which prints at its level).
        chosen = (
            getattr(args, "log_level", "passive") != "passive"
            or "TRANSFORMERS_VERBOSITY" in os.environ
            or log.level != getattr(log, "_txckpt_level_from_transformers", None)
            or bool(logging.getLogger().handlers)
        )
        resume_log.setLevel(logging.NOTSET if chosen else min(logging.INFO, log.getEffectiveLevel()))
        resume_log._txckpt_level_from_transformers = resume_log.level  # type: ignore[attr-defined]
    if not any(isinstance(h, _TrainerOutput) for h in log.handlers):
        log.addHandler(_TrainerOutput())


def log_resume(trainer: Any, path: str | None, local: str | None) -> None:
    """One INFO line on the main process saying what train() continues from: the step and the
    lineage of the checkpoint, its path (and local copy, for a remote root). Never raises."""
    if path is None or not getattr(trainer.args, "should_log", True):
        return
    try:
        manifest = txckpt.read_manifest(local or path)
        what = f"step {manifest.step} of lineage {manifest.lineage}"
    except Exception:  # a stock checkpoint (a legacy root, an external parent); a log line never fails a resume
        what = "a checkpoint without a txckpt manifest"
    copy = f" (local copy {local})" if local and local != path else ""
    resume_log.info("resuming from %s: %s%s", what, path, copy)
