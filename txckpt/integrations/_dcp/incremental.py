"""``TransactionalWriter(..., incremental=True)``: a DCP tensor item whose bytes equal an item of a
committed checkpoint is not written again; its file is shared (docs/incremental.md, "DCP").

Layout: a rank puts each tensor item of at least :data:`OWN_FILE_BYTES` in a file of its own,
``__<rank>_<n>.distcp`` (n = 1, 2, ... in the plan's item order), written with DCP's own item
writer as any shard, and everything smaller (and every non-tensor item) in ``__<rank>_0.distcp``.
A file of one item holds exactly ``torch.save`` of that tensor, so its bytes are a function of
the tensor alone: its dtype, shape, strides, storage bytes, and the torch release and
serialization settings that write it. :func:`tensor_key` hashes exactly those (xxh3-128 straight
from the tensor's memory: no serialization, no second pass), and the coordinator records the key
of every such file in ``txckpt-dcp-items.json``. The next incremental save computes each large
item's key and, where one of the root's newest committed checkpoints (``incremental.DEPTH``, any
lineage) holds a file of that key, shares that file (``Storage.share_file``: a clone or a read-only
hard link on a local disk, a server-side copy on an object store) instead of writing it, once
its bytes are known to match its manifest entry (``incremental.Sharing.lease`` checks them:
read once per process, then trusted by the file's identity): its DCP WriteResult
(offset 0, the file's length) and its txckpt range (the whole file, its manifest digest) are
known without a byte serialized.

A changed tensor costs what a full save costs. Each item's first :data:`PREFIX_BYTES` are hashed
too (its *prefix key*), and every save records the prefix keys of all its large items. A tensor
whose prefix key no committed save recorded is changed, known after hashing one MiB of it: it
is packed into the rank's file 0 with the small items, written as a full save writes it (one
file per rank, not one per tensor: a full fine-tune then costs what a full save costs; A/B on 2
ranks, 16 rounds: 1.011-1.023 against 1.167 with a file and a hash pass per tensor), and never
shared. Only a
tensor whose first MiB matches is hashed whole and, if its key is found, shared; otherwise it
gets a file of its own, which the next save can share (a tensor trained until now and frozen
from now on is written alone once, then shared). The first incremental save of a root (no
recorded keys at all) gives every large item a file of its own, keyed from the very pieces the
writer hashes for the file's own digest while they are in the CPU cache (:meth:`stream_key`).

Why keys of tensors rather than probing the serialized bytes as ``tx.save`` does: ``torch.save``
computes a CRC-32 of every record (about 3x the cost of xxh3 on this CPU), so a probe through the
serializer would cost more than half of a full save for an unchanged base; the key costs one
xxh3 pass over the tensor. The committed file is still what every load checks: its manifest
entry is the source's own size and xxh3-128, and TransactionalReader verifies every byte it reads
against it, as for any checkpoint.

Every checkpoint stays whole: each file is in its directory (a hard link or a copy), so a stock
``FileSystemReader`` reads a local incremental checkpoint as any other, and retention or gc of the
checkpoint that first held the bytes deletes none of them.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.utils.serialization.config as serialization_config
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..._base.checksum import digest_bytes, new_hasher
from ..._save.incremental import Sharing, Source, committed_files
from ..._manifest.manifest import FileEntry, kind_for_name
from ..._log.publication import Root
from .compat import DEFAULT_SUFFIX, _StorageInfo

#: Each incremental DCP save's keys: ``{"format": ITEMS_FORMAT, "files": {one-item file name:
#: [tensor key, prefix key]}, "packed": [prefix keys of the large items packed into a file 0]}``.
#: Saves before prefix keys wrote a flat ``{file name: tensor key}``: while one of those is a
#: candidate, every large item is hashed whole.
ITEMS_NAME = "txckpt-dcp-items.json"
ITEMS_FORMAT = "txckpt-dcp-items/2"
#: A prefix key hashes what decides a file's bytes and the first this many bytes of the tensor.
PREFIX_BYTES = 1 << 20
#: Tensor items of at least this many bytes get a file of their own (and can be shared); smaller
#: ones are packed into the rank's file 0, written every save (a frozen model's norms and
#: biases are a small part of it).
OWN_FILE_BYTES = 1 << 20

# Decoded ITEMS_NAME files by (root identity, txid, digest of the items file): committed files
# never change. Bounded as incremental's manifest cache.
_ITEMS: "OrderedDict[tuple[str, str, str], _Items]" = OrderedDict()
_ITEMS_KEPT = 32
_ITEMS_LOCK = threading.Lock()


def tensor_key(tensor: torch.Tensor) -> str | None:
    """The key of the bytes DCP's item writer makes of ``tensor``: xxh3-128 of what decides
    them (the tensor as DCP's loader hands it to ``torch.save``: detached, on the CPU, cloned
    when its storage is larger than itself; its dtype, shape, strides, storage offset, conj/neg
    bits; the torch release, byte order and ``torch.save`` settings) and of its storage's bytes.
    None for what it does not describe (a tensor subclass that stays one when detached, a sparse
    or quantized tensor): such an item is always written."""
    t = _keyable(tensor)
    return None if t is None else _digest(t, None)


def _keyable(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as DCP's loader hands it to ``torch.save``; None: not keyed (tensor_key)."""
    t = tensor.detach()  # first, as DCP's loader: an nn.Parameter is saved as the plain tensor
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return None
    t = t.cpu()
    if t.untyped_storage().size() != t.nbytes:  # as DCP's _SerialCpuLoader: saves a minimal copy
        t = t.clone()
    return t


