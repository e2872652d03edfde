"""The ``txckpt`` parser and :func:`main`: each command's arguments, and the exit code of what
it raised."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Sequence

from .. import __version__
from ..errors import InvalidArgumentError, MissingDependencyError, NotATxckptRootError, TxckptError
from .._base.layout import MAX_STEP
from .common import (
    EXIT_MISSING_DEPENDENCY,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    UsageError,
    configure_logging,
    parse_storage_options,
)
from .export import cmd_export
from .maintain import cmd_adopt, cmd_gc, cmd_resume
from .tensors import add_parsers as add_tensor_parsers
from .verify import cmd_verify
from .views import LS_DEFAULT_COUNT, cmd_log, cmd_ls, cmd_show


# ----- the parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option",
        "-o",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        dest="storage_option",
        help="fsspec storage option for ROOT (repeatable); VALUE is parsed as JSON when it parses",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_argument("--verbose", "-v", action="store_true", help="log txckpt's INFO messages")

    p = argparse.ArgumentParser(
        prog="txckpt",
        description="Inspect and maintain txckpt checkpoint roots.",
        epilog="Exit codes: 0 ok; 1 a problem was found (damage, missing data, a failed operation); "
        "2 usage error; 3 the backend of a ROOT URL is not installed (s3fs, gcsfs, adlfs). "
        "See docs/cli.md.",
    )
    p.add_argument("--version", action="version", version=f"txckpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sp = sub.add_parser(
        "log",
        parents=[common],
        help="the lineage graph (like git log --graph)",
        description="Draw the root's lineage graph, newest first, like git log --graph: every "
        "committed checkpoint with its step, lineage, state (current, abandoned, "
        "retired) and where its data is; forks, and HEAD, the lineage the next "
        "resume and save follow.",
    )
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument(
        "-n",
        "--max-count",
        type=int,
        default=None,
        metavar="N",
        help="show only the N newest checkpoints (default: all)",
    )
    sp.add_argument(
        "--all", action="store_true", help="also show checkpoints the retention policy retired (their data is deleted)"
    )
    sp.add_argument(
        "--format",
        choices=("text", "dot"),
        default="text",
        help="text (default) or dot: Graphviz source, e.g. `| dot -Tpng -o lineages.png`",
    )
    sp.set_defaults(func=cmd_log)

    sp = sub.add_parser(
        "ls",
        parents=[common],
        help="table of committed checkpoints and leftover staging",
        description="List committed checkpoints in a table (step, lineage, size, time, state, "
        "path), plus staging directories of saves that never committed: the "
        f"{LS_DEFAULT_COUNT} most recently committed whose data exists, of every "
        "lineage, by default; --all lists every one, retired ones included.",
    )
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument(
        "--lineage", default=None, help='only the view of this lineage ("current" for the head); default: every lineage'
    )
    sp.add_argument(
        "-n",
        "--max-count",
        type=int,
        default=LS_DEFAULT_COUNT,
        metavar="N",
        help=f"show the N most recently committed checkpoints (default {LS_DEFAULT_COUNT}; 0: no limit)",
    )
    sp.add_argument(
        "--all",
        action="store_true",
        help="every checkpoint, also those the retention policy retired (their data is deleted)",
    )
    sp.add_argument(
        "--durable",
        default=None,
        metavar="URL",
        help="ROOT is a tiered root's fast tier and URL its durable tier: add a DURABLE column "
        "(yes: committed on URL too; no: not replicated yet)",
    )
    sp.add_argument(
        "--durable-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="fsspec storage option for the --durable URL (repeatable), as -o for ROOT",
    )
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser(
        "show",
        parents=[common],
        help="a checkpoint's manifest, readable",
        description="Print one checkpoint's manifest, readable: step, lineage, txid, parent, "
        "files with sizes and checksums, metadata, and whether the root's log "
        "committed it. Give a checkpoint directory, or ROOT with --step/--txid.",
    )
    sp.add_argument("path", metavar="PATH", help="a checkpoint directory (or ROOT with --step/--txid)")
    sp.add_argument("--step", type=int, default=None, help="PATH is a root: show this step of the current lineage")
    sp.add_argument("--txid", default=None, help="PATH is a root: show the checkpoint with this txid")
    sp.set_defaults(func=cmd_show)

    sp = sub.add_parser(
        "verify",
        parents=[common],
        help="check sizes and checksums of a root or one checkpoint",
        description="Read every file of every committed checkpoint of a root (or of one "
        "checkpoint) and check its size and checksum against the manifest; report "
        "every problem and exit 1 if there is any.",
    )
    sp.add_argument("target", metavar="ROOT|PATH")
    sp.add_argument("--workers", type=int, default=None, help="parallel reads (default: 2 x CPUs, at most 8)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser(
        "gc",
        parents=[common],
        help="reclaim leftover staging, retired data, stale files",
        description="Remove what crashes and retention leave behind (staging of saves that "
        "never committed, data of retired checkpoints, stale intents, leases and "
        "temp files), printing each item and why. Never touches the log or a "
        "committed checkpoint that is not retired. Try --dry-run first.",
    )
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--dry-run", "-n", action="store_true", help="list what would be removed; change nothing")
    sp.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="age after which another host's staging, intents and temp files count as abandoned (default 3600)",
    )
    sp.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="N",
        help="retention: keep the N newest checkpoints of the current lineage",
    )
    sp.add_argument(
        "--keep-every",
        type=int,
        default=None,
        metavar="K",
        help="retention: keep checkpoints whose step is a multiple of K",
    )
    sp.add_argument(
        "--abandoned-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="retention: let abandoned checkpoints go after SECONDS abandoned (default: keep)",
    )
    sp.add_argument(
        "--keep",
        action="append",
        default=None,
        metavar="TXID|PATH",
        help="retention: always keep this checkpoint (repeatable)",
    )
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser(
        "adopt",
        parents=[common],
        help="record a legacy output_dir's checkpoint-N dirs as a lineage",
        description="Record the checkpoint-N directories of a root written without txckpt (a "
        "stock Trainer output_dir) as a lineage: hash every file now, write a "
        "manifest into each directory, commit them with one log entry.",
    )
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_adopt)

    sp = sub.add_parser(
        "export",
        parents=[common],
        help="copy a committed checkpoint to a plain directory, verified",
        description="Copy one committed checkpoint to DEST, a new or empty plain directory "
        "(local or fsspec URL), checking every file's checksum on the way.",
    )
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument("dest", metavar="DEST", help="a new or empty directory, local or fsspec URL")
    sp.add_argument("--step", type=int, default=None, help="step of the current lineage")
    sp.add_argument("--txid", default=None, help="any committed checkpoint, by txid (see `txckpt ls`)")
    sp.add_argument(
        "--dest-storage-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="storage option for DEST (default: those of ROOT)",
    )
    sp.add_argument("--no-manifest", action="store_true", help="do not copy txckpt-manifest.json")
    sp.add_argument("--no-sync", action="store_true", help="skip fsync of the exported files")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser(
        "resume",
        parents=[common],
        help="roll the root back to a committed step (forks a lineage)",
        description="Roll the root back to committed step N of the current lineage: fork a "
        "new lineage from it, which becomes the current one. The checkpoints "
        "after N in the current lineage are abandoned: kept intact (see "
        "`txckpt log`), never again returned by get_last_checkpoint, and a job "
        "still writing the old lineage is refused at its next save "
        "(StaleLineageError). Without --step, or at the newest step, nothing "
        "changes: it prints where a restart continues.",
    )
    sp.add_argument("root", metavar="ROOT")
    sp.add_argument(
        "--step",
        type=int,
        default=None,
        help="committed step of the current lineage to continue from (default: the newest); "
        "verified first: a step that fails verification is refused (exit 1)",
    )
    sp.add_argument("--no-verify", action="store_true", help="fork onto --step without verifying its files (says so)")
    sp.set_defaults(func=cmd_resume)

    add_tensor_parsers(sub, common)  # inspect, diff
    return p


def _stdout_gone() -> None:
    """The reader of stdout closed it (``txckpt log ROOT | head``): like git, stop quietly.
    Point stdout at /dev/null so the interpreter's final flush of what is still buffered does
    not fail again ("Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured in-process)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    configure_logging(args.verbose)
    try:
        args.storage_options = parse_storage_options(args.storage_option)
        for name in ("step", "keep_last", "keep_every", "workers", "max_count"):
            v = getattr(args, name, None)
            if v is not None and v < (0 if name == "step" else 1):
                raise UsageError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'step' else '>= 1'}, not {v}")
        # A step is 0 <= step < 2**63 (protocol §3): a larger one names no checkpoint, and would
        # otherwise reach the lookup as a problem found (exit 1), not the bad argument it is.
        if getattr(args, "step", None) is not None and args.step >= MAX_STEP:
            raise UsageError(f"--step must be 0 <= step < 2**63 (a step no checkpoint can have), not {args.step}")
        if getattr(args, "grace", 0) is not None and getattr(args, "grace", 0) < 0:
            raise UsageError("--grace must be >= 0")
        if getattr(args, "no_verify", False) and getattr(args, "step", None) is None:
            # Without --step nothing is forked onto, so nothing would be verified: the flag
            # would say "not verified" of nothing, or hide a typo of the step.
            raise UsageError("--no-verify goes with --step (the step to fork onto without verifying it)")
        rc = int(args.func(args))
        try:
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        except BrokenPipeError:
            _stdout_gone()
        return rc
    except BrokenPipeError:  # the command stopped in the middle of its output
        _stdout_gone()
        return EXIT_OK
    except UsageError as e:
        print(f"txckpt {args.command}: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except MissingDependencyError as e:  # one line saying what to install; the traceback only with -v
        if args.verbose:
            traceback.print_exc()
        print(f"txckpt {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_MISSING_DEPENDENCY
    except (InvalidArgumentError, NotATxckptRootError) as e:
        print(f"txckpt {args.command}: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (TxckptError, OSError) as e:  # one line; the traceback only with -v
        if args.verbose:
            traceback.print_exc()
        print(f"txckpt {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
