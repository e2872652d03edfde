"""Grouped safetensors: an incremental save of a dict of tensors puts the tensors unchanged since
the last commit into files of their own, so those files are byte for byte committed ones and get
shared (txckpt._save.incremental) instead of written again (docs/incremental.md, "A frozen base
in one file"; protocol §3c).

The layout is the stock sharded one: ``<stem>-0000K-of-0000N.safetensors`` and
``<stem>.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), which
``transformers`` and ``safetensors`` readers read as they read a ``save_pretrained`` output. The
index also names the file the tensors were given as (``metadata.txckpt_grouped``), so
``load_checkpoint`` returns them under that one name, as a save that did not group them.

"Unchanged" is decided from digests: each tensor's xxh3-128 over its raw bytes
(:func:`txckpt._save.serialization.tensor_bytes`, the bytes ``write_safetensors`` writes, which
are the bytes the tensor index digests for that tensor in the file) compared with the tensor index
of the checkpoint the save follows, read from its manifest as checked against the log
(:func:`txckpt._save.incremental.committed_files`). Nothing is serialized to decide it, and a
file that is a committed file's tensor set is shared from those digests and a check of its
header (:func:`same_as_committed`), without the incremental probe's second pass over its bytes.
A tensor whose record has a head digest (its first 64 KiB, protocol §3b) that its first bytes no
longer match is changed without hashing the rest: a full fine-tune costs a 64 KiB hash per
tensor, not a pass over the model.
"""

from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Collection, Mapping

from .._base import deps
from .._base.checksum import digest_bytes, new_hasher, prefix_boundaries, usable_cores
from .._manifest.tensor_index import TensorRecord
from .serialization import SafetensorsFile, dtype_code, safetensors_header, tensor_bytes

#: The key of a grouped index's ``metadata`` that names the file its shards were saved as.
GROUPED_KEY = "txckpt_grouped"


def _is_shard_of(name: str, stem: str) -> bool:
    """Whether ``name`` is a stock shard name of ``stem`` (``<stem>-0000K-of-0000N.safetensors``)."""
    middle = name[len(stem) + 1 : -len(".safetensors")] if name.startswith(stem + "-") else ""
    k, of, n = middle[:5], middle[5:9], middle[9:]
    return name.endswith(".safetensors") and len(middle) == 14 and of == "-of-" and (k + n).isdigit()


def shard_name(name: str, k: int, n: int) -> str:
    """The stock name of shard ``k`` (from 1) of ``n`` of the file ``name`` (``x.safetensors``)."""
    return f"{name[: -len('.safetensors')]}-{k:05d}-of-{n:05d}.safetensors"


def index_name(name: str) -> str:
    """The stock name of the sharded index of the file ``name``."""
    return f"{name}.index.json"


def is_tensor_dict(obj: Any) -> bool:
    """Whether ``obj`` is a flat dict of two or more torch tensors (what grouping applies to: one
    tensor has one layout, the one file)."""
    if not isinstance(obj, Mapping) or len(obj) < 2:
        return False
    torch = deps.torch
    return all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is a stock shard name (``<stem>-0000K-of-0000N.safetensors``)."""
    stem = name[: -len("-00001-of-00002.safetensors")]
    return len(stem) > 0 and _is_shard_of(name, stem)


def _previous_files(sources: list[Any], parent_txid: str | None, name: str) -> list[tuple[Any, list[TensorRecord]]]:
    """The files ``name`` was saved as in the checkpoint the save follows (``parent_txid``;
    without one, the newest checkpoint offered): the one file ``name``, or its shards in shard
    order, each as (its manifest entry, its tensor records). Empty where there is none, or a
    file has no tensor index. (An entry: txckpt._manifest.manifest.FileEntry, a floor above.)"""
    if not sources:
        return []
    txid = parent_txid if any(s.ref.txid == parent_txid for s in sources) else sources[0].ref.txid
    files = {s.name: s.entry for s in sources if s.ref.txid == txid}
    if name in files:
        names = [name]
    else:
        stem = name[: -len(".safetensors")]
        names = sorted(n for n in files if _is_shard_of(n, stem))
    out = []
    for n in names:
        index = files[n].index
        if index is None or index.tensors is None:
            return []
        out.append((files[n], list(index.tensors)))
    return out


def _tie_sets(tensors: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """Each tensor's set of tensors sharing its storage (tied weights): one unit of layout, so
    tied tensors always land in one file."""
    by_storage: dict[tuple[str, int], set[str]] = {}
    for n, t in tensors.items():
        if t.numel():
            by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), set()).add(n)
    out = {n: frozenset([n]) for n in tensors}
    for members in by_storage.values():
        for n in members:
            out[n] = frozenset(members)
    return out


def _covering_digest(entry: Any, n: int) -> tuple[int, str]:
    """The shortest start of the committed file ``entry`` of at least ``n`` bytes that its
    entry has a digest of: (its length, the digest). A prefix digest (protocol §3, ``prefixes``:
    recorded where the file was streamed by an incremental save), the first chunk's (§3b), or
    the whole file's."""
    found = [(entry.size, entry.checksum)]
    boundaries = prefix_boundaries(entry.size)
    if len(entry.prefixes) == len(boundaries):
        found += [(b, d) for b, d in zip(boundaries, entry.prefixes) if b >= n][:1]
    index = entry.index
    if index is not None and index.chunks and index.chunk_size >= n:
        found.append((index.chunk_size, index.chunks[0]))
    return min(found)


