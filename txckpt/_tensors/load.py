"""A verified load of named tensors that reads only their bytes: ``txckpt.load_tensors``.

Each tensor's byte range comes from the manifest's tensor index (protocol §3b); the bytes are
read by ranged reads through the storage seam (``Storage.read_ranges``: ``pread`` locally, one
ranged GET per range on S3, ``cat_file`` by range on fsspec stores), checked against the
tensor's own digest, and only then turned into tensors. A file without a tensor index (written
before txckpt recorded one) is read whole and verified against its file digest instead.
"""

from __future__ import annotations

import difflib
import io
import os
from typing import Any, Iterable, Mapping

from .._base import deps
from ..errors import (
    IntegrityError,
    InvalidArgumentError,
    TensorIntegrityError,
    TensorNotFoundError,
    UnsafePathError,
)
from .._base.issued import options_for
from .._read.reader import Found, load as load_files, read_checked
from .._manifest.tensor_index import TORCH_SAVE_ENCODING
from .._save.serialization import dtype_label, torch_dtype
from .._base.checksum import digest_bytes
from .inspect import TensorInfo, contents_of


def _resolve(found: Found, names: list[str]) -> tuple[dict[str, TensorInfo], list[str], list[str]]:
    """The requested tensors the index holds (key -> info), the unindexed safetensors files (whose
    tensors are unknown until read), and the names not found in the index."""
    contents = contents_of(found.path, found.manifest)
    keys = contents.tensor_keys()
    by_name: dict[str, list[str]] = {}
    qualified: dict[str, TensorInfo] = {}  # "<file>:<name>" names every tensor, unique or not
    for key, t in keys.items():
        by_name.setdefault(t.name, []).append(key)
        qualified[f"{t.file}:{t.name}"] = t
    unindexed = [
        f.name for f in contents.files if f.kind == "safetensors" and f.tensors is None
    ]  # no tensor index: read whole
    wanted: dict[str, TensorInfo] = {}
    missing = []
    for name in names:
        if name in keys or name in qualified:
            wanted[name] = keys[name] if name in keys else qualified[name]
        elif len(by_name.get(name, ())) > 1:
            raise InvalidArgumentError(
                f"{found.path} has a tensor {name!r} in {len(by_name[name])} files: name one as "
                f"{' or '.join(repr(k) for k in by_name[name][:4])}"
            )
        else:
            missing.append(name)
    if missing and not unindexed:
        raise _not_found(found.path, missing[0], list(keys))
    return wanted, unindexed, missing


def _not_found(path: str, name: str, known: list[str]) -> TensorNotFoundError:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"close names: {', '.join(repr(c) for c in close)}" if close else "no name is close to it"
    return TensorNotFoundError(
        f"{path} has no tensor {name!r} ({hint}); `txckpt inspect {path}` lists its {len(known)} tensors",
        path=path,
        tensor=name,
        close_names=close,
    )


def _read_verified(found: Found, wanted: dict[str, TensorInfo]) -> dict[str, bytes]:
    """The bytes of each wanted tensor, read by range and checked against its digest."""
    by_file: dict[str, list[str]] = {}
    for key, t in wanted.items():
        by_file.setdefault(t.file, []).append(key)
    out: dict[str, bytes] = {}
    for file, keys in by_file.items():
        where = f"{found.path.rstrip('/')}/{file}"
        if found.storage.is_symlink_escape(found.file_key(file)):  # protocol §3: never read through one
            raise UnsafePathError(f"{where} is a symlink that leaves the root; refusing to read it", path=where)
        try:
            datas = found.storage.read_ranges(
                found.file_key(file), [(wanted[k].offset, wanted[k].nbytes) for k in keys]
            )
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise IntegrityError(
                f"{where} is missing: the checkpoint is damaged; load another one (`txckpt ls`) or "
                "restore the file from a copy",
                path=where,
            ) from None
        for key, data in zip(keys, datas):
            t = wanted[key]
            if len(data) != t.nbytes or digest_bytes(data) != t.digest:
                what = "is shorter than" if len(data) != t.nbytes else "does not match"
                raise TensorIntegrityError(
                    f"tensor {t.name!r} of {where} (bytes {t.offset}..{t.offset + t.nbytes}) {what} the "
                    "digest its manifest records: the file is damaged. Nothing was returned; run "
                    "`txckpt verify` on the checkpoint, load another checkpoint, or restore the file from a copy",
                    path=where,
                    file=file,
                    tensor=t.name,
                )
            out[key] = data
    return out


