"""What a committed checkpoint holds, tensor by tensor, from its manifest alone: inspect (its
tensors and files) and diff (two checkpoints' tensors compared by digest), reading no tensor data.

Both read the manifest (and a /2 manifest's parts) through the one read path (txckpt._read.reader:
the manifest's own digest checked, and the log's commit entry inside a root); neither opens a
data file. A checkpoint written before the tensor index (protocol §3b) lists its files only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._base.issued import options_for
from .._manifest.manifest import Manifest
from .._read.reader import read_checked
from .._manifest.tensor_index import TensorRecord


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its manifest's tensor index records it: ``name``, the
    ``file`` holding it, safetensors ``dtype`` (``"F32"``, ``"BF16"``, ...), ``shape``,
    ``nbytes``, its xxh3-128 ``digest``, and ``offset`` (of its bytes in the file).
    ``encoding``: None where the bytes are the tensor's raw data (safetensors); ``"torch_save"``
    for an item of a DCP checkpoint, whose ``nbytes`` bytes are a ``torch.save`` stream of it
    (protocol §3b)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: str
    offset: int = 0
    encoding: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "digest": self.digest,
            "offset": self.offset,
            "encoding": self.encoding,
        }


@dataclass(frozen=True)
class FileInfo:
    """One file of a checkpoint: ``name``, ``size``, ``kind`` (``"safetensors"``, ``"torch"``,
    ``"json"``, ``"bytes"``), its xxh3-128 ``digest``, ``chunks`` (how many chunk digests its
    entry records; 0 when it has no index) and ``tensors`` (how many tensors its index lists;
    None when it has no tensor index: a torch, JSON or bytes file, or a file written before the
    index)."""

    name: str
    size: int
    kind: str
    digest: str
    chunks: int = 0
    tensors: int | None = None
    indexed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "kind": self.kind,
            "digest": self.digest,
            "indexed": self.indexed,
            "chunks": self.chunks,
            "tensors": self.tensors,
        }


@dataclass(frozen=True)
class CheckpointContents:
    """What :func:`txckpt.inspect_checkpoint` returns: the checkpoint's ``path``, ``step``,
    ``lineage``, ``txid``, its ``tensors`` (every tensor of its safetensors files, by file then
    name) and ``files``; ``indexed``: whether every safetensors file has a tensor index (False
    for a checkpoint written before txckpt recorded one: its tensors are then unknown without
    reading the files)."""

    path: str
    step: int
    lineage: str
    txid: str
    tensors: list[TensorInfo] = field(default_factory=list)
    files: list[FileInfo] = field(default_factory=list)
    indexed: bool = True

    def tensor_keys(self) -> dict[str, TensorInfo]:
        """Each tensor by the key that names it in the checkpoint: its name, or
        ``"<file>:<name>"`` where two files hold a tensor of that name."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.name] = counts.get(t.name, 0) + 1
        return {(t.name if counts[t.name] == 1 else f"{t.file}:{t.name}"): t for t in self.tensors}

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "step": self.step,
            "lineage": self.lineage,
            "txid": self.txid,
            "indexed": self.indexed,
            "tensors": [t.to_json() for t in self.tensors],
            "files": [f.to_json() for f in self.files],
        }


def contents_of(path: str, manifest: Manifest) -> CheckpointContents:
    """The contents the manifest records (no file read)."""
    tensors: list[TensorInfo] = []
    files: list[FileInfo] = []
    indexed = True
    for name in sorted(manifest.files):
        entry = manifest.files[name]
        index = entry.index
        if index is None:
            if entry.kind == "safetensors":
                indexed = False
            files.append(FileInfo(name, entry.size, entry.kind, entry.checksum))
            continue
        records: tuple[TensorRecord, ...] = index.tensors or ()
        if entry.kind == "safetensors" and index.tensors is None:
            indexed = False  # a header the indexer could not read
        files.append(
            FileInfo(
                name,
                entry.size,
                entry.kind,
                entry.checksum,
                len(index.chunk_digests(entry.size, entry.checksum)),
                None if index.tensors is None else len(records),
                True,
            )
        )
        tensors.extend(
            TensorInfo(t.name, name, t.dtype, t.shape, t.length, t.checksum, t.offset, t.encoding)
            for t in sorted(records, key=lambda r: r.name)
        )
    return CheckpointContents(path, manifest.step, manifest.lineage, manifest.txid, tensors, files, indexed)