def same_as_committed(file: SafetensorsFile, entry: Any) -> bool:
    """Whether ``file``, written, would be byte for byte the committed file ``entry`` records,
    given that each of its tensors has the dtype, shape and digest of the record of that name
    in ``entry``'s tensor index (:func:`plan_groups` found the group unchanged): decided
    without hashing the tensors' bytes a second time (protocol §3c, "Unchanged without a
    second pass").

    The file's bytes are its header (:func:`safetensors_header`: length, JSON, padding; it
    holds the names, dtypes, shapes, data offsets and ``metadata``) and then each tensor's
    bytes at the offset the header gives. So the committed file has exactly these bytes when
    (1) its tensor records are these tensors at these offsets and lengths, back to back from
    the end of this header, and its size is where the last one ends: every byte after the
    header lies in exactly one record's range, whose xxh3-128 equals this tensor's; and (2) a
    digest the entry records over the file's first ``b >= len(header)`` bytes (the first prefix
    digest that far, else the first chunk's, else the file's) equals the digest of this
    header followed by the tensor bytes up to ``b``: the header's bytes themselves, metadata
    and padding included. A size check alone would not do: a header of the same length with
    other metadata (``{"format": "pt"}`` against ``{"format": "tf"}``) has the same size and
    tensor ranges. Short of an xxh3-128 collision, both hold only for equal bytes. Cost: the
    header and at most the bytes up to the first boundary past it (1 MiB for a usual header)."""
    index = entry.index
    records = index.tensors if index is not None else None
    head, items = safetensors_header(file.tensors, file.metadata)
    if records is None or len(records) != len(items):
        return False
    end = len(head)
    for (key, t), r in zip(items, records):
        length = t.numel() * t.element_size()
        if (r.name, r.offset, r.length) != (key, end, length):
            return False
        end += length
    if end != entry.size:
        return False
    covered, digest = _covering_digest(entry, len(head))
    hasher = new_hasher()
    hasher.update(head)
    left = covered - len(head)
    for _, t in items:
        if left <= 0:
            break
        data = tensor_bytes(t)[:left]
        hasher.update(data)
        left -= len(data)
    return bool(hasher.hexdigest() == digest)


#: The bytes to hash from which a grouped save hashes its tensors on several threads (xxh3
#: releases the GIL): below it, starting threads costs more than it saves.
PARALLEL_FROM = 64 << 20


