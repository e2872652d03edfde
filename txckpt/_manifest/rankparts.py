"""A multi-rank save's manifest in parts (protocol §3a, format /2), both sides of it.

Each rank writes its file table into the staging directory as its part (:func:`write_part`)
and sends the committer a fixed-size :class:`~txckpt._manifest.parts.Record`. The committer
(:func:`parts_manifest`) builds the Merkle tree over the part digests and a manifest that
commits to its root. When every rank's structure digest (names and kinds) equals the one of
this session's previous multi-rank commit, no part is read and the staging is not listed: the
previous commit checked those names already (one rank per name, no file under a file), and
each rank made its own files durable before it reported. Otherwise (the first save, a changed
structure, or a rank that handed ``tx.directory`` out, where other code may have written files
no rank reported) the committer reads every part, checks it against its record, and checks the
staging as the single-table commit does (:func:`staged_files`).

Also here, shared by both commits: :func:`staged_files`, protocol §8 step 7 on the staging.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Callable, Mapping

import xxhash

from . import parts
from .claims import hash_staged
from ..errors import InvalidArgumentError, TransactionAbortedError, UnsafePathError
from .._base.layout import MANIFEST_NAME
from .manifest import (
    FileEntry,
    Manifest,
    PartsInfo,
    RangeTable,
    agree_files,
    check_file_name,
    check_name_tree,
    decode_part,
    encode_part,
)
from .._base.saveplan import SavePlan
from .._storage.base import Storage

Relink = Callable[..., Any] | None


# ----- a rank's side ---------------------------------------------------------------------------
def write_part(
    storage: Storage,
    staging_key: str,
    rank: int,
    txid: str,
    files_json: Mapping[str, Any],
    *,
    durable: bool,
    directory: bool,
    open_write: Callable[..., BinaryIO] | None = None,
    ranges: Mapping[str, RangeTable] | None = None,
) -> parts.Record:
    """Write rank ``rank``'s part into the staging (durable when ``durable``, fsyncing the
    sub-directories its files are in: the committer may not list them) and return its record.
    ``directory``: ``tx.directory`` was handed out on this rank (the committer must list).
    ``open_write``: the rank's write batch's (default: the storage's), so that the part's
    fsync (or upload) is made with its files', complete when the batch's ``wait`` returns.
    ``ranges``: the range digests of this rank's files (DCP), recorded in its part, so that
    the committer never receives them and a loading rank reads only its own."""
    data = encode_part(rank, txid, files_json, ranges)
    # A durable write (its bytes fsynced by its close, or with the batch's): the committer's
    # creation of the tree in the same directory fsyncs that directory once, for every rank's entry.
    with (open_write or storage.open_write)(f"{staging_key}/{parts.part_name(rank)}", durable=durable) as f:
        f.write(data)
    if durable:
        for sub in sorted({n.rsplit("/", 1)[0] for n in files_json if "/" in n}, key=len, reverse=True):
            storage.sync_dir(f"{staging_key}/{sub}")
    return parts.Record(
        part=parts.node_digest(data),
        structure=parts.structure_digest((n, str(e.get("kind", "bytes"))) for n, e in files_json.items()),
        files=len(files_json),
        total_bytes=sum(int(e["size"]) for e in files_json.values()),
        flags=parts.DIRECTORY if directory else 0,
    )


# ----- the committer's side --------------------------------------------------------------------
def structures_of(records: list[parts.Record]) -> bytes:
    """One digest of every rank's structure digest, in rank order (and so of the world size)."""
    h = xxhash.xxh3_128(len(records).to_bytes(8, "little"))
    for r in records:
        h.update(r.structure)
    return h.digest()


def parts_manifest(
    storage: Storage,
    plan: SavePlan,
    records: list[parts.Record],
    own: Mapping[str, FileEntry],
    *,
    previous: bytes | None,
    durable: bool,
    relink: Relink,
    created: float,
    metadata: dict[str, Any],
) -> tuple[Manifest, bytes]:
    """Steps 6-8 of a multi-rank commit (protocol §3a): the manifest (written create-if-absent,
    durable, after the tree) and the structure digest to remember for the next save's fast
    path. ``own``: files the committer wrote itself after its part (DCP's ``.metadata``);
    ``previous``: the structure digest of this session's previous multi-rank commit."""
    key, count = plan.key, len(records)
    structures = structures_of(records)
    own_files = dict(own)
    fast = previous == structures and not any(r.flags & parts.DIRECTORY for r in records)
    if not fast:
        own_files = _checked_parts(storage, key, plan.txid, records, own_files, durable, relink)
    tree = parts.build_tree([r.part for r in records])
    # The tree is an index, derived from the parts and checked on every use (a reader whose
    # proof fails reads every part instead), so its bytes need no fsync of their own; the
    # parts' directory entries do, once (the staging's own when the manifest lands).
    with storage.open_write(f"{key}/{parts.TREE_NAME}", durable=False) as f:
        f.write(tree)
    if durable:
        storage.sync_dir(f"{key}/{parts.PARTS_DIR}")
    info = PartsInfo(
        count, parts.tree_root(tree).hex(), sum(r.files for r in records), sum(r.total_bytes for r in records)
    )
    manifest = Manifest(
        txid=plan.txid,
        lineage=plan.lineage,
        step=plan.step,
        parent=plan.parent,
        files=dict(own_files),
        created=created,
        world_size=count,
        metadata=metadata,
        parts=info,
        own_files=own_files,
    )
    if manifest.file_count == 0:
        raise InvalidArgumentError("the transaction wrote no files; nothing to commit")
    storage.create_exclusive(f"{key}/{MANIFEST_NAME}", manifest.encode(), durable=durable)
    return manifest, structures


def _checked_parts(
    storage: Storage,
    key: str,
    txid: str,
    records: list[parts.Record],
    own: dict[str, FileEntry],
    durable: bool,
    relink: Relink,
) -> dict[str, FileEntry]:
    """Read every part and check it against its rank's record, then the staging as the
    single-table commit checks it; returns ``own`` plus the files found in the staging that no
    rank reported (hashed now, recorded as the committer's)."""
    blobs = storage.run_concurrently(
        [(lambda r=r: storage.read_bytes(f"{key}/{parts.part_name(r)}")) for r in range(len(records))]  # type: ignore[misc]
    )
    reports: list[dict[str, Any]] = []
    for rank, (blob, record) in enumerate(zip(blobs, records)):
        if isinstance(blob, BaseException) or parts.node_digest(blob) != record.part:
            raise TransactionAbortedError(
                f"rank {rank}'s part of the manifest in the staging is missing or is not the one it reported "
                f"({blob if isinstance(blob, BaseException) else 'digest differs'}): deleted or rewritten "
                "by hand, or by a gc that took this writer for dead; nothing was committed"
            )
        files = decode_part(blob, rank, txid, f"{key}/{parts.part_name(rank)}").files
        reports.append({"rank": rank, "files": {n: e.to_json() for n, e in files.items()}})
    if own:
        reports.append({"rank": 0, "files": {n: e.to_json() for n, e in own.items()}})
    everything = staged_files(storage, key, agree_files(reports), durable, relink)
    in_parts = {n for r in reports[: len(records)] for n in r["files"]}
    return {n: e for n, e in everything.items() if n not in in_parts}


_PARTS_PREFIX = parts.PARTS_DIR + "/"


def staged_files(
    storage: Storage, key: str, files: dict[str, FileEntry], durable: bool, relink: Relink
) -> dict[str, FileEntry]:
    """Step 7 on the staging directory: ``files`` (every rank's reports) and the files code
    wrote straight into it (a shared local root) that no rank reported, hashed now (durable
    in the same pass) as rank 0's; raises if a reported file vanished or changed size. The
    manifest's parts (``txckpt-parts/``) are txckpt's own, not files of the checkpoint."""
    subdirs = set()
    unreported = []
    present: dict[str, int] = {}
    for name, size in storage.walk_files(key):
        if name.startswith(_PARTS_PREFIX):  # parts.is_part_file, inline: once per staged file
            continue
        present[name] = size
        if "/" in name:
            subdirs.add(name.rsplit("/", 1)[0])
        if name in files:
            continue
        if name == MANIFEST_NAME:
            raise InvalidArgumentError(f"{MANIFEST_NAME} is reserved for txckpt")
        check_file_name(name)
        if storage.is_symlink_escape(f"{key}/{name}"):
            raise UnsafePathError(f"{name!r} in the checkpoint is a symlink that leaves the root")
        unreported.append(name)
    if unreported:
        files.update(hash_staged(storage, key, unreported, durable, 0, relink))  # recorded as rank 0's
    if not files:
        raise InvalidArgumentError("the transaction wrote no files; nothing to commit")
    check_name_tree(files)  # ranks (or an object store) may hold both 'a' and 'a/b'
    gone = sorted(n for n, e in files.items() if present.get(n) != e.size)
    if gone:
        raise TransactionAbortedError(
            f"files of the staging directory vanished or changed size before the commit: {gone[:5]} "
            "(deleted by hand, or by a gc that took this writer for dead?); nothing was committed"
        )
    if durable:
        # Sub-directories now; the staging directory itself is fsynced when the manifest is
        # linked into it (create_exclusive), which persists every entry it holds.
        for sub in sorted(subdirs, key=len, reverse=True):
            storage.sync_dir(f"{key}/{sub}")
            parent = sub.rsplit("/", 1)[0] if "/" in sub else ""
            if parent:
                storage.sync_dir(f"{key}/{parent}")
    return files


__all__ = ["write_part", "structures_of", "parts_manifest", "staged_files"]
