"""DCP's tensor items in the manifest's tensor index (protocol §3b): what lets ``inspect``, ``diff``
and ``load_tensors`` see a checkpoint written through ``TransactionalWriter`` tensor by tensor.

DCP writes each tensor item as one ``torch.save`` stream at a byte range of a ``.distcp`` file
(its item writer calls ``tell()`` around it; :class:`RangeHashingWriter` digests each range as it
is written). Once a rank's files are written (or shared) its WriteResults say where each item
went (file, offset, length) and its SavePlan's items say what it is (DCP's FQN, the chunk of the
tensor, dtype): :func:`item_records` joins them with the range digests, nothing read or hashed
again. Each record carries ``encoding: "torch_save"``, so no reader takes the bytes for raw
tensor data. Byte items (``BytesIO``, pickled Python objects) are not tensors and get none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..._manifest.manifest import FileEntry, RangeTable
from ..._manifest.tensor_index import TORCH_SAVE_ENCODING, TensorRecord
from ..._save.serialization import dtype_label


def record_name(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], whole: tuple[int, ...]) -> str:
    """A DCP item's name in the index: its FQN for a whole tensor, else the FQN and the chunk
    it is, as a slice (``"layers.0.w[4:8,0:16]"``), unique among the tensor's chunks."""
    if all(o == 0 for o in offsets) and sizes == whole:
        return fqn
    return f"{fqn}[{','.join(f'{o}:{o + s}' for o, s in zip(offsets, sizes))}]"


def item_records(
    items: list[WriteItem], results: list[WriteResult], ranges: Mapping[str, RangeTable]
) -> dict[str, list[TensorRecord]]:
    """The tensor records of each file a rank wrote or shared, from its plan's ``items``, the
    ``results`` DCP returned for them and each file's ``ranges`` (offset -> [length, digest])."""
    by_index = {item.index: item for item in items}
    out: dict[str, list[TensorRecord]] = {}
    for result in results:
        item = by_index.get(result.index)
        info = result.storage_data
        path, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if item is None or item.type == WriteItemType.BYTE_IO or item.tensor_data is None or path is None:
            continue
        recorded = ranges.get(str(path), {}).get(str(offset))
        if recorded is None or int(recorded[0]) != length:
            continue  # no digest of exactly these bytes: not listed rather than listed unverifiable
        data = item.tensor_data
        offsets, sizes, whole = tuple(data.chunk.offsets), tuple(data.chunk.sizes), tuple(data.size)
        chunked = not (all(o == 0 for o in offsets) and sizes == whole)
        out.setdefault(str(path), []).append(
            TensorRecord(
                record_name(result.index.fqn, offsets, sizes, whole),
                dtype_label(data.properties.dtype),
                sizes,
                int(offset),  # type: ignore[arg-type]  # checked present above
                int(length),
                str(recorded[1]),
                TORCH_SAVE_ENCODING,
                result.index.fqn,
                offsets if chunked else None,
            )
        )
    return out


def with_item_records(files: dict[str, Any], records: Mapping[str, list[TensorRecord]]) -> None:
    """Put each file's ``records`` into its manifest entry's index (``files``: name -> entry
    JSON, as a rank reports them), in file order."""
    for name, recs in records.items():
        raw = files.get(name)
        if raw is None:
            continue
        entry = FileEntry.from_json(name, raw)
        if entry.index is None:
            continue
        tensors = tuple(sorted(recs, key=lambda r: (r.offset, r.length, r.name)))
        files[name] = dataclasses.replace(entry, index=dataclasses.replace(entry.index, tensors=tensors)).to_json()


__all__ = ["item_records", "record_name", "with_item_records"]