def _head_digest(t: Any, n: int) -> str:
    """The xxh3-128 of the first ``n`` bytes of :func:`tensor_bytes` of ``t``: a view of a
    contiguous CPU tensor, else a copy of the leading rows that hold them only."""
    if (t.device.type != "cpu" or not t.is_contiguous()) and t.dim() and t.shape[0]:
        row = t.numel() // t.shape[0] * t.element_size()
        if row:
            t = t[: -(-n // row)]
    return digest_bytes(tensor_bytes(t)[:n])


def _digests(tensors: Mapping[str, Any], names: list[str]) -> dict[str, str]:
    """The xxh3-128 of each named tensor's bytes (:func:`tensor_bytes`). Tensors whose bytes are
    a view (contiguous, on the CPU) are hashed one per task on up to as many threads as this
    process has cores, where there is enough to hash: the one pass over a frozen base, bounded
    by memory bandwidth rather than one core where cores are idle (one tensor is one sequential
    digest, so a base of one large tensor gains nothing). The others (a GPU tensor, a strided
    one) need a copy each: hashed one at a time meanwhile, so no more than one copy is held."""
    digest = lambda n: digest_bytes(tensor_bytes(tensors[n]))  # noqa: E731 - one expression, twice
    views = [n for n in names if tensors[n].device.type == "cpu" and tensors[n].is_contiguous()]
    viewed = set(views)
    workers = min(len(views), usable_cores(), 8)
    if workers < 2 or sum(tensors[n].nbytes for n in views) < PARALLEL_FROM:
        return {n: digest(n) for n in names}
    with ThreadPoolExecutor(workers, thread_name_prefix="txckpt-hash") as pool:
        hashing = pool.map(digest, views)
        copied = {n: digest(n) for n in names if n not in viewed}
        out = dict(zip(views, hashing))
    return {n: out[n] if n in out else copied[n] for n in names}


def plan_groups(
    tensors: Mapping[str, Any],
    previous: list[list[TensorRecord]],
    *,
    frozen: Collection[str] = (),
    assume_changed: Collection[str] = (),
) -> list[list[str]]:
    """The files to write ``tensors`` as, each a list of tensor names, in file order.

    First each previous file whose every tensor is here unchanged (digest, dtype and shape), with
    no tied partner outside it: the same tensor set, so the same bytes. Then one file of the
    other tensors unchanged since the previous save or named in ``frozen`` (a layout hint: the
    caller knows they will not change, e.g. ``requires_grad=False``), then one of the rest.
    ``assume_changed``: tensors not hashed at all (the caller knows they are trained): never
    unchanged. Tied tensors (one storage) move together."""
    return _plan(tensors, previous, frozen=frozen, assume_changed=assume_changed)[0]


def _plan(
    tensors: Mapping[str, Any],
    previous: list[list[TensorRecord]],
    *,
    frozen: Collection[str] = (),
    assume_changed: Collection[str] = (),
) -> tuple[list[list[str]], list[int]]:
    """:func:`plan_groups`, and for each of its first groups that is a previous file (every
    tensor unchanged: dtype, shape and digest), that file's place in ``previous``."""
    recorded = {r.name: r for recs in previous for r in recs}
    ties = _tie_sets(tensors)
    same: dict[str, bool] = {}
    comparable = [
        n
        for n, t in tensors.items()
        if (r := recorded.get(n)) is not None
        and n not in assume_changed
        and r.dtype == dtype_code(t)
        and r.shape == tuple(t.shape)
    ]
    # A head that differs tells a changed tensor (its first 64 KiB hashed, not the rest).
    comparable = [n for n in comparable if (h := recorded[n].head) is None or _head_digest(tensors[n], h[0]) == h[1]]
    digests = _digests(tensors, comparable)

    def unchanged(n: str) -> bool:
        if n not in same:
            same[n] = n in digests and recorded[n].checksum == digests[n]
        return same[n]

    groups: list[list[str]] = []
    kept: list[int] = []
    placed: set[str] = set()
    for k, recs in enumerate(previous):
        names = [r.name for r in recs]
        members = set(names)
        if (
            names
            and all(n in tensors for n in names)
            and all(ties[n] <= members for n in names)
            and all(unchanged(n) for n in names)
        ):
            groups.append(names)
            kept.append(k)
            placed |= members
    rest = [n for n in sorted(tensors) if n not in placed]
    settled = [n for n in rest if all(m in frozen or unchanged(m) for m in ties[n])]
    changed = [n for n in rest if n not in set(settled)]
    groups += [g for g in (settled, changed) if g]
    return groups, kept


def _save_file(tx: Any, name: str, file: SafetensorsFile, entry: Any) -> None:
    """Save ``file`` as ``name`` in ``tx``: where it is the committed file ``entry`` (its
    tensors unchanged by their digests, and :func:`same_as_committed`), shared as that file
    without a probe; else by ``tx.save`` (which probes it, and writes it unless shared).
    ``share_copy`` leases a committed file of that size and checksum once
    ``Sharing.trusted`` holds for it: a damaged one is refused (warned once), and the file is
    written instead."""
    if entry is None or not same_as_committed(file, entry) or not tx.share_copy(name, entry):
        tx.save(name, file)


def save_grouped(
    tx: Any,
    name: str,
    tensors: Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
    frozen: Collection[str] = (),
    assume_changed: Collection[str] = (),
) -> list[str]:
    """Save ``tensors`` (the file ``name``) in ``tx`` grouped by :func:`plan_groups`: one file
    ``name`` where the plan has one group (a first save, or nothing unchanged), else the stock
    sharded layout. Each file goes through ``tx.save``, so an unchanged group is shared. Returns
    the names written."""
    sharing = tx._sharing
    parent = tx._plan.parent if tx._plan is not None else None
    previous = _previous_files(sharing.sources(), getattr(parent, "txid", None), name) if sharing is not None else []
    groups, kept = _plan(tensors, [recs for _, recs in previous], frozen=frozen, assume_changed=assume_changed)
    # The first groups are previous files' tensor sets, every tensor unchanged by its digest:
    # each is that file unless its header differs (same_as_committed), so it is shared from
    # the digests, not probed (its bytes hashed) a second time.
    committed = [previous[k][0] for k in kept]
    if len(groups) <= 1:
        _save_file(tx, name, SafetensorsFile(tensors, metadata), committed[0] if committed else None)
        return [name]
    names = [shard_name(name, k, len(groups)) for k in range(1, len(groups) + 1)]
    weight_map: dict[str, str] = {}
    total = 0
    for i, (shard, group) in enumerate(zip(names, groups)):
        file = SafetensorsFile({n: tensors[n] for n in group}, metadata)
        _save_file(tx, shard, file, committed[i] if i < len(committed) else None)
        for n in group:
            weight_map[n] = posixpath.basename(shard)
            total += tensors[n].numel() * tensors[n].element_size()
    index = {
        "metadata": {"total_size": total, GROUPED_KEY: posixpath.basename(name)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    tx.save(index_name(name), index)
    return [*names, index_name(name)]


def merge_grouped(name: str, index: Any, loaded: Mapping[str, Any]) -> tuple[str, dict[str, Any], list[str]] | None:
    """If ``name`` is the index of a grouped save (``metadata.txckpt_grouped``) whose shards are
    all in ``loaded``: (the file it was saved as, its tensors merged, the shard names); else None."""
    if not isinstance(index, dict) or not name.endswith(".safetensors.index.json"):
        return None
    meta, weight_map = index.get("metadata"), index.get("weight_map")
    if not isinstance(meta, dict) or not isinstance(weight_map, dict) or GROUPED_KEY not in meta:
        return None
    folder = posixpath.dirname(name)
    shards = sorted({posixpath.join(folder, str(f)) for f in weight_map.values()})
    if not all(isinstance(loaded.get(s), dict) for s in shards):
        return None
    merged: dict[str, Any] = {}
    for s in shards:
        merged.update(loaded[s])
    return name[: -len(".index.json")], merged, shards


def grouped_request(files: Collection[str], names: list[str] | None) -> list[str] | None:
    """``names`` (the files a load asks for; None: all) with each name a grouped save wrote as
    shards (``x.safetensors``, absent, with ``x.safetensors.index.json`` present) replaced by
    that index and the shards of that stem."""
    if names is None:
        return None
    out: list[str] = []
    for n in names:
        if n in files or not n.endswith(".safetensors") or index_name(n) not in files:
            out.append(n)
            continue
        stem = n[: -len(".safetensors")]
        out += [index_name(n), *sorted(f for f in files if _is_shard_of(f, stem))]
    return list(dict.fromkeys(out))


def grouping_of(model: Any) -> dict[str, Any]:
    """:func:`save_grouped`'s layout keywords for a model's weights (the Trainer's and the
    Accelerator's saves, synchronous or not): its parameters with ``requires_grad=False`` form
    the frozen shard from the first save on; those it trains are assumed changed (never hashed).
    No hints for anything else (None, a plain dict of tensors)."""
    params = dict(model.named_parameters()) if hasattr(model, "named_parameters") else {}
    frozen = {n for n, p in params.items() if not p.requires_grad}
    return {"frozen": frozen, "assume_changed": set(params) - frozen}


__all__ = [
    "GROUPED_KEY",
    "grouping_of",
    "grouped_request",
    "index_name",
    "is_shard_name",
    "is_tensor_dict",
    "merge_grouped",
    "plan_groups",
    "same_as_committed",
    "save_grouped",
    "shard_name",
]