def _header(t: torch.Tensor, storage_offset: int | None = None) -> Any:
    """A hasher holding what decides the bytes of ``t``'s file besides its storage's bytes
    (``storage_offset``: that of the minimal copy ``t`` stands for, when it is a view)."""
    save = serialization_config.save
    hasher = new_hasher()
    offset = t.storage_offset() if storage_offset is None else storage_offset
    hasher.update(
        repr(
            (
                "txckpt-dcp-item/1",
                torch.__version__,
                sys.byteorder,
                save.compute_crc32,
                save.storage_alignment,
                str(t.dtype),
                tuple(t.shape),
                t.stride(),
                offset,
                t.is_conj(),
                t.is_neg(),
            )
        ).encode()
    )
    return hasher


def prefix_key(tensor: torch.Tensor) -> str | None:
    """The prefix key of ``tensor``: :func:`tensor_key`'s description and the first
    :data:`PREFIX_BYTES` of its minimal copy's bytes, without making the copy where the tensor
    is a contiguous view of a larger storage (its bytes are the copy's, at offset 0 with the
    same strides: what FSDP's padded shards are). None where tensor_key is None."""
    t = tensor.detach()
    if (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
        and t.numel()
    ):
        t = t.cpu()
        hasher = _header(t, storage_offset=0)
        hasher.update(t.reshape(-1).view(torch.uint8)[:PREFIX_BYTES].numpy().data)
        return hasher.hexdigest()
    keyable = _keyable(tensor)
    return None if keyable is None else _digest(keyable, PREFIX_BYTES)


def _digest(t: torch.Tensor, limit: int | None) -> str:
    """The key of keyable ``t`` (``limit`` None), or its prefix key (the first ``limit`` bytes)."""
    hasher = _header(t)
    storage = t.untyped_storage()
    if storage.size():
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # the storage's bytes, not copied
        data = raw.numpy().data  # a uint8 array: its buffer is the bytes
        hasher.update(data if limit is None else data[:limit])
    return hasher.hexdigest()


