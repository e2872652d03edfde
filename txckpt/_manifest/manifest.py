"""The manifest: the list of a checkpoint's files with sizes and checksums, and where the
checkpoint stands in its lineage. Schema: docs/protocol.md, "Manifest".

A manifest carries a digest of its own canonical body, so an edited manifest is detected even
without the root's log; the log entry that commits it records the same digest.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .._base import checksum
from . import parts
from ..errors import FileNameConflictError, InvalidArgumentError, ManifestError, UnsafePathError
from .._base.layout import MANIFEST_NAME  # every name under a root is layout's; importable from here as before
from .._base.refs import Parent, parent_from_json, parent_to_json
from .._storage.base import Storage, check_relative_key
from .tensor_index import FileIndex

FORMAT = "txckpt-manifest/1"
#: A multi-rank save's manifest (protocol §3a): the file table lives in per-rank parts, which
#: the manifest commits to through the Merkle root over their digests. A new format string, so
#: that a txckpt older than it refuses it ("upgrade txckpt") instead of reading no files.
FORMAT_V2 = "txckpt-manifest/2"
PART_FORMAT = "txckpt-part/1"

#: How load_checkpoint turns a file back into an object.
KINDS = ("safetensors", "torch", "json", "bytes")


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str
    kind: str = "bytes"
    rank: int = 0
    #: The running xxh3-128 at each of ``checksum.prefix_boundaries(size)``: recorded by an
    #: incremental save (protocol §3), so the next one tells a changed file within the bytes
    #: before the first boundary where it differs. Empty otherwise.
    prefixes: tuple[str, ...] = ()
    #: The file's chunk digests and, for a safetensors file, its tensor index (protocol §3b),
    #: recorded as the file was hashed; None for a file written before the index existed.
    index: FileIndex | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "xxh3_128": self.checksum, "kind": self.kind, "rank": self.rank}
        if self.prefixes:
            out["prefixes"] = list(self.prefixes)
        if self.index is not None:
            out["index"] = self.index.to_json()
        return out

    @classmethod
    def from_json(cls, name: str, d: Any) -> "FileEntry":
        try:
            size, digest = int(d["size"]), str(d["xxh3_128"])
            kind, rank = str(d.get("kind", "bytes")), int(d.get("rank", 0))
            prefixes = tuple(str(p) for p in d.get("prefixes", ()))
            raw_index = d.get("index")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"manifest entry for {name!r} is malformed ({e})") from None
        if size < 0 or kind not in KINDS:
            raise ManifestError(f"manifest entry for {name!r} has size {size} / kind {kind!r}")
        index = None if raw_index is None else FileIndex.from_json(name, raw_index, size)
        return cls(size, digest, kind, rank, prefixes, index)


def written_entries(
    written: Mapping[str, tuple[int, str, str, tuple[str, ...], FileIndex | None]], rank: int
) -> dict[str, FileEntry]:
    """The file table of a rank's report: each file it wrote or shared, ``name -> (size,
    checksum, kind, prefixes, index)``, as its FileEntry, recorded with ``rank``. A report stays
    in this form within the process; it takes its wire form (:meth:`FileEntry.to_json`) only
    where it leaves it (a rank's part, another library's gather)."""
    return {
        name: FileEntry(size, digest, kind, rank, prefixes, index)
        for name, (size, digest, kind, prefixes, index) in written.items()
    }


def as_entry(name: str, entry: "FileEntry | Mapping[str, Any]", rank: int | None = None) -> FileEntry:
    """A report's entry for ``name``, given as a FileEntry or in its wire form (JSON, as another
    library's gather brings it), recorded with ``rank`` where given."""
    if isinstance(entry, FileEntry):
        return entry if rank is None or entry.rank == rank else dataclasses.replace(entry, rank=rank)
    return FileEntry.from_json(name, entry if rank is None else {**entry, "rank": rank})


def files_from_json(raw: Mapping[str, Any], *, rank: int) -> dict[str, FileEntry]:
    """The file table of one rank's report (:func:`written_entries`, or its wire form), every
    file recorded with ``rank``, the rank that sent it, whatever the entries say."""
    return {name: as_entry(name, entry, rank) for name, entry in raw.items()}


