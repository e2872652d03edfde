"""``txckpt log``, ``ls`` and ``show``: what a root holds, read-only."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .._base import checksum
from .._api import read_manifest
from ..errors import AmbiguousCheckpointNameError, CheckpointNotFoundError, NotACheckpointError, TxckptError
from .._maintenance.intents import read_intents, staged_step, tree_bytes, writer_status
from .._base.layout import LOG_DIR, TX_DIR
from .._read.reader import enclosing_root
from .._base.refs import ExternalParent, Ref, parent_to_json
from .._root.root import CheckpointRoot
from .common import (
    EXIT_OK,
    EXIT_PROBLEM,
    UsageError,
    human_bytes,
    human_time,
    open_root_arg,
    parse_storage_options,
    print_json,
    table,
)
from .._base.layout import is_url
from .logview import build_graph, render_dot, render_text


# ----- log: the lineage graph (drawn by txckpt/logview.py) ----------------------------------------
def cmd_log(args: argparse.Namespace) -> int:
    if args.json and args.format != "text":
        raise UsageError("--json and --format dot are alternatives; give one")
    root = open_root_arg(args.root, args.storage_options)
    history = root.history()
    if history.state.seq < 0:
        legacy = root.legacy_checkpoints()
        naming = root.publication.naming
        if args.json:
            print_json({"head": None, "lineages": [], "nodes": [], "legacy_steps": legacy})
        elif args.format == "dot":
            try:  # as named on disk (checkpoint_4, checkpoint-00500), where one name holds each step
                names = dict(root.legacy_dirs())
            except AmbiguousCheckpointNameError:
                names = {}
            print(
                "digraph txckpt {\n  "
                + " -> ".join(f'"{names.get(s) or naming.public(s)} (legacy)"' for s in legacy)
                + "\n}"
            )
        else:
            print(
                f"{root.url} has no txckpt log; legacy {naming.public('N')} steps: {legacy or 'none'}. "
                "Run `txckpt adopt ROOT` to record them as a lineage."
            )
        return EXIT_OK
    graph = build_graph(root, history, max_count=args.max_count or None, include_retired=args.all)
    if args.json:
        print_json({k: v for k, v in graph.items() if k != "lines"} | {"graph": [p for p, _ in graph["lines"]]})
    elif args.format == "dot":
        print(render_dot(graph, f"txckpt log {root.url}"))
    else:
        print(render_text(graph))
    return EXIT_OK


# ----- ls ------------------------------------------------------------------------------------------
def staged_leftovers(root: CheckpointRoot, history: Any) -> list[dict[str, Any]]:
    """Uncommitted staging directories, with whether their writer is still alive."""
    intents = read_intents(root.storage)
    now = time.time()
    out = []
    for txid in root.storage.list_dir(TX_DIR):
        if txid in history.checkpoints:
            continue
        key = f"{TX_DIR}/{txid}"
        step = staged_step(root.storage, key)
        parts = txid.split("-")
        lineage = parts[1] if len(parts) >= 3 else "?"
        intent = intents.get(txid)
        gone, why = writer_status(intent, now=now, grace_seconds=float("inf"))
        t = (intent or {}).get("time") or root.storage.modified_time(key)
        out.append(
            {
                "step": step,
                "lineage": lineage,
                "txid": txid,
                "state": "staged-leftover" if gone else "staging",
                "bytes": tree_bytes(root.storage, key),
                "time": t,
                "path": root.storage.full_path(key),
                "key": key,
                "adopted": False,
                "published": False,
                "writer": why,
            }
        )
    return out


#: How many checkpoints ``txckpt ls`` lists without ``--all`` or ``-n``: a screenful, so that the
#: command costs the same on a root of 10,000 commits as on one of 50 (a listing that grows with
#: the history would be the one reader whose cost does).
LS_DEFAULT_COUNT = 20


def _ls_choose(root: CheckpointRoot, history: Any, args: argparse.Namespace) -> tuple[list[Any], int]:
    """The log checkpoints ``ls`` lists, and how many it leaves out. Without ``--all`` retired
    ones (data deleted) are left out, and only the ``-n`` most recently committed are kept:
    picked from the newest end of the history, never by a pass over every checkpoint."""
    limit = None if args.all or args.max_count <= 0 else args.max_count
    if args.lineage is not None:
        view = history.in_view(None if args.lineage == "current" else args.lineage)
        return (view, 0) if limit is None or len(view) <= limit else (view[-limit:], len(view) - limit)
    if args.all:
        return sorted(history.checkpoints.values(), key=lambda c: (c.step, c.seq)), 0
    chosen: list[Any] = []
    for c in reversed(history.checkpoints.values()):  # log order: the newest commits last
        if limit is not None and len(chosen) == limit:
            break
        if c.txid not in history.retired:
            chosen.append(c)
    live = len(history.checkpoints) - len(history.retired)
    return chosen, live - len(chosen)


def cmd_ls(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    history = root.history()
    rows_json: list[dict[str, Any]] = []
    omitted = 0
    if history.state.seq < 0:
        for step, key in root.legacy_dirs():
            rows_json.append(
                {
                    "step": step,
                    "lineage": "-",
                    "txid": None,
                    "state": "legacy",
                    "bytes": sum(max(0, s) for _, s in root.storage.walk_files(key)),
                    "time": root.storage.modified_time(key),
                    "path": root.storage.full_path(key),
                    "key": key,
                    "adopted": False,
                    "published": True,
                }
            )
    else:
        chosen, omitted = _ls_choose(root, history, args)
        for info in root.describe(chosen, history=history):
            rows_json.append(
                {
                    "step": info.step,
                    "lineage": info.lineage,
                    "txid": info.txid,
                    "state": info.state,
                    "bytes": info.bytes,
                    "time": info.time,
                    "path": info.path,
                    "key": root.storage.key_of(info.path) if info.path else None,
                    "adopted": info.adopted,
                    "published": info.published,
                    "files": info.files,
                    "missing": info.path is None and info.state != "retired",
                    "shared_bytes": _shared_bytes_at(info.path),
                }
            )
    durable_error = _mark_durable(rows_json, args) if args.durable is not None else None
    if args.lineage is None:
        rows_json.extend(staged_leftovers(root, history))
    rows_json.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["time"] or 0))
    if omitted or (not args.all and history.retired and args.lineage is None):
        # On stderr, so that the table (or the JSON) on stdout stays what a tool reads.
        left = f"{omitted:,} older checkpoint(s) not listed (`-n N` lists the N newest)" if omitted else ""
        retired = f"{len(history.retired):,} retired (data deleted)" if history.retired and args.lineage is None else ""
        note = f"txckpt ls: {'; '.join(x for x in (left, retired) if x)}; `--all` lists every one"
    else:
        note = None
    if args.json:
        print_json(rows_json)
    else:
        _print_ls_table(rows_json)
    if note:
        print(note, file=sys.stderr)
    if durable_error is not None:
        print(
            f"txckpt ls: the durable tier {args.durable} could not be read ({durable_error}): DURABLE shows '?'",
            file=sys.stderr,
        )
        return EXIT_PROBLEM
    return EXIT_OK


def _mark_durable(rows_json: list[dict[str, Any]], args: argparse.Namespace) -> TxckptError | OSError | None:
    """``ls --durable URL``: each row's ``durable`` (True: its txid is committed, and not retired,
    on the durable tier, the tiered root's definition of durable, docs/tiered.md §14; None: the
    durable tier could not be read, whose error is returned)."""
    try:
        durable = CheckpointRoot(args.durable, parse_storage_options(args.durable_option))
        state = durable.state()
        hist = durable.history() if state.seq >= 0 else None
    except (TxckptError, OSError) as e:
        for r in rows_json:
            r["durable"] = None
        return e
    for r in rows_json:
        r["durable"] = hist is not None and r["txid"] in hist.checkpoints and r["txid"] not in hist.retired
    return None


def _print_ls_table(rows_json: list[dict[str, Any]]) -> None:
    rows = []
    for r in rows_json:
        state = r["state"]
        if r.get("adopted"):
            state += " (adopted)"
        if r.get("missing"):
            state += " (data missing!)"
        where = r["key"] if r["key"] is not None else ("(deleted)" if r["state"] == "retired" else "(missing)")
        rows.append(
            [
                str(r["step"] if r["step"] is not None else "?"),
                r["lineage"],
                human_bytes(r["bytes"]),
                human_bytes(r.get("shared_bytes") or 0),
                human_time(r["time"]),
                state,
                where,
            ]
        )
    headers = ["STEP", "LINEAGE", "SIZE", "SHARED", "TIME", "STATE", "PATH"]
    if any("durable" in r for r in rows_json):  # ls --durable: a tiered root's fast tier
        for row, r in zip(rows, rows_json):
            mark = r.get("durable")
            row.insert(6, ("?" if mark is None else "yes" if mark else "no") if "durable" in r else "")
        headers.insert(6, "DURABLE")
    if not any(r.get("shared_bytes") for r in rows_json):  # no incremental save: no column
        rows = [row[:3] + row[4:] for row in rows]
        headers.remove("SHARED")
    if not rows:
        print("no checkpoints")
    else:
        print(table(rows, headers))


# ----- show ----------------------------------------------------------------------------------------
def _find_root_of(path: str, options: dict[str, Any]) -> Any | None:
    """The txckpt root (one with a log) a checkpoint directory lies in, found by txckpt._read.reader."""
    base = enclosing_root(path)
    if base is None:
        return None
    try:
        candidate = CheckpointRoot(base, options)
        return candidate if candidate.storage.list_dir(LOG_DIR) else None
    except Exception:  # not a root we can open: show the manifest without a state
        return None


def _checkpoint_arg(args: argparse.Namespace) -> tuple[str, Any | None]:
    """PATH of a checkpoint, from PATH or from ROOT --step/--txid."""
    if args.step is None and args.txid is None:
        return args.path, None
    root = open_root_arg(args.path, args.storage_options)
    history = root.history()
    c = history.find(step=args.step, txid=args.txid)
    if c.txid in history.retired:
        raise CheckpointNotFoundError(f"checkpoint txid {c.txid} was retired by the retention policy")
    where = root.locate(c.ref)
    if where is None:
        raise CheckpointNotFoundError(f"checkpoint step {c.step} (txid {c.txid}) is committed but its data is missing")
    return where, root


def _shared_bytes(path: str, manifest: Any) -> int | None:
    """On a local disk, the bytes of the checkpoint's files that another name also holds (an
    incremental save's hard links: deleting this checkpoint frees none of them). None on an
    object store, where every checkpoint holds its own copies."""
    if is_url(path):
        return None
    total = 0
    for name, entry in manifest.files.items():
        try:
            if os.stat(os.path.join(path, *name.split("/"))).st_nlink > 1:
                total += entry.size
        except OSError:  # missing: `txckpt verify` reports it
            pass
    return total


def _shared_bytes_at(path: str | None) -> int | None:
    """``ls``: :func:`_shared_bytes` of the checkpoint at ``path``, a local one only (a stat per
    file: the listing is a screenful); None elsewhere or where it cannot be read."""
    if path is None or is_url(path):
        return None
    try:
        return _shared_bytes(path, read_manifest(path))
    except (OSError, TxckptError):
        return None


def cmd_show(args: argparse.Namespace) -> int:
    path, root = _checkpoint_arg(args)
    if not is_url(path) and not os.path.exists(path):
        raise UsageError(f"PATH {path} does not exist")
    try:
        manifest = read_manifest(path, storage_options=args.storage_options)
    except NotACheckpointError:
        tip = open_root_arg(path, args.storage_options).state().head_tip
        example = f"e.g. --step {tip.step}, the newest; " if tip else ""
        raise UsageError(
            f"{path} is a root, not a checkpoint: add --step N for a step of its current lineage "
            f"({example}`txckpt ls ROOT` lists them) or --txid T for any lineage, or give a checkpoint "
            "directory"
        ) from None
    status = None
    r = root if root is not None else _find_root_of(path, args.storage_options)
    if r is not None:
        h = r.history()
        c = h.checkpoints.get(manifest.txid)
        if c is None or c.digest != manifest.digest:
            status = "NOT committed in this root (a staging leftover, or copied from elsewhere)"
        else:  # the root's own state rules: current, abandoned or retired
            status = r.describe([c], with_paths=False, history=h)[0].state
            if status == "current" and h.state.head_tip is not None and h.state.head_tip.txid == c.txid:
                status += " (HEAD tip)"
    shared = _shared_bytes(path, manifest)
    info = {
        "path": path,
        "txid": manifest.txid,
        "lineage": manifest.lineage,
        "step": manifest.step,
        "parent": parent_to_json(manifest.parent),
        "created": manifest.created,
        "world_size": manifest.world_size,
        "adopted": manifest.adopted,
        "checksum_algorithm": checksum.ALGORITHM,
        "digest": manifest.digest,
        "bytes": manifest.total_bytes,
        "shared_bytes": shared,
        "metadata": manifest.metadata,
        "state": status,
        "files": {n: manifest.files[n].to_json() for n in sorted(manifest.files)},
    }
    if args.json:
        print_json(info)
        return EXIT_OK
    parent = manifest.parent
    if isinstance(parent, Ref):
        parent_s = f"step {parent.step} of lineage {parent.lineage} (txid {parent.txid})"
    elif isinstance(parent, ExternalParent):
        parent_s = f"external {parent.path}"
    else:
        parent_s = "none (first checkpoint of a root lineage)"
    print(f"checkpoint  {path}")
    print(f"step        {manifest.step}")
    print(f"lineage     {manifest.lineage}")
    print(f"txid        {manifest.txid}")
    if status:
        print(f"state       {status}")
    print(f"parent      {parent_s}")
    print(f"created     {human_time(manifest.created)}")
    print(f"world size  {manifest.world_size}")
    if manifest.adopted:
        print("adopted     yes (checksums computed at adoption)")
    print(f"checksums   {checksum.ALGORITHM}, manifest digest {manifest.digest}")
    print(
        f"files       {len(manifest.files)}, {human_bytes(manifest.total_bytes)}"
        + (
            f" ({human_bytes(shared)} of it shared with other checkpoints: hard links, docs/incremental.md)"
            if shared
            else ""
        )
    )
    rows = [
        [n, human_bytes(e.size), str(e.size), e.kind, str(e.rank), e.checksum]
        for n, e in sorted(manifest.files.items())
    ]
    print(
        "\n"
        + "\n".join(
            "  " + line for line in table(rows, ["FILE", "SIZE", "BYTES", "KIND", "RANK", "XXH3-128"]).splitlines()
        )
    )
    if manifest.metadata:
        print("\nmetadata")
        for line in json.dumps(manifest.metadata, indent=2, sort_keys=True, default=str).splitlines():
            print("  " + line)
    return EXIT_OK