def inspect_checkpoint(
    path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None
) -> CheckpointContents:
    """The tensors (name, file, dtype, shape, nbytes, digest) and files of the committed
    checkpoint at ``path``, from its manifest alone: no tensor data is read. The manifest is
    checked as every read checks it (its digest; inside a root, the log's commit entry). A
    checkpoint written before the tensor index has ``indexed=False`` and lists its files."""
    text = os.fspath(path)
    return read_checked(text, options_for(text, storage_options), lambda found: contents_of(found.path, found.manifest))


#: A tensor's state in a diff.
SAME, CHANGED, ADDED, REMOVED = "same", "changed", "added", "removed"


@dataclass(frozen=True)
class TensorChange:
    """One tensor of :func:`txckpt.diff_checkpoints`: its ``key`` (its name, or
    ``"<file>:<name>"`` where two files of a checkpoint hold that name), its ``status``
    (``"same"``, ``"changed"``, ``"added"``, ``"removed"``), and its ``a`` and ``b``
    (:class:`TensorInfo`, None on the side that lacks it); ``dtype_changed``/``shape_changed``
    for a changed tensor whose dtype or shape differs."""

    key: str
    status: str
    a: TensorInfo | None
    b: TensorInfo | None

    @property
    def dtype_changed(self) -> bool:
        return self.a is not None and self.b is not None and self.a.dtype != self.b.dtype

    @property
    def shape_changed(self) -> bool:
        return self.a is not None and self.b is not None and self.a.shape != self.b.shape

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "status": self.status,
            "dtype_changed": self.dtype_changed,
            "shape_changed": self.shape_changed,
            "a": None if self.a is None else self.a.to_json(),
            "b": None if self.b is None else self.b.to_json(),
        }


@dataclass(frozen=True)
class CheckpointDiff:
    """What :func:`txckpt.diff_checkpoints` returns: the two checkpoints' contents ``a`` and
    ``b`` (:class:`CheckpointContents`) and one :class:`TensorChange` per tensor key of
    either (``changes``, sorted by key). ``comparable``: both have a tensor index (otherwise
    the tensors of an unindexed side are unknown and ``changes`` compares only what is known)."""

    a: CheckpointContents
    b: CheckpointContents
    changes: list[TensorChange]

    @property
    def comparable(self) -> bool:
        return self.a.indexed and self.b.indexed

    def counts(self) -> dict[str, int]:
        out = {SAME: 0, CHANGED: 0, ADDED: 0, REMOVED: 0}
        for c in self.changes:
            out[c.status] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "a": {k: v for k, v in self.a.to_json().items() if k not in ("tensors", "files")},
            "b": {k: v for k, v in self.b.to_json().items() if k not in ("tensors", "files")},
            "comparable": self.comparable,
            "counts": self.counts(),
            "tensors": [c.to_json() for c in self.changes],
        }


def diff_contents(a: CheckpointContents, b: CheckpointContents) -> CheckpointDiff:
    """Compare two checkpoints' tensors by key: same digest, dtype and shape: same."""
    ka, kb = a.tensor_keys(), b.tensor_keys()
    changes = []
    for key in sorted(set(ka) | set(kb)):
        ta, tb = ka.get(key), kb.get(key)
        if ta is None:
            status = ADDED
        elif tb is None:
            status = REMOVED
        elif (ta.digest, ta.dtype, ta.shape, ta.nbytes) == (tb.digest, tb.dtype, tb.shape, tb.nbytes):
            status = SAME
        else:
            status = CHANGED
        changes.append(TensorChange(key, status, ta, tb))
    return CheckpointDiff(a, b, changes)


def diff_checkpoints(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    storage_options_b: Mapping[str, Any] | None = None,
) -> CheckpointDiff:
    """Compare the tensors of two committed checkpoints (of one lineage, two lineages or two
    roots) from their manifests' digests alone, reading no tensor data: each tensor same,
    changed (with a dtype or shape change flagged), added (in ``b`` only) or removed (in ``a``
    only). ``storage_options_b``: for ``b`` (default: ``storage_options``)."""
    ca = inspect_checkpoint(a, storage_options=storage_options)
    cb = inspect_checkpoint(b, storage_options=storage_options if storage_options_b is None else storage_options_b)
    return diff_contents(ca, cb)
