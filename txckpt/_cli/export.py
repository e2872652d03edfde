"""``txckpt export``: one committed checkpoint copied to a plain directory, verified."""

from __future__ import annotations

import argparse
import os
import sys

from .._read.fetch import fetch_checkpoint
from .._api import read_manifest
from ..errors import CheckpointNotFoundError, IntegrityError, UnsafePathError
from .._base.progress import bar as progress_bar, bar_wanted
from .._storage import open_storage
from .._base.fileio import lies_within
from .common import EXIT_OK, EXIT_PROBLEM, UsageError, human_bytes, open_root_arg, parse_storage_options, print_json
from .._base.layout import is_url


def cmd_export(args: argparse.Namespace) -> int:
    """Find the checkpoint and check DEST here; the copy is txckpt.fetch_checkpoint's."""
    root = open_root_arg(args.root, args.storage_options)
    history = root.history()
    if args.txid is None and args.step is None:
        raise UsageError("give --step N (a step of the current lineage) or --txid T")
    c = history.find(step=args.step, txid=args.txid)
    if c.txid in history.retired:
        raise CheckpointNotFoundError(f"checkpoint txid {c.txid} was retired by the retention policy")
    key = root.publication.locate(c.ref)
    if key is None:
        raise CheckpointNotFoundError(
            f"checkpoint step {c.step} (txid {c.txid}) is committed but its data is missing; see `txckpt verify`"
        )
    src = root.storage
    source = src.full_path(key)
    manifest = read_manifest(source, storage_options=args.storage_options)  # checked against the log
    dest_options = parse_storage_options(args.dest_storage_option) if args.dest_storage_option else args.storage_options
    dest = open_storage(args.dest, dest_options if is_url(args.dest) else None)
    dest_local = dest.local_path("")
    if dest_local is not None and os.path.lexists(dest_local) and not os.path.isdir(dest_local):
        raise UsageError(f"DEST {args.dest} is an existing file; export into a new or empty directory")
    inside = src.key_of(dest.full_path("")) is not None and dest.full_path("").startswith(src.full_path(""))
    if dest_local is not None and src.local_path("") is not None:
        # Real paths: a DEST reached through a symlink into the root is inside it (gc would
        # take the export for garbage there).
        inside = inside or lies_within(dest_local, src.local_path(""))
    if inside:
        raise UsageError(
            f"DEST {args.dest} lies inside ROOT (its real path, symlinks resolved); export outside the root"
        )
    if dest.exists("") and dest.list_dir(""):
        raise UsageError(f"DEST {args.dest} exists and is not empty; export into a new or empty directory")
    # A local DEST is installed by rename, at its real path (a symlink to a directory stays).
    target = os.path.realpath(dest_local) if dest_local is not None else args.dest
    problem: Exception | None = None
    with progress_bar("export", total=manifest.total_bytes, enabled=bar_wanted(args.no_progress, args.json)) as bar:
        try:
            fetch_checkpoint(
                source,
                target,
                storage_options=args.storage_options,
                dest_storage_options=None if dest_local is not None else dest_options,
                with_manifest=not args.no_manifest,
                durable=not args.no_sync,
                progress=bar.update,
            )
        except (IntegrityError, UnsafePathError) as e:
            problem = e
    if problem is not None:
        print(f"PROBLEM: {problem}", file=sys.stderr)
        print(f"export aborted; removed what it had written to {args.dest}", file=sys.stderr)
        return EXIT_PROBLEM
    result = {
        "source": source,
        "dest": dest.full_path(""),
        "step": c.step,
        "txid": c.txid,
        "lineage": c.lineage,
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        "manifest": not args.no_manifest,
    }
    if args.json:
        print_json(result)
    else:
        print(
            f"exported step {c.step} (lineage {c.lineage}, txid {c.txid}): {len(manifest.files)} file(s), "
            f"{human_bytes(manifest.total_bytes)}, each verified against its checksum, to {result['dest']}"
        )
    return EXIT_OK
