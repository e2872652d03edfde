"""The manifest: the list of a checkpoint's files with sizes and checksums, and where the
checkpoint stands in its lineage. Schema: docs/protocol.md, "Manifest".

A manifest carries a digest of its own canonical body, so an edited manifest is detected even
without the root's log; the log entry that commits it records the same digest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from . import checksum
from .errors import InvalidArgumentError, ManifestError, UnsafePathError
from .layout import MANIFEST_NAME  # every name under a root is layout's; importable from here as before
from .refs import Parent, parent_from_json, parent_to_json
from .storage.base import check_relative_key

FORMAT = "txckpt-manifest/1"

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

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "xxh3_128": self.checksum, "kind": self.kind, "rank": self.rank}
        if self.prefixes:
            out["prefixes"] = list(self.prefixes)
        return out

    @classmethod
    def from_json(cls, name: str, d: Any) -> "FileEntry":
        try:
            size, digest = int(d["size"]), str(d["xxh3_128"])
            kind, rank = str(d.get("kind", "bytes")), int(d.get("rank", 0))
            prefixes = tuple(str(p) for p in d.get("prefixes", ()))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest entry for {name!r} is malformed ({e})") from None
        if size < 0 or kind not in KINDS:
            raise ManifestError(f"manifest entry for {name!r} has size {size} / kind {kind!r}")
        return cls(size, digest, kind, rank, prefixes)


def written_to_json(written: Mapping[str, tuple[int, str, str, tuple[str, ...]]], rank: int) -> dict[str, dict[str, Any]]:
    """The file table of a rank's report: each file it wrote or shared, ``name -> (size,
    checksum, kind, prefixes)``, as the wire form of its FileEntry, recorded with ``rank``."""
    return {name: FileEntry(size, digest, kind, rank, prefixes).to_json()
            for name, (size, digest, kind, prefixes) in written.items()}


def files_from_json(raw: Mapping[str, Any], *, rank: int) -> dict[str, FileEntry]:
    """The file table of one rank's report (:func:`written_to_json`), every file recorded with
    ``rank``, the rank that sent it, whatever the entries say."""
    return {name: FileEntry.from_json(name, {**entry, "rank": rank}) for name, entry in raw.items()}


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


def check_file_name(name: str) -> str:
    """A name a checkpoint may hold: relative, no '..', and not the manifest itself."""
    check_relative_key(name)
    if name == MANIFEST_NAME:
        raise UnsafePathError(f"{MANIFEST_NAME!r} is reserved for txckpt's manifest")
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


def name_conflict(file_name: str, nested: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"file names {file_name!r} and {nested!r} in one checkpoint: {nested!r} needs {file_name!r} to be a "
        "directory, but it is a file. Rename one of them; nothing was committed"
    )


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

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "txid": self.txid,
            "lineage": self.lineage,
            "step": self.step,
            "parent": parent_to_json(self.parent),
            "created": self.created,
            "world_size": self.world_size,
            "adopted": self.adopted,
            "checksum_algorithm": checksum.ALGORITHM,
            "files": {name: self.files[name].to_json() for name in sorted(self.files)},
            "metadata": self.metadata,
        }

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def encode(self) -> bytes:
        body = self.body()
        self.digest = _digest(body)
        body["digest"] = self.digest
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes, where: str = "manifest") -> "Manifest":
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is damaged", path=where) from None
        if not isinstance(body, dict):
            raise ManifestError(f"{where} is not a JSON object; the checkpoint is damaged", path=where)
        if body.get("format") != FORMAT:
            raise ManifestError(
                f"{where} has format {body.get('format')!r}, this txckpt reads {FORMAT!r}; "
                "upgrade txckpt or check that this is a txckpt checkpoint"
            )
        claimed = body.pop("digest", None)
        if claimed != _digest(body):
            raise ManifestError(
                f"{where} was edited after it was written (its digest does not match its content); "
                "do not trust this checkpoint: resume from another one (on a restart, "
                "txckpt.resume(root, on_damaged=\"fallback\") does), or re-save", path=where,
            )
        if body.get("checksum_algorithm") != checksum.ALGORITHM:
            raise ManifestError(f"{where} uses checksum {body.get('checksum_algorithm')!r}")
        files_raw = body.get("files")
        if not isinstance(files_raw, dict):
            raise ManifestError(f"{where} has no file table")
        files = {}
        for name, entry in files_raw.items():
            try:
                check_file_name(name)
            except UnsafePathError as e:
                raise UnsafePathError(f"{where} names an unsafe path: {e}") from None
            files[name] = FileEntry.from_json(name, entry)
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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where} is missing a field ({e})", path=where) from None


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return checksum.digest_bytes(canonical)
