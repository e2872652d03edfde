"""``txckpt inspect`` and ``txckpt diff``: a checkpoint's tensors, and two checkpoints' tensors
compared, from their manifests' tensor index alone (no tensor data read)."""

from __future__ import annotations

import argparse
import os

from .._tensors.inspect import ADDED, CHANGED, REMOVED, SAME, CheckpointContents, diff_checkpoints, inspect_checkpoint
from .._base.layout import is_url
from .common import EXIT_OK, EXIT_PROBLEM, UsageError, human_bytes, print_json, table


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _exists(path: str) -> None:
    if not is_url(path) and not os.path.exists(path):
        raise UsageError(f"PATH {path} does not exist")


def _no_index_note(c: CheckpointContents) -> str:
    return (
        f"{c.path} has no tensor index for every safetensors file (written before txckpt recorded "
        "one, or a header it could not read): its tensors are listed only where indexed; its files follow"
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    _exists(args.path)
    c = inspect_checkpoint(args.path, storage_options=args.storage_options or None)
    if args.json:
        print_json(c.to_json())
        return EXIT_OK
    total = sum(t.nbytes for t in c.tensors)
    print(f"checkpoint  {c.path}")
    print(f"step        {c.step}")
    print(f"lineage     {c.lineage}")
    print(f"tensors     {len(c.tensors)} ({human_bytes(total)})")
    if not c.indexed:
        print(f"note        {_no_index_note(c)}")
    encoded = sum(1 for t in c.tensors if t.encoding is not None)
    if encoded:  # DCP items: their stored bytes are a torch.save stream, not the raw tensor
        print(f"note        {encoded} tensors are DCP items stored as torch.save streams (SIZE: the stream's)")
    if c.tensors:
        print()
        rows = [[t.name, t.file, t.dtype, _shape(t.shape), human_bytes(t.nbytes), t.digest[:12]] for t in c.tensors]
        print(table(rows, ["TENSOR", "FILE", "DTYPE", "SHAPE", "SIZE", "DIGEST"]))
    print()
    rows = [
        [
            f.name,
            f.kind,
            human_bytes(f.size),
            "-" if f.tensors is None else str(f.tensors),
            str(f.chunks) if f.indexed else "no index",
        ]
        for f in c.files
    ]
    print(table(rows, ["FILE", "KIND", "SIZE", "TENSORS", "CHUNKS"]))
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    _exists(args.a)
    _exists(args.b)
    d = diff_checkpoints(args.a, args.b, storage_options=args.storage_options or None)
    if args.json:
        print_json(d.to_json())
        return EXIT_OK
    counts = d.counts()
    print(f"a  {d.a.path} (step {d.a.step}, lineage {d.a.lineage})")
    print(f"b  {d.b.path} (step {d.b.step}, lineage {d.b.lineage})")
    for c in (d.a, d.b):
        if not c.indexed:
            print(f"note: {_no_index_note(c)}")
    print(
        f"{counts[SAME]} same, {counts[CHANGED]} changed, {counts[ADDED]} added, {counts[REMOVED]} removed "
        f"(of {len(d.changes)} tensors)"
    )
    rows = []
    for ch in d.changes:
        if ch.status == SAME and not args.all:
            continue
        what = []
        if ch.dtype_changed:
            assert ch.a is not None and ch.b is not None
            what.append(f"dtype {ch.a.dtype} -> {ch.b.dtype}")
        if ch.shape_changed:
            assert ch.a is not None and ch.b is not None
            what.append(f"shape {_shape(ch.a.shape)} -> {_shape(ch.b.shape)}")
        if ch.status == CHANGED and not what:
            what.append("values")
        info = ch.b if ch.b is not None else ch.a
        assert info is not None
        rows.append([ch.status, ch.key, info.dtype, _shape(info.shape), human_bytes(info.nbytes), "; ".join(what)])
    if rows:
        print()
        print(table(rows, ["STATUS", "TENSOR", "DTYPE", "SHAPE", "SIZE", "CHANGE"]))
    # Like diff(1): 0 when the tensors are the same, 1 when they differ.
    return EXIT_OK if counts[CHANGED] + counts[ADDED] + counts[REMOVED] == 0 else EXIT_PROBLEM


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """The ``inspect`` and ``diff`` commands of ``txckpt``."""
    sp = sub.add_parser(
        "inspect",
        parents=[common],
        help="a checkpoint's tensors (name, dtype, shape, size, digest) and files, reading no tensor data",
        description="List the tensors (name, file, dtype, shape, size, digest) and files of one "
        "committed checkpoint from its manifest's tensor index: no tensor data is read. A "
        "checkpoint written before the index lists its files and says so.",
    )
    sp.add_argument("path", metavar="PATH", help="a checkpoint directory (local or URL)")
    sp.set_defaults(func=cmd_inspect)

    sp = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two checkpoints tensor by tensor (same/changed/added/removed), from digests",
        description="Compare the tensors of two committed checkpoints (any lineages, any roots) "
        "from their manifests' digests alone, reading no tensor data: each tensor same, "
        "changed (dtype or shape changes named), added (in B only) or removed (in A only). "
        "Exit 0 when every tensor is the same, 1 when any differs.",
    )
    sp.add_argument("a", metavar="A", help="a checkpoint directory (local or URL)")
    sp.add_argument("b", metavar="B", help="a checkpoint directory (local or URL)")
    sp.add_argument("--all", action="store_true", help="also list the tensors that are the same")
    sp.set_defaults(func=cmd_diff)
