"""What to write, separate from where bytes land: objects to streams and back.

Every writer here streams into a file-like object (txckpt's hashing writer), so a save never
holds a second serialised copy of the state in memory and the checksum is computed on the way.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import pickle
import re
import struct
import sys
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Mapping, cast

from .._base import deps
from ..errors import IntegrityError, InvalidArgumentError, WeightsOnlyError

_SAFETENSORS_DTYPES: dict[Any, str] = {}


def _dtype_names() -> dict[Any, str]:
    if not _SAFETENSORS_DTYPES:
        torch = deps.torch
        table = {
            "float64": "F64",
            "float32": "F32",
            "float16": "F16",
            "bfloat16": "BF16",
            "int64": "I64",
            "int32": "I32",
            "int16": "I16",
            "int8": "I8",
            "uint8": "U8",
            "bool": "BOOL",
            "float8_e4m3fn": "F8_E4M3",
            "float8_e5m2": "F8_E5M2",
            "uint16": "U16",
            "uint32": "U32",
            "uint64": "U64",
            "complex64": "C64",
        }
        for attr, name in table.items():
            dt = getattr(torch, attr, None)
            if dt is not None:
                _SAFETENSORS_DTYPES[dt] = name
    return _SAFETENSORS_DTYPES


def torch_dtype(code: str) -> Any:
    """The torch dtype of safetensors dtype string ``code`` (``"F32"``, ``"BF16"``, ...);
    KeyError where this torch has none."""
    if not _SAFETENSORS_BY_NAME:
        _SAFETENSORS_BY_NAME.update({v: k for k, v in _dtype_names().items()})
    return _SAFETENSORS_BY_NAME[code]


@dataclass(frozen=True)
class SafetensorsFile:
    """A dict of tensors to write as a ``.safetensors`` file with a header ``metadata``
    (``__metadata__``; ``save_pretrained`` writes ``{"format": "pt"}``): what ``tx.save`` takes
    where the file needs one, and how a grouped save (txckpt._save.grouped) asks for one file
    without being grouped again."""

    tensors: Mapping[str, Any]
    metadata: Mapping[str, str] | None = None


def dtype_code(t: Any) -> str | None:
    """The safetensors dtype string of tensor ``t`` (``"F32"``, ...); None where it has none."""
    return _dtype_names().get(t.dtype)


def dtype_label(dtype: Any) -> str:
    """How a tensor index names torch ``dtype``: its safetensors string (``"F32"``, ...), else
    torch's own name (``"complex128"``: lower case, so never one of safetensors' strings)."""
    return _dtype_names().get(dtype) or str(dtype).removeprefix("torch.")


def tensor_bytes(t: Any) -> memoryview:
    """The bytes ``write_safetensors`` writes for tensor ``t``: its data, contiguous, on the CPU
    (the bytes the tensor index digests for it in the file, protocol §3b)."""
    return _raw_bytes(t, deps.torch.uint8)


def _raw_bytes(t: Any, uint8: Any) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(uint8).numpy())


def safetensors_header(
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    name: str = "a .safetensors file",
) -> tuple[bytes, list[tuple[str, Any]]]:
    """The first bytes of ``tensors`` as a safetensors file (the header's length, 8 bytes little
    endian, then the header's JSON, padded with spaces to a multiple of 8) and the tensors in
    the order their bytes follow it: what :func:`write_safetensors` writes, computed from names,
    dtypes, shapes and ``metadata`` alone (no tensor's bytes are read; a grouped save compares
    it with a committed file's, txckpt._save.grouped). ``name``: the file, for error messages."""
    return _header(tensors, metadata, name, deps.torch)


def _header(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None, name: str, torch: Any
) -> tuple[bytes, list[tuple[str, Any]]]:
    names = _dtype_names()
    where = name if name == "a .safetensors file" else repr(name)
    advice = (
        "a .safetensors file holds only tensors: save other values in a file named .pt "
        "(torch.save: any picklable object) or .json (plain data)"
    )
    if not isinstance(tensors, Mapping):
        raise InvalidArgumentError(
            f"{where} takes a dict of name -> torch.Tensor, not a {type(tensors).__name__}; {advice}"
        )
    header: dict[str, Any] = {}
    offset = 0
    # safetensors orders tensors by descending dtype alignment, then name, so every tensor stays
    # aligned; follow the same rule.
    items = sorted(tensors.items(), key=lambda kv: (-_itemsize(kv[1]), kv[0]))
    for key, t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"{where}: its entry {key!r} is a {type(t).__name__}, not a torch.Tensor; {advice}"
            )
        if t.dtype not in names:
            raise InvalidArgumentError(
                f"{where}: safetensors cannot store dtype {t.dtype} (entry {key!r}); convert it, or save it in "
                "a .pt file"
            )
        nbytes = t.numel() * t.element_size()  # len(tensor_bytes(t)), without making them
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, items


def write_safetensors(
    tensors: Mapping[str, Any],
    out: BinaryIO,
    metadata: Mapping[str, str] | None = None,
    *,
    name: str = "a .safetensors file",
) -> None:
    """Stream ``tensors`` in the safetensors format (byte-compatible with ``safetensors.torch``
    readers) without building the file in memory. ``name``: the file, for error messages."""
    torch = deps.torch  # looked up once for the file
    head, items = _header(tensors, metadata, name, torch)
    out.write(head)  # the length and the header: one write
    for _, t in items:
        data = _raw_bytes(t, torch.uint8)  # tensor_bytes(t), the bytes its digest is of
        if len(data):
            out.write(data)


def _itemsize(t: Any) -> int:
    return int(getattr(t, "element_size", lambda: 1)()) if hasattr(t, "element_size") else 1


def write_object(name: str, obj: Any, out: BinaryIO) -> str:
    """Write ``obj`` into ``out`` by the rules of save_checkpoint; returns the file's kind.

    ``bytes``-like -> raw; ``.safetensors`` -> dict of tensors; ``.json`` -> JSON value;
    anything else -> ``torch.save``.
    """
    if isinstance(obj, (bytes, bytearray, memoryview)):
        out.write(obj)
        return "bytes"
    lower = name.lower()
    if lower.endswith(".safetensors"):
        if isinstance(obj, SafetensorsFile):
            write_safetensors(obj.tensors, out, obj.metadata, name=name)
        else:
            write_safetensors(obj, out, name=name)
        return "safetensors"
    if lower.endswith(".json"):
        try:
            data = json.dumps(obj, indent=2, sort_keys=True).encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"{name!r}: value is not JSON-serialisable ({e})") from None
        out.write(data)
        return "json"
    with torch_save_config():
        deps.torch.save(obj, out)
    return "torch"


