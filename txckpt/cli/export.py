"""``txckpt export``: one committed checkpoint copied to a plain directory, verified."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import CheckpointNotFoundError, IntegrityError, SpecialFileError
from ..manifest import MANIFEST_NAME, Manifest
from ..progress import bar as progress_bar, bar_wanted
from .common import (EXIT_OK, EXIT_PROBLEM, UsageError, human_bytes, is_url, open_root_arg,
                     parse_storage_options, print_json)


# ----- export --------------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    from ..checksum import HashingWriter
    from ..storage import open_storage

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
    manifest = Manifest.decode(src.read_bytes(f"{key}/{MANIFEST_NAME}"), src.full_path(f"{key}/{MANIFEST_NAME}"))
    if manifest.digest != c.digest:
        raise IntegrityError(f"{src.full_path(key)}/{MANIFEST_NAME} differs from the manifest the log committed")
    dest_options = parse_storage_options(args.dest_storage_option) if args.dest_storage_option else args.storage_options
    dest = open_storage(args.dest, dest_options if is_url(args.dest) else None)
    dest_local = dest.local_path("")
    if dest_local is not None and os.path.lexists(dest_local) and not os.path.isdir(dest_local):
        raise UsageError(f"DEST {args.dest} is an existing file; export into a new or empty directory")
    inside = src.key_of(dest.full_path("")) is not None and dest.full_path("").startswith(src.full_path(""))
    if dest_local is not None and src.local_path("") is not None:
        # Real paths: a DEST reached through a symlink into the root is inside it (gc would
        # take the export for garbage there).
        from ..storage.local import lies_within

        inside = inside or lies_within(dest_local, src.local_path(""))
    if inside:
        raise UsageError(f"DEST {args.dest} lies inside ROOT (its real path, symlinks resolved); "
                         "export outside the root")
    if dest.exists("") and dest.list_dir(""):
        raise UsageError(f"DEST {args.dest} exists and is not empty; export into a new or empty directory")
    durable = not args.no_sync
    written: list[str] = []
    problems: list[str] = []
    bar = progress_bar("export", total=manifest.total_bytes, enabled=bar_wanted(args.no_progress, args.json))
    for name, entry in sorted(manifest.files.items()):
        if src.is_symlink_escape(f"{key}/{name}"):
            problems.append(f"{src.full_path(key)}/{name}: a symlink that leaves the root (refused)")
            break
        try:
            reader = src.open_read(f"{key}/{name}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, SpecialFileError) as e:
            what = f"a {e.kind}, not a regular file" if isinstance(e, SpecialFileError) else "missing"
            problems.append(f"{src.full_path(key)}/{name}: {what}")
            break
        writer = HashingWriter(dest.open_write(name, durable=durable))
        written.append(name)
        try:
            with reader:
                while True:
                    block = reader.read(8 << 20)
                    if not block:
                        break
                    writer.write(block)
                    bar.update(len(block))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        if writer.size != entry.size or writer.digest != entry.checksum:
            problems.append(f"{src.full_path(key)}/{name}: {writer.size} bytes / xxh3-128 {writer.digest}, "
                            f"the manifest says {entry.size} / {entry.checksum}: the source is damaged")
            break
    bar.close()
    if problems:
        for name in written:
            dest.delete_file(name)
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        print(f"export aborted; removed the {len(written)} file(s) it had written to {args.dest}", file=sys.stderr)
        return EXIT_PROBLEM
    if not args.no_manifest:
        dest.create_exclusive(MANIFEST_NAME, src.read_bytes(f"{key}/{MANIFEST_NAME}"), durable=durable)
    if durable:
        dirs = {n.rsplit("/", 1)[0] for n in manifest.files if "/" in n}
        for d in sorted(dirs, key=len, reverse=True):
            dest.sync_dir(d)
        dest.sync_dir("")
    result = {"source": src.full_path(key), "dest": dest.full_path(""), "step": c.step, "txid": c.txid,
              "lineage": c.lineage, "files": len(manifest.files), "bytes": manifest.total_bytes,
              "manifest": not args.no_manifest}
    if args.json:
        print_json(result)
    else:
        print(f"exported step {c.step} (lineage {c.lineage}, txid {c.txid}): {len(manifest.files)} file(s), "
              f"{human_bytes(manifest.total_bytes)}, each verified against its checksum, to {result['dest']}")
    return EXIT_OK