def agree_files(reports: list[dict[str, Any]]) -> dict[str, FileEntry]:
    """Every rank's reported files, each recorded with its rank; a name two ranks reported
    (written or claimed) is refused (protocol §8 step 6)."""
    files: dict[str, FileEntry] = {}
    for r in reports:
        entries = files_from_json(r["files"], rank=r["rank"])
        for name in entries:
            if name in files:
                raise InvalidArgumentError(
                    f"file {name!r} was written by rank {files[name].rank} and rank {r['rank']}; "
                    "give each rank's files distinct names (e.g. with the rank in the name)"
                )
        files.update(entries)
    return files


def kind_for_name(name: str) -> str:
    """The kind a file gets from its name when it was not written through ``tx.save``."""
    lower = name.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith(".json"):
        return "json"
    if lower.endswith((".pt", ".pth", ".bin", ".ckpt", ".tar")):
        return "torch"
    return "bytes"


#: Steps are 0 <= step < MAX_STEP (a signed 64-bit int, what every trainer's counter fits in): the
#: step is part of the txid, of staging and intent file names and of ``checkpoint-N``, which must
#: stay within file name limits (and within Python's int-to-str digit limit).
MAX_STEP = 2**63


def check_step(step: Any, what: str = "step") -> int:
    """``step`` if it is an int with 0 <= step < 2**63, else InvalidArgumentError."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
        shown = step if not isinstance(step, int) or step.bit_length() <= 64 else f"an int of {step.bit_length()} bits"
        raise InvalidArgumentError(
            f"{what} must be an int with 0 <= {what} < 2**63, not {shown!r}; pass the training step "
            "(e.g. the Trainer's global_step)"
        )
    return step


_PARTS_PREFIX = parts.PARTS_DIR + "/"


def check_file_name(name: str) -> str:
    """A name a checkpoint may hold: relative, no '..', not the manifest itself nor its parts."""
    check_relative_key(name)
    if name == MANIFEST_NAME:
        raise UnsafePathError(f"{MANIFEST_NAME!r} is reserved for txckpt's manifest")
    if name == parts.PARTS_DIR or name.startswith(_PARTS_PREFIX):  # parts.is_part_file, inline: every name passes here
        raise UnsafePathError(f"{parts.PARTS_DIR!r} is reserved for txckpt's manifest parts: rename {name!r}")
    return name


#: The longest component (bytes of UTF-8) a new file name may have: NAME_MAX of the common local
#: file systems (ext4, xfs, btrfs, tmpfs), so that every checkpoint can be fetched or exported to
#: a local disk, whatever backend wrote it.
NAME_MAX = 255


def check_new_file_name(name: str) -> str:
    """:func:`check_file_name`, plus what a save must refuse up front: a component longer than
    NAME_MAX bytes (no local file system could hold it)."""
    check_file_name(name)
    for part in name.split("/"):
        n = len(part.encode("utf-8", "surrogateescape"))
        if n > NAME_MAX:
            raise InvalidArgumentError(
                f"file name {name[:60]!r}... has a component of {n} bytes; file systems allow at most "
                f"{NAME_MAX}: use a shorter name"
            )
    return name


def check_name_tree(names: Iterable[str]) -> None:
    """Refuse a set of file names in which one name is a directory of another (``a`` and
    ``a/b``): no file system can hold both, so such a checkpoint could never be read back."""
    names = set(names)
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in names:
                raise name_conflict(prefix, name)


def name_conflict(file_name: str, nested: str, *, ranks: bool = False) -> FileNameConflictError:
    """``ranks``: the two names came from two ranks (the second found the other's in the staging)."""
    return FileNameConflictError(
        f"file names {file_name!r} and {nested!r} in one checkpoint"
        f"{' (written by two ranks)' if ranks else ''}: {nested!r} needs {file_name!r} to be a "
        "directory, but it is a file. Rename one of them; nothing was committed",
        name=file_name,
        nested=nested,
    )


@dataclass(frozen=True)
class PartsInfo:
    """A /2 manifest's commitment to its parts (protocol §3a): ``count`` parts (one per rank),
    the Merkle root over their digests, and the file count and byte total they hold."""

    count: int
    merkle_root: str
    files: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "merkle_root": self.merkle_root, "files": self.files, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: Any, where: str) -> "PartsInfo":
        try:
            info = cls(int(d["count"]), str(d["merkle_root"]), int(d.get("files", 0)), int(d.get("bytes", 0)))
            bytes.fromhex(info.merkle_root)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(
                f"{where} has a malformed parts record ({e}); the checkpoint is damaged", path=where
            ) from None
        if info.count < 1 or len(info.merkle_root) != 2 * parts.NODE_SIZE:
            raise ManifestError(f"{where} has a malformed parts record ({d!r})", path=where)
        return info