def _from_torch_save(t: TensorInfo, data: bytes, device: Any) -> Any:
    """A DCP item's tensor from its verified bytes, one ``torch.save`` stream (protocol §3b),
    loaded with ``weights_only=True``; it must be the dtype and shape the index records."""
    torch = deps.torch
    try:
        out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load raises: the stream is not a tensor
        out, why = None, f"{type(e).__name__}: {e}"
    else:
        why = f"a {type(out).__name__}"
    if not isinstance(out, torch.Tensor) or (dtype_label(out.dtype), tuple(out.shape)) != (t.dtype, t.shape):
        if isinstance(out, torch.Tensor):
            why = f"a {dtype_label(out.dtype)} tensor of shape {list(out.shape)}"
        raise IntegrityError(
            f"tensor {t.name!r} of {t.file!r} matched its digest but its torch.save stream holds {why}, not the "
            f"{t.dtype} tensor of shape {list(t.shape)} the index records: the checkpoint's writer recorded it "
            "wrongly; load it with dcp.load (TransactionalReader) instead",
            path=t.file,
        )
    return out if device in (None, "cpu") else out.to(device)


def _to_tensor(t: TensorInfo, data: bytes, device: Any) -> Any:
    if t.encoding == TORCH_SAVE_ENCODING:
        return _from_torch_save(t, data, device)
    if t.encoding is not None:
        raise InvalidArgumentError(
            f"tensor {t.name!r} of {t.file!r} is stored as {t.encoding!r}, which this txckpt cannot decode; "
            "upgrade txckpt"
        )
    torch = deps.torch
    try:
        dtype = torch_dtype(t.dtype)
    except KeyError:
        raise InvalidArgumentError(
            f"tensor {t.name!r} of {t.file!r} has dtype {t.dtype}, which this torch cannot hold; upgrade torch"
        ) from None
    try:
        if not data:
            out = torch.empty(t.shape, dtype=dtype)
        else:
            out = torch.frombuffer(bytearray(data), dtype=dtype).reshape(t.shape)
    except (RuntimeError, ValueError) as e:  # the header's shape and byte range disagree
        raise IntegrityError(
            f"tensor {t.name!r} of {t.file!r} matched its digest but its {t.nbytes} bytes are not a "
            f"{t.dtype} tensor of shape {list(t.shape)} ({e}): the file's safetensors header is malformed; "
            "re-save it with safetensors",
            path=t.file,
        ) from None
    if out.numel() * out.element_size() != t.nbytes:
        raise IntegrityError(
            f"tensor {t.name!r} of {t.file!r}: shape {list(t.shape)} of {t.dtype} is not its {t.nbytes} bytes "
            "(a malformed safetensors header); re-save it with safetensors",
            path=t.file,
        )
    return out if device in (None, "cpu") else out.to(device)


def load_tensors(
    path: str | os.PathLike,
    names: Iterable[str],
    *,
    device: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The tensors ``names`` of the committed checkpoint at ``path``, as ``{name: tensor}``
    on ``device``, reading only their bytes (ranged reads, locally and on object stores), each
    checked against its digest in the manifest's tensor index before anything is returned
    (``TensorIntegrityError`` names the file and tensor on a mismatch). A name is a tensor's
    name, or ``"<file>:<name>"`` (needed where two files hold that name). A name the checkpoint lacks
    raises ``TensorNotFoundError`` listing the close ones. A checkpoint written before the
    tensor index has its safetensors files read whole, verified against their file digests."""
    wanted_names = [names] if isinstance(names, str) else list(names)
    text = os.fspath(path)
    opts = options_for(text, storage_options)

    def attempt(found: Found) -> tuple[Found, dict[str, TensorInfo], list[str], list[str], dict[str, bytes]]:
        wanted, unindexed, missing = _resolve(found, wanted_names)
        return found, wanted, unindexed, missing, _read_verified(found, wanted)

    found, wanted, unindexed, missing, raw = read_checked(text, opts, attempt)
    out = {key: _to_tensor(wanted[key], raw[key], device) for key in wanted_names if key in wanted}
    if missing:  # only where some safetensors file has no index: read those whole, verified
        loaded = load_files(
            text,
            files=unindexed,
            map_location=device,
            storage_options=opts,
            weights_only=True,
            verify=True,
            mmap=False,
        )
        tensors: dict[str, Any] = {}
        for file in unindexed:
            tensors.update(loaded[file])
        known = list(contents_of(found.path, found.manifest).tensor_keys()) + list(tensors)
        for name in missing:
            if name not in tensors:
                raise _not_found(found.path, name, known)
            out[name] = tensors[name]
    return {key: out[key] for key in wanted_names}