def torch_save_config():
    """torch.save computes a zip CRC32 of every record: a second pass over every byte at about
    1.3 GB/s, redundant with the xxh3-128 checksum txckpt computes on the way (torch.load never
    checks the CRCs). Off unless TXCKPT_TORCH_ZIP_CRC=1."""
    if os.environ.get("TXCKPT_TORCH_ZIP_CRC", "0") == "1":
        return contextlib.nullcontext()
    try:
        config = deps.torch_serialization_config
    except ImportError:  # torch before 2.5: no switch, keep the default
        return contextlib.nullcontext()
    try:
        # torch installs patch() on its config modules at import time (install_config_module),
        # which the module's stub cannot show.
        return config.patch({"save.compute_crc32": False})  # type: ignore[attr-defined]
    except (AttributeError, KeyError, TypeError):
        return contextlib.nullcontext()


def read_object(
    name: str, kind: str, data: Any, *, map_location: Any = "cpu", weights_only: bool = True, where: str | None = None
) -> Any:
    """Turn verified bytes back into the object ``write_object`` wrote. ``data`` is ``bytes``
    or a ``torch.uint8`` tensor holding the file (what verification read it into): the tensors
    of a safetensors or torch file are then views of that buffer, each on its own storage slice
    (so saving one tensor saves only its bytes), and the buffer lives as long as any of them.
    ``where``: the file's full path, for error messages (default: ``name``)."""
    try:
        if kind == "bytes":
            return _as_bytes(data)
        if kind == "json":
            return json.loads(_as_bytes(data))
        if kind == "safetensors":
            tensors = _safetensors_views(data) if _is_tensor(data) else None
            if tensors is None:
                tensors = deps.safetensors_torch.load(_as_bytes(data))
            if map_location not in (None, "cpu"):
                tensors = {k: v.to(map_location) for k, v in tensors.items()}
            return tensors
        if kind == "torch":
            if _is_tensor(data):
                return _torch_load_buffer(data, map_location, weights_only)
            return deps.torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except Exception as e:  # the bytes matched their checksum, so this is a format problem
        if type(e).__name__ == "UnpicklingError":
            if weights_only:
                raise _weights_only_error(where or name, e) from e
            raise
        raise IntegrityError(f"{name!r} ({kind}) matched its checksum but could not be decoded: {e}") from e
    raise IntegrityError(f"{name!r} has unknown kind {kind!r}")


