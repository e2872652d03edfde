"""The ``txckpt`` command: see and fix what is in a root without writing Python.

Commands: log, ls, show, verify, gc, adopt, export, resume (docs/cli.md). Every command takes a
root path or fsspec URL, ``--storage-option k=v`` (repeatable) and ``--json``.

Exit codes: 0 ok; 1 a problem was found (damage, a missing checkpoint, a failed operation, any
txckpt error); 2 a usage error (bad arguments, a ROOT or PATH that does not exist or is not a
txckpt root, a non-empty export destination).

The package: :mod:`.app` (the parser and :func:`main`, the console entry point
``txckpt.cli:main``), :mod:`.common` (exit codes, formatting, opening ROOT), one module per group
of commands (:mod:`.views`: log, ls, show; :mod:`.verify`; :mod:`.export`; :mod:`.maintain`: gc,
adopt, resume) and :mod:`.logview` (the lineage graph ``txckpt log`` draws). The commands call the
library (txckpt._api, txckpt._manifest.verify, txckpt._root.root) and format what it finds.
"""

from __future__ import annotations

from .._cli.app import build_parser, main
from .._cli.common import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, Problem, UsageError, parse_storage_options
from .._cli.verify import run_verify

__all__ = [
    "main",
    "build_parser",
    "parse_storage_options",
    "run_verify",
    "UsageError",
    "Problem",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
]
