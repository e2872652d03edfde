"""txckpt's log records in a Trainer's output: at transformers' verbosity, through its handler.
Here and not in txckpt.progress because it imports transformers, which the core never does."""

from __future__ import annotations

import logging

log = logging.getLogger("txckpt")


class _ToTransformers(logging.Handler):
    """Hands txckpt's records to transformers' logger, whose handler prints them the way it
    prints the Trainer's own lines; only while the application configured no root handler (one
    that would print them too)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            logging.getLogger("transformers").handle(record)


def follow_transformers_verbosity() -> None:
    """Make txckpt's records show the way transformers' do: at its verbosity
    (``transformers.logging.set_verbosity_info()``, ``TRANSFORMERS_VERBOSITY``, a Trainer's
    ``log_level``), through its handler. The Trainer mixin calls this at each save. A level the
    application set on the ``txckpt`` logger itself is left alone."""
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger()  # configures transformers' handler if nothing did yet
    if log.level in (logging.NOTSET, getattr(log, "_txckpt_level_from_transformers", None)):
        log.setLevel(hf_logging.get_verbosity())
        log._txckpt_level_from_transformers = log.level  # type: ignore[attr-defined]
    if not any(isinstance(h, _ToTransformers) for h in log.handlers):
        log.addHandler(_ToTransformers())