def _weights_only_error(where: str, e: Exception) -> WeightsOnlyError:
    """torch's refusal, saying which file and which global, and what to do."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    g = m.group(1) if m else None
    what = f"refused to unpickle the global {g}" if g else f"refused the file ({e})"
    allow = f"allow it with torch.serialization.add_safe_globals([{g}]) before loading, or " if g else ""
    return WeightsOnlyError(
        f"{where}: torch's weights_only loader (txckpt's default) {what}. The bytes are intact (they "
        f"matched their checksum). If you trust this checkpoint, {allow}load it with weights_only=False",
        path=where,
        global_name=g,
    )


def _is_tensor(data: Any) -> bool:
    return type(data).__module__.startswith("torch") and hasattr(data, "untyped_storage")


def _byte_view(data: Any) -> memoryview:
    if _is_tensor(data):
        return memoryview(data.numpy()) if data.numel() else memoryview(b"")
    return memoryview(data).cast("B")


def _as_bytes(data: Any) -> bytes:
    return data if isinstance(data, bytes) else bytes(_byte_view(data))


_SAFETENSORS_BY_NAME: dict[str, Any] = {}


def _safetensors_views(buf: Any) -> dict[str, Any] | None:
    """The tensors of the safetensors file held in uint8 tensor ``buf``, as views of it; None
    when the file is anything but plainly well-formed (then safetensors' own reader decodes it,
    and reports what is wrong)."""
    torch = deps.torch
    if sys.byteorder != "little":
        return None
    if not _SAFETENSORS_BY_NAME:
        _SAFETENSORS_BY_NAME.update({v: k for k, v in _dtype_names().items()})
    total = buf.numel()
    if total < 8:
        return None
    view = _byte_view(buf)
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > total - 8:
        return None
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + hlen
    storage = buf.untyped_storage()
    spans = []
    out: dict[str, Any] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_BY_NAME[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return None
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= total - base or end - begin != numel * itemsize:
            return None
        spans.append((begin, end))
        start = base + begin
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        elif start % itemsize:
            # Unaligned for its dtype (never in files txckpt writes): a copy of its own.
            t = buf[start : base + end].clone().view(dtype).reshape(shape)
        else:
            # torch's stub lists set_(source) and set_(source, offset, size, stride); the
            # three-argument form (contiguous strides) that torch accepts is missing from it.
            t = torch.empty(0, dtype=dtype).set_(storage[start : base + end], 0, shape)  # type: ignore[call-overload]
        out[name] = t
    # Like safetensors: the tensors tile the data section exactly, no gaps, no overlaps.
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            return None
        pos = end
    if pos != total - base:
        return None
    return out


def _torch_load_buffer(buf: Any, map_location: Any, weights_only: bool) -> Any:
    """``torch.load`` of the file held in uint8 tensor ``buf``, its tensors' storages slices of
    ``buf`` (what ``torch.load(path, mmap=True)`` does with a mapped file, here with the buffer
    that was verified): no copy, no second allocation. Falls back to ``torch.load`` reading
    from ``buf`` (one copy per record) for what that path does not cover (the pre-1.6 format,
    TorchScript archives, a torch without these internals, TXCKPT_ZERO_COPY_LOAD=0)."""
    torch = deps.torch
    internals = _zero_copy_internals()
    if internals is not None and os.environ.get("TXCKPT_ZERO_COPY_LOAD", "1") != "0":
        S = internals
        if S._is_zipfile(_BufferReader(buf)):
            reader = torch._C.PyTorchFileReader(cast(IO[bytes], _BufferReader(buf)))
            if not S._is_torchscript_zip(reader):
                if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
                    weights_only = True  # as torch.load does
                module = S._weights_only_unpickler if weights_only else pickle
                try:
                    return S._load(
                        reader, map_location, module, overall_storage=buf.untyped_storage(), encoding="utf-8"
                    )
                except pickle.UnpicklingError as e:
                    if not weights_only:
                        raise
                    raise pickle.UnpicklingError(
                        f"Weights only load failed: {e}. Load with weights_only=False only if you trust "
                        "the checkpoint's source."
                    ) from None
    return torch.load(cast(IO[bytes], _BufferReader(buf)), map_location=map_location, weights_only=weights_only)


_INTERNALS: list[Any] = []


def _zero_copy_internals() -> Any:
    """``torch.serialization`` if it has the pieces ``torch.load(..., mmap=True)`` is built
    from (torch >= 2.1), else None."""
    if not _INTERNALS:
        torch = deps.torch
        S = torch.serialization
        ok = all(hasattr(S, n) for n in ("_load", "_weights_only_unpickler", "_is_zipfile", "_is_torchscript_zip"))
        ok = ok and hasattr(torch._C, "PyTorchFileReader")
        try:
            ok = ok and "overall_storage" in inspect.signature(S._load).parameters
        except (TypeError, ValueError):
            ok = False
        _INTERNALS.append(S if ok else None)
    return _INTERNALS[0]


class _BufferReader(io.RawIOBase):
    """A seekable read-only stream over a uint8 tensor, without copying it (torch.load reads
    each record into its storage with ``readinto``: one copy, as from a file)."""

    def __init__(self, buf: Any):
        super().__init__()
        self._buf = buf
        self._view = _byte_view(buf)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        end = min(len(self._view), self._pos + len(b))
        n = max(0, end - self._pos)
        if n:
            memoryview(b).cast("B")[:n] = self._view[self._pos : end]
            self._pos = end
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._view) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos
