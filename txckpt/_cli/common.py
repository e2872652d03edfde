"""What every ``txckpt`` command shares: exit codes, the two CLI errors, output formatting,
argument parsing and opening ROOT."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Sequence

from ..errors import MissingDependencyError, NotATxckptRootError
from .._base.layout import LOG_DIR, META_DIR, entry_key, is_url
from .._base.progress import BarAwareHandler, human
from .._root.root import CheckpointRoot

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_MISSING_DEPENDENCY = 3  # a ROOT URL whose backend (s3fs, gcsfs, adlfs) is not installed


class UsageError(Exception):
    """A command line that cannot be run as given (exit code 2)."""


class Problem(Exception):
    """A problem found while running a command (exit code 1); the message is printed."""


# ----- formatting ----------------------------------------------------------------------------------
def human_bytes(n: int | None) -> str:
    return "-" if n is None else human(n, si=True)


def human_time(t: float | None) -> str:
    if not t:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = []
    for r in [header] + rows:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


# ----- argument handling ---------------------------------------------------------------------------
def parse_storage_options(items: Sequence[str] | None) -> dict[str, Any]:
    """``k=v`` pairs -> dict; values are parsed as JSON when they parse (numbers, true, {...})."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE, not {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def open_root_arg(path: str, options: dict[str, Any], *, must_exist: bool = True):
    """A CheckpointRoot for ROOT, or UsageError if there is nothing there."""
    if not is_url(path) and not os.path.isdir(path):
        raise UsageError(f"ROOT {path} is not a directory")
    try:
        root = CheckpointRoot(path, options)
    except MissingDependencyError:
        raise  # not a usage error: the command line is right, an install is missing (exit 3)
    except (ValueError, ImportError, TypeError) as e:
        raise UsageError(f"cannot open {path}: {e}") from None
    if must_exist and not _looks_like_root(root):
        raise NotATxckptRootError(
            f"{path} is not a txckpt root: it has no .txckpt/log and no checkpoint-N directories; "
            "give the training output_dir (or the URL) that holds them"
        )
    return root


def _looks_like_root(root: CheckpointRoot) -> bool:
    s = root.storage
    # Entry 0 first: listing a log of 10,000 entries to see that it is not empty cost every
    # command 9 ms on such a root; the listing still catches a log that lost entry 0.
    return s.exists(entry_key(0)) or bool(s.list_dir(LOG_DIR)) or bool(root.legacy_checkpoints()) or s.exists(META_DIR)


def configure_logging(verbose: bool) -> None:
    logger = logging.getLogger("txckpt")
    if not any(getattr(h, "_txckpt_cli", False) for h in logger.handlers):
        handler = BarAwareHandler(sys.stderr)  # a record never lands inside a progress bar
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._txckpt_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False