@dataclass
class Manifest:
    """One checkpoint's manifest (``txckpt-manifest.json``, protocol §3), as
    :func:`txckpt.read_manifest` and :func:`txckpt.verify_checkpoint` return it: ``txid``,
    ``lineage``, ``step``, ``parent``, ``files`` (name -> size, checksum, rank), ``created``,
    ``world_size``, the caller's ``metadata``, ``adopted`` and the manifest's own ``digest``."""

    txid: str
    lineage: str
    step: int
    #: The checkpoint this one follows: the lineage tip when the save began (a Ref); an
    #: ExternalParent for a lineage started from outside the root; None for the first
    #: checkpoint of a root lineage. The file holds its JSON form (refs.parent_to_json).
    parent: Parent
    files: dict[str, FileEntry]
    created: float
    world_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    adopted: bool = False
    digest: str = ""
    #: Format /2 only (protocol §3a): the parts this manifest commits to, and the files the
    #: manifest itself lists (those the committer recorded: its own, and files found in the
    #: staging that no rank reported). ``files`` is their union once the parts are read
    #: (:func:`read_manifest_at`); until then, ``own_files`` only.
    parts: PartsInfo | None = None
    own_files: dict[str, FileEntry] | None = None

    def body(self) -> dict[str, Any]:
        table = self.files if self.parts is None else (self.own_files or {})
        body = {
            "format": FORMAT if self.parts is None else FORMAT_V2,
            "txid": self.txid,
            "lineage": self.lineage,
            "step": self.step,
            "parent": parent_to_json(self.parent),
            "created": self.created,
            "world_size": self.world_size,
            "adopted": self.adopted,
            "checksum_algorithm": checksum.ALGORITHM,
            "files": {name: table[name].to_json() for name in sorted(table)},
            "metadata": self.metadata,
        }
        if self.parts is not None:
            body["parts"] = self.parts.to_json()
        return body

    @property
    def total_bytes(self) -> int:
        if self.parts is not None:
            return self.parts.bytes + sum(f.size for f in (self.own_files or {}).values())
        return sum(f.size for f in self.files.values())

    @property
    def file_count(self) -> int:
        if self.parts is not None:
            return self.parts.files + len(self.own_files or {})
        return len(self.files)

    @property
    def totals(self) -> tuple[int, int]:
        """``(total_bytes, file_count)`` in one look (what a commit entry records)."""
        return self.total_bytes, self.file_count

    def meta_files(self) -> list[str]:
        """The names, inside the checkpoint, of the manifest's own metadata besides
        ``MANIFEST_NAME``: a /2 manifest's parts and tree (what a copy must carry too)."""
        if self.parts is None:
            return []
        return [parts.part_name(r) for r in range(self.parts.count)] + [parts.TREE_NAME]

    def encode(self) -> bytes:
        body = self.body()
        self.digest = _digest(body)
        body["digest"] = self.digest
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes, where: str = "manifest") -> "Manifest":
        """The manifest in ``data``, its own digest checked. A /2 manifest's ``files`` are the
        ones it lists itself: :func:`read_manifest_at` reads its parts too."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is damaged", path=where) from None
        if not isinstance(body, dict):
            raise ManifestError(f"{where} is not a JSON object; the checkpoint is damaged", path=where)
        if body.get("format") not in (FORMAT, FORMAT_V2):
            raise ManifestError(
                f"{where} has format {body.get('format')!r}, this txckpt reads {FORMAT!r} and {FORMAT_V2!r}; "
                "upgrade txckpt or check that this is a txckpt checkpoint"
            )
        claimed = body.pop("digest", None)
        if claimed != _digest(body):
            raise ManifestError(
                f"{where} was edited after it was written (its digest does not match its content); "
                "do not trust this checkpoint: resume from another one (on a restart, "
                'txckpt.resume(root, on_damaged="fallback") does), or re-save',
                path=where,
            )
        if body.get("checksum_algorithm") != checksum.ALGORITHM:
            raise ManifestError(f"{where} uses checksum {body.get('checksum_algorithm')!r}")
        files_raw = body.get("files")
        if not isinstance(files_raw, dict):
            raise ManifestError(f"{where} has no file table")
        files = _file_table(files_raw, where)
        info = PartsInfo.from_json(body.get("parts"), where) if body["format"] == FORMAT_V2 else None
        try:
            return cls(
                txid=str(body["txid"]),
                lineage=str(body["lineage"]),
                step=int(body["step"]),
                parent=parent_from_json(body.get("parent")),
                files=files,
                created=float(body["created"]),
                world_size=int(body.get("world_size", 1)),
                metadata=dict(body.get("metadata") or {}),
                adopted=bool(body.get("adopted", False)),
                digest=str(claimed),
                parts=info,
                own_files=dict(files) if info is not None else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where} is missing a field ({e})", path=where) from None


def _file_table(files_raw: Mapping[str, Any], where: str, rank: int | None = None) -> dict[str, FileEntry]:
    files = {}
    for name, entry in files_raw.items():
        try:
            check_file_name(name)
        except UnsafePathError as e:
            raise UnsafePathError(f"{where} names an unsafe path: {e}") from None
        files[name] = FileEntry.from_json(name, entry if rank is None else {**entry, "rank": rank})
    return files


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return checksum.digest_bytes(canonical)


# ----- format /2: the parts (protocol §3a) -------------------------------------------------------
#: One file's range digests, as a DCP save records them: ``{str(offset): [length, xxh3-128 hex]}``.
RangeTable = dict[str, list[Any]]


@dataclass(frozen=True)
class RankPart:
    """One rank's part of a /2 manifest, decoded and checked: its files (each recorded with the
    rank) and the range digests it records for them (``{name: RangeTable}``, DCP's per-item
    digests; empty when the part has none)."""

    files: dict[str, FileEntry]
    ranges: dict[str, RangeTable] = field(default_factory=dict)


def _ranges_problem(ranges: Any, names: Mapping[str, Any]) -> str | None:
    """What is wrong with a part's ``ranges`` (None: nothing): a table per file of the part's
    own, each ``{decimal offset: [length >= 0, digest]}``."""
    if not isinstance(ranges, dict):
        return f"are not an object ({type(ranges).__name__})"
    for name, table in ranges.items():
        if name not in names:
            return f"name {name!r}, which is not one of the part's files"
        if not isinstance(table, dict):
            return f"of {name!r} are not an object"
        for offset, entry in table.items():
            if not (
                isinstance(offset, str)
                and offset.isascii()
                and offset.isdigit()
                and isinstance(entry, (list, tuple))
                and len(entry) == 2
                and type(entry[0]) is int
                and entry[0] >= 0
                and isinstance(entry[1], str)
            ):
                return f"of {name!r} at offset {offset!r} are not [length, xxh3-128] ({entry!r})"
    return None


def encode_part(
    rank: int, txid: str, files_json: Mapping[str, Any], ranges: Mapping[str, RangeTable] | None = None
) -> bytes:
    """Rank ``rank``'s part of the manifest of ``txid``: its file table (the wire form of
    :meth:`FileEntry.to_json` of :func:`written_entries`, less each entry's ``rank``: the part's own ``rank`` is every one
    of its files', and what a loading rank reads should not grow with the rank's digits) and,
    given ``ranges`` (DCP), the range digests of its own files, so that a loading rank finds
    them in its own share. Its digest (``parts.node_digest`` of these bytes) is its leaf: the
    Merkle root commits to both."""
    files = {n: {k: v for k, v in e.items() if k != "rank"} for n, e in files_json.items()}
    body: dict[str, Any] = {"format": PART_FORMAT, "rank": rank, "txid": txid, "files": files}
    if ranges:
        problem = _ranges_problem(dict(ranges), files)
        if problem is not None:
            raise InvalidArgumentError(
                f"rank {rank}'s range digests {problem}: a part records ranges of its "
                "own files only; pass each rank's ranges to that rank's part"
            )
        body["ranges"] = {n: dict(t) for n, t in ranges.items()}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode_part(data: bytes, rank: int, txid: str, where: str) -> RankPart:
    """Rank ``rank``'s part: its file table (each file recorded with ``rank``) and its range
    digests, checked to be that rank's part of ``txid`` and to record ranges of its own files
    only (its bytes are checked against the tree by the caller)."""
    try:
        body = json.loads(data)
        files_raw, ranges = body["files"], body.get("ranges", {})
        ok = body.get("format") == PART_FORMAT and body.get("rank") == rank and body.get("txid") == txid
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, AttributeError) as e:
        raise ManifestError(
            f"{where} is not a txckpt manifest part ({e}); the checkpoint is damaged", path=where
        ) from None
    if not ok or not isinstance(files_raw, dict):
        raise ManifestError(f"{where} is not rank {rank}'s part of txid {txid}; the checkpoint is damaged", path=where)
    files = _file_table(files_raw, where, rank)
    problem = _ranges_problem(ranges, files)
    if problem is not None:
        raise ManifestError(
            f"{where}'s range digests {problem}; the checkpoint is damaged: resume from "
            "another one or restore it from a copy",
            path=where,
        )
    return RankPart(files, ranges)


def _part_mismatch(where: str, rank: int | None) -> ManifestError:
    if rank is None:  # the tree (an index) is damaged too: it cannot tell which part differs
        return ManifestError(
            f"the parts in {where}/{parts.PARTS_DIR} do not match the Merkle root its manifest committed (a part "
            "was edited, truncated or replaced after the commit); do not trust this checkpoint: resume from "
            'another one (txckpt.resume(root, on_damaged="fallback")) or restore it from a copy',
            path=where,
        )
    return ManifestError(
        f"{where}/{parts.part_name(rank)} (rank {rank}'s part of the file table) does not match the "
        "Merkle root its manifest committed: it was edited, truncated or replaced after the commit; "
        "do not trust this checkpoint: resume from another one (txckpt.resume(root, "
        'on_damaged="fallback")) or restore the checkpoint from a copy',
        path=f"{where}/{parts.part_name(rank)}",
    )


def _read_part(storage: Storage, key: str, rank: int, where: str) -> bytes:
    name = parts.part_name(rank)
    try:
        return storage.read_bytes(f"{key}/{name}" if key else name)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ManifestError(
            f"{where}/{name} (rank {rank}'s part of the file table) is missing; the "
            "checkpoint is damaged: resume from another one or restore it from a copy",
            path=f"{where}/{name}",
        ) from None


def read_manifest_at(storage: Storage, key: str, manifest: Manifest, where: str) -> Manifest:
    """``manifest`` (decoded from ``key``'s manifest) with its whole file table: a /1 manifest
    as it is; a /2 one with every part read and checked against its Merkle root (a part that
    does not fit raises ManifestError naming its rank). Every reader that needs the whole
    table (verify, gc, retention, incremental, fetch) comes here."""
    if manifest.parts is None:
        return manifest
    files = dict(manifest.own_files or {})
    for rank, blob in enumerate(_read_checked_parts(storage, key, manifest, where)):
        for name, entry in decode_part(blob, rank, manifest.txid, f"{where}/{parts.part_name(rank)}").files.items():
            if name in files:
                raise ManifestError(
                    f"{where} lists {name!r} twice (rank {files[name].rank} and rank {rank}); "
                    "the checkpoint is damaged",
                    path=where,
                )
            files[name] = entry
    if len(files) != manifest.file_count:
        raise ManifestError(
            f"{where}'s parts hold {len(files)} files, its manifest says {manifest.file_count}; "
            "the checkpoint is damaged",
            path=where,
        )
    return dataclasses.replace(manifest, files=files)


def _read_checked_parts(storage: Storage, key: str, manifest: Manifest, where: str) -> list[bytes]:
    """The bytes of every part of a /2 ``manifest``, in rank order, checked together against its
    Merkle root (a part that does not fit raises ManifestError naming its rank)."""
    info = manifest.parts
    assert info is not None
    blobs = storage.run_concurrently([(lambda r=r: _read_part(storage, key, r, where)) for r in range(info.count)])  # type: ignore[misc]
    for blob in blobs:
        if isinstance(blob, BaseException):
            raise blob
    leaves = [parts.node_digest(b) for b in blobs]
    if parts.tree_root(parts.build_tree(leaves)).hex() != info.merkle_root:
        raise _part_mismatch(where, _bad_leaf(storage, key, info, leaves))
    return blobs


def _bad_leaf(storage: Storage, key: str, info: PartsInfo, leaves: list[bytes]) -> int | None:
    """The rank whose part does not fit: where the leaves differ from the tree file, if that
    still fits the root; None if the tree file is damaged too."""
    try:
        tree = storage.read_bytes(f"{key}/{parts.TREE_NAME}" if key else parts.TREE_NAME)
    except OSError:
        return None
    if (
        len(tree) == parts.tree_size(info.count)
        and parts.build_tree([tree[i * parts.NODE_SIZE : (i + 1) * parts.NODE_SIZE] for i in range(info.count)]) == tree
        and parts.tree_root(tree).hex() == info.merkle_root
    ):
        for rank, leaf in enumerate(leaves):
            if tree[rank * parts.NODE_SIZE : (rank + 1) * parts.NODE_SIZE] != leaf:
                return rank
    return None


def read_rank_part(storage: Storage, key: str, manifest: Manifest, rank: int, where: str) -> RankPart:
    """A loading rank's narrow read (protocol §3a): rank ``rank``'s part (its files and range
    digests), checked against the manifest's Merkle root through its proof path (log2 W sibling
    nodes of the tree file, read by range). What it reads does not grow with the world size. A
    /1 manifest: the files it records with that rank, and no ranges."""
    info = manifest.parts
    if info is None:
        return RankPart({n: e for n, e in manifest.files.items() if e.rank == rank})
    if not 0 <= rank < info.count:
        raise InvalidArgumentError(f"rank {rank}: {where} has parts of ranks 0..{info.count - 1}")
    blob = _read_part(storage, key, rank, where)
    siblings: list[bytes] = []
    proof = parts.proof_nodes(info.count, rank)
    try:  # exactly the proof's nodes (a remote store: ranged reads, not the tree file's rest)
        siblings = storage.read_ranges(
            f"{key}/{parts.TREE_NAME}" if key else parts.TREE_NAME,
            [(offset, parts.NODE_SIZE) for offset, _level in proof],
        )
    except OSError:  # missing (or a remote range past its end): the whole read below decides
        pass
    fits = len(siblings) == len(proof) and all(len(s) == parts.NODE_SIZE for s in siblings)
    if not fits or parts.root_from_proof(parts.node_digest(blob), info.count, rank, siblings).hex() != info.merkle_root:
        # The part or the tree (an index, not fsynced at commit: protocol §3a) does not fit:
        # every part is read and checked against the root (which names the rank whose part is
        # damaged), and this rank's is decoded from the bytes that check passed.
        blob = _read_checked_parts(storage, key, manifest, where)[rank]
    return decode_part(blob, rank, manifest.txid, f"{where}/{parts.part_name(rank)}")


def read_rank_files(storage: Storage, key: str, manifest: Manifest, rank: int, where: str) -> dict[str, FileEntry]:
    """The files of :func:`read_rank_part`: rank ``rank``'s share of the file table, checked."""
    return read_rank_part(storage, key, manifest, rank, where).files
