"""A synthetic training state of a given size: 1/3 model weights (a safetensors file), 2/3 AdamW
state (``exp_avg`` and ``exp_avg_sq`` per parameter, a torch.save file), shaped like a
transformer's parameters (large matrices with a small vector beside each)."""

from __future__ import annotations

import os
from typing import Any

#: Largest single tensor, in float32 elements (16 MiB): a 4096 x 1024 projection.
_MAX_ELEMS = 4 << 20


def _shapes(n_elems: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    left = n_elems
    while left > 0:
        vec = min(1024, left)
        shapes.append((vec,))
        left -= vec
        if left <= 0:
            break
        mat = min(_MAX_ELEMS, left)
        rows = max(1, mat // 1024)
        if rows * 1024 > left:
            shapes.append((left,))
            left = 0
        else:
            shapes.append((rows, 1024))
            left -= rows * 1024
    return shapes


def make_state(total_bytes: int, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(weights, optimizer_state_dict) whose tensors hold ``total_bytes`` in all (float32)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, total_bytes // 3 // 4)
    weights: dict[str, Any] = {}
    state: dict[int, dict[str, Any]] = {}
    for i, shape in enumerate(_shapes(n)):
        kind = "weight" if len(shape) == 2 else "bias"
        w = torch.empty(shape).uniform_(-1, 1, generator=g)
        weights[f"layers.{i // 2}.{kind}"] = w
        state[i] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.empty(shape).uniform_(-1e-3, 1e-3, generator=g),
            "exp_avg_sq": torch.empty(shape).uniform_(0, 1e-6, generator=g),
        }
    optim = {
        "state": state,
        "param_groups": [
            {
                "lr": 1e-4,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.01,
                "amsgrad": False,
                "foreach": None,
                "maximize": False,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "params": list(state),
            }
        ],
    }
    return weights, optim


def tensors_of(weights: dict[str, Any], optim: dict[str, Any]) -> list[Any]:
    """Every tensor of the state, in file order (weights, then optimizer state)."""
    out = list(weights.values())
    for s in optim["state"].values():
        out.extend(v for v in s.values() if v.dim() > 0)
    return out


def state_bytes(weights: dict[str, Any], optim: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(weights, optim))


def files_of(weights: dict[str, Any], optim: dict[str, Any]) -> dict[str, Any]:
    """The files a save_checkpoint call writes for this state."""
    return {"model.safetensors": weights, "optimizer.pt": optim}


def write_raw(path: str, tensors: list[Any], nbytes: int | None = None, fsync: bool = True) -> int:
    """The physical limit: the tensors' bytes in one sequential write to one new file, then fsync.
    ``nbytes`` pads (or cuts) the stream to exactly that many bytes, so the raw write moves as
    many bytes as the checkpoint it is compared with."""
    import torch

    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            if nbytes is not None and written + len(view) > nbytes:
                view = view[: nbytes - written]
            written += _write_all(fd, view)
            if nbytes is not None and written >= nbytes:
                break
        if nbytes is not None and written < nbytes:
            written += _write_all(fd, memoryview(bytes(nbytes - written)))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _write_all(fd: int, view: memoryview) -> int:
    n = 0
    while n < len(view):
        n += os.write(fd, view[n:])
    return n


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path``, then ``path``'s parent: what a stock writer
    would have to do to be as durable as a txckpt commit."""
    from txckpt._base import fileio

    fileio.fsync_tree(path)
    fileio.fsync_dir(os.path.dirname(os.path.abspath(path)))


def evict(path: str) -> None:
    """Drop the (clean) page-cache pages of every file under ``path`` so the next read is cold."""
    for dirpath, _d, filenames in os.walk(path):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