@dataclass
class Committed:
    """The one-item files of the root's newest committed checkpoints, by tensor key, and the
    prefix keys their saves recorded."""

    by_key: dict[str, Source] = field(default_factory=dict)
    prefixes: set[str] = field(default_factory=set)
    #: some save recorded keys without prefix keys (an older save): no prefix rules a tensor out
    unprefixed: bool = False

    @property
    def known(self) -> bool:
        """Whether any committed save recorded keys (else this is the root's first incremental
        DCP save: every large item gets a file of its own, to be shared later)."""
        return bool(self.by_key or self.prefixes or self.unprefixed)

    def may_hold(self, prefix: str) -> bool:
        """Whether a tensor of this prefix key may equal a committed one (else: changed)."""
        return self.unprefixed or prefix in self.prefixes


def committed_items(root: Root) -> Committed:
    """The one-item files of known key in the newest committed checkpoints of ``root``
    (incremental.committed_files: any lineage, manifests verified), the newest first for a key,
    and every prefix key those saves recorded. A checkpoint's ITEMS_NAME counts only when its
    bytes match its manifest entry."""
    by_checkpoint: "OrderedDict[str, dict[str, Source]]" = OrderedDict()
    for s in committed_files(root):
        by_checkpoint.setdefault(s.ref.txid, {})[s.name] = s
    out = Committed()
    for files in by_checkpoint.values():
        listed = files.get(ITEMS_NAME)
        if listed is None:
            continue  # not saved incrementally through DCP: no file with a known key
        keyed, packed = _items(root, listed)
        out.prefixes.update(packed)
        for name, (key, prefix) in keyed.items():
            if name not in files:
                continue
            out.by_key.setdefault(key, files[name])
            if prefix is None:
                out.unprefixed = True
            else:
                out.prefixes.add(prefix)
    return out


_Items = tuple[dict[str, tuple[str, "str | None"]], list[str]]


def _items(root: Root, listed: Source) -> "_Items":
    """A committed ITEMS_NAME: ({one-item file: (key, prefix key or None)}, packed prefix keys);
    nothing when it cannot be read or does not match its manifest entry."""
    cache_key = (root.storage.identity(), listed.ref.txid, listed.entry.checksum)
    with _ITEMS_LOCK:
        if cache_key in _ITEMS:
            _ITEMS.move_to_end(cache_key)
            return _ITEMS[cache_key]
    home = root.publication.locate(listed.ref)
    if home is None:
        return {}, []
    try:
        data = root.storage.read_bytes(f"{home}/{ITEMS_NAME}")
    except OSError:
        return {}, []
    if len(data) != listed.entry.size or digest_bytes(data) != listed.entry.checksum:
        return {}, []  # damaged: its keys are not trusted
    try:
        items = decode_items(data)
    except (ValueError, AttributeError, TypeError):
        return {}, []
    with _ITEMS_LOCK:
        _ITEMS[cache_key] = items
        while len(_ITEMS) > _ITEMS_KEPT:
            _ITEMS.popitem(last=False)
    return items


def encode_items(keys: dict[str, list[str]], packed: list[str]) -> bytes:
    """ITEMS_NAME's bytes for a save's one-item files' keys and its packed items' prefix keys."""
    return json.dumps({"format": ITEMS_FORMAT, "files": keys, "packed": sorted(set(packed))}, sort_keys=True).encode()


def decode_items(data: bytes) -> "_Items":
    """ITEMS_NAME's content; a malformed one raises (ValueError, TypeError, AttributeError)."""
    obj = json.loads(data)
    if "format" not in obj:  # a save before prefix keys: {file name: tensor key}
        return {str(k): (_str(v), None) for k, v in obj.items()}, []
    if obj["format"] != ITEMS_FORMAT:
        raise ValueError(f"unknown {ITEMS_NAME} format {obj['format']!r}")
    files: dict[str, tuple[str, str | None]] = {
        str(k): (_str(v[0]), _str(v[1])) for k, v in obj["files"].items() if len(v) == 2
    }
    return files, [_str(p) for p in obj["packed"]]


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"not a key: {value!r}")
    return value


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * item.tensor_data.properties.dtype.itemsize


@dataclass
class _Keying:
    """A large item's keys as the keyer found them: ``key`` None in the root's first
    incremental save, where the item is written alone at once and keyed from the pieces the
    writer hashes (``hasher``, set by :meth:`IncrementalShards.stream_key`)."""

    prefix: str
    key: str | None
    tensor: torch.Tensor | None = None
    hasher: Any = None


class IncrementalShards:
    """One rank's files in an incremental DCP save: which to write (:meth:`writes`, for DCP's
    item writer, in the order they become known), which to share (decided here, placed by
    :meth:`place` once this rank's writes are done), every one-item file's keys (:attr:`keys`)
    and the packed items' prefix keys (:attr:`packed`), for the coordinator's ITEMS_NAME.
    :meth:`release` stops the keying and returns the leases on the sources, whatever happened.

    The keys are computed on a thread of their own (xxh3 releases the GIL): first every large
    item's prefix key, which sorts the changed items (packed into file 0, written at once) from
    those that may be unchanged; then, smallest first, the whole key of each of those, while
    this rank writes file 0 and then each item whose key no committed file has."""

    def __init__(self, root: Root, prefix: str, items: list[WriteItem], planner: SavePlanner, rank: int):
        self._root = root
        self._rank = rank
        self._planner = planner
        self._sharing = Sharing(root)
        small = [i for i in items if _item_bytes(i) < OWN_FILE_BYTES]
        self._packed = (f"{prefix}0{DEFAULT_SUFFIX}", small)
        #: large items in the plan's item order: (name of their file when alone, item); the name
        #: does not depend on the order in which keys are computed
        self._large = [
            (f"{prefix}{n}{DEFAULT_SUFFIX}", item)
            for n, item in enumerate((i for i in items if _item_bytes(i) >= OWN_FILE_BYTES), 1)
        ]
        #: the names of one-item files: their range is the whole file
        self.single: set[str] = {name for name, _ in self._large}
        #: one-item file name -> [tensor key, prefix key]
        self.keys: dict[str, list[str]] = {}
        #: prefix keys of the large items packed into file 0
        self.packed: list[str] = []
        self.results: list[WriteResult] = []
        self._keyed: "queue.Queue[Any]" = queue.Queue()
        self._writing: dict[str, _Keying] = {}  # written before their key is known
        self._candidates = Committed()
        self._ready = threading.Event()  # the candidates are read (by the writing thread)
        self._stop = threading.Event()
        self._keyer: threading.Thread | None = None
        if self._large:
            self._keyer = threading.Thread(target=self._key_all, name="txckpt-dcp-keys", daemon=True)
            self._keyer.start()

    def _key_all(self) -> None:
        try:
            prefixes: dict[str, str | None] = {}
            for name, item in self._large:
                if self._stop.is_set():
                    return
                data = self._planner.resolve_data(item)
                prefixes[name] = prefix_key(data) if isinstance(data, torch.Tensor) else None
            self._ready.wait()
            if self._stop.is_set():
                return
            known = self._candidates.known
            changed = [
                (item, p)
                for name, item in self._large
                if known and (p := prefixes[name]) is not None and not self._candidates.may_hold(p)
            ]
            self._keyed.put(changed)  # first: what file 0 holds beside the small items
            packed = {id(item) for item, _ in changed}
            for name, item in sorted(self._large, key=lambda ni: _item_bytes(ni[1])):
                if self._stop.is_set():
                    return
                if id(item) in packed:
                    continue
                prefix = prefixes[name]
                t = None if prefix is None else self._keyable(item)
                if t is None or prefix is None:  # not a plain tensor: always written, no key
                    self._keyed.put((name, item, None))
                elif known:
                    self._keyed.put((name, item, _Keying(prefix, _digest(t, None))))
                else:  # the root's first incremental save: keyed as it is written
                    self._keyed.put((name, item, _Keying(prefix, None, t)))
        except BaseException as e:  # handed to the writing thread, which raises it
            self._keyed.put(e)

    def _keyable(self, item: WriteItem) -> torch.Tensor | None:
        data = self._planner.resolve_data(item)
        return _keyable(data) if isinstance(data, torch.Tensor) else None

    def _next(self) -> Any:
        got = self._keyed.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def writes(self) -> Iterator[tuple[str, list[WriteItem]]]:
        """(file name, its items) to write, in the order they are known: file 0 (the small
        items and the changed large ones, always written), then each one-item file whose key no
        committed file has."""
        changed: list[tuple[WriteItem, str]] = []
        if self._large:
            self._candidates = committed_items(self._root)
            self._ready.set()
            changed = self._next()
            self.packed = [p for _, p in changed]
        name0, small = self._packed
        yield name0, small + [item for item, _ in changed]
        for _ in range(len(self._large) - len(changed)):
            name, item, keying = self._next()
            if keying is None:  # not a plain tensor: always written, no key
                yield name, [item]
                continue
            if keying.key is None:  # the root's first incremental save: keyed while it is written
                self._writing[name] = keying
                yield name, [item]
                continue
            self.keys[name] = [keying.key, keying.prefix]
            source = self._candidates.by_key.get(keying.key)
            if source is not None and self._sharing.lease(source):
                self._sharing.pending[name] = source
                size = source.entry.size
                self.results.append(
                    WriteResult(index=item.index, size_in_bytes=size, storage_data=_StorageInfo(name, 0, size))
                )
            else:
                yield name, [item]

    def stream_key(self, name: str) -> tuple[Any, int] | None:
        """For the stream that writes ``name``: (a hasher, the tensor's storage bytes) when the
        file's key is to be taken from its write (RangeHashingWriter's ``key``), else None."""
        keying = self._writing.get(name)
        if keying is None or keying.tensor is None:
            return None
        keying.hasher = _header(keying.tensor)
        return keying.hasher, keying.tensor.nbytes  # its own storage: _keyable made the minimal copy

    def written(self, name: str, key_writes: int) -> None:
        """``name`` is written; ``key_writes``: how many writes its stream put into the hasher.
        Exactly one is the whole storage (torch.save writes a record in one write); anything
        else, and the key is hashed from the tensor after all."""
        keying = self._writing.pop(name, None)
        if keying is None or keying.tensor is None:
            return
        key = (
            keying.hasher.hexdigest() if key_writes == 1 and keying.hasher is not None else _digest(keying.tensor, None)
        )
        self.keys[name] = [key, keying.prefix]

    def place(
        self, staging_key: str, durable: bool, written: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Make every shared file a file of the staging (after this rank's writes are done):
        their manifest entries and txckpt ranges (one range: the whole file). ``written``: the
        entries of the files this rank wrote, trusted by the next save without a read back
        (incremental.Sharing.place)."""
        self._sharing.place(staging_key, durable, written)
        files, ranges = {}, {}
        for name, source in self._sharing.pending.items():
            e = source.entry
            files[name] = FileEntry(e.size, e.checksum, kind_for_name(name), self._rank, index=e.index).to_json()
            ranges[name] = {"0": [e.size, e.checksum]}
        return files, ranges

    def release(self) -> None:
        """Stop the keying (after the item it is hashing) and return the leases."""
        self._stop.set()
        self._ready.set()
        if self._keyer is not None:
            self._keyer.join()
        self._writing.clear()
        self._sharing.release()


__all__ = [
    "ITEMS_NAME",
    "ITEMS_FORMAT",
    "OWN_FILE_BYTES",
    "PREFIX_BYTES",
    "Committed",
    "IncrementalShards",
    "committed_items",
    "decode_items",
    "encode_items",
    "prefix_key",
    "tensor_key",
]
