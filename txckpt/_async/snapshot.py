"""The snapshot of an asynchronous save: a copy of a ``files`` mapping that the caller may mutate
or free as soon as it is taken, in host buffers reused from one save to the next.

A snapshot copies every tensor it finds, inside nested dicts, lists and tuples too (an
optimizer's ``state_dict``), storage by storage: each distinct storage is copied once into a
buffer of its size and every tensor on it is rebuilt as a view with the same offset, shape and
stride. Tied weights stay tied and views stay views, so ``torch.save`` writes what it would have
written from the live tensors (CUDA tensors land on the CPU, as a ``.cpu()`` would put them).

Buffers are kept by the pool between snapshots, keyed by where the storage was met (file name
and path inside the structure) and its size, so steady-state saves allocate nothing and the pool
never holds more than one copy of the last state it snapshotted (buffers a snapshot did not use
are dropped). The pool must not be reused while a snapshot's save is still reading it: the
caller (txckpt/_async/asyncsave.py) waits for that save first.

CUDA storages are copied into pinned host buffers with non-blocking copies on a side stream
that first waits for the current stream (so the copy sees every queued kernel's writes), and the
side stream is synchronised before :meth:`SnapshotPool.snapshot` returns.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from .._base import deps
from ..errors import InvalidArgumentError

#: A buffer's key: (file name, path inside the file's structure, bytes, pinned).
Key = tuple[str, str, int, bool]


class SnapshotPool:
    """Host buffers for snapshots, reused from one snapshot to the next."""

    def __init__(self) -> None:
        self._buffers: dict[Key, Any] = {}
        #: Streams used for device-to-host copies, by device.
        self._streams: dict[Any, Any] = {}

    @property
    def buffer_count(self) -> int:
        return len(self._buffers)

    @property
    def buffer_bytes(self) -> int:
        return sum(k[2] for k in self._buffers)

    def clear(self) -> None:
        """Free every buffer (the next snapshot allocates again)."""
        self._buffers.clear()

    def snapshot(
        self, files: Mapping[str, Any], live: frozenset[int] = frozenset(), only: frozenset[int] | None = None
    ) -> dict[str, Any]:
        """A copy of ``files`` that shares no mutable object with it. Raises InvalidArgumentError
        for an object it cannot copy (the save would not see what the caller passed).

        The two halves of a lazy snapshot (txckpt/_async/asyncsave.py, ``LazySnapshot``): ``live``,
        data pointers of CPU storages whose tensors are kept as they are, not copied (copied
        later, before the optimizer changes them); ``only``, copy just the tensors on those
        storages and keep everything else as it is (it is the first half's private copy)."""
        run = _Run(self, live, only)
        try:
            out = {name: run.copy(obj, name, "") for name, obj in files.items()}
            run.finish()
        except InvalidArgumentError:
            raise
        except Exception as e:
            raise InvalidArgumentError(
                f"txckpt.async_save could not snapshot the state ({type(e).__name__}: {e}); "
                "save it with txckpt.save_checkpoint instead"
            ) from e
        # Buffers this snapshot did not use are dropped: the pool holds one state's worth.
        self._buffers = run.used
        return out

    def _stream(self, device: Any) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = deps.torch.cuda.Stream(device=device)
        return s


class _Run:
    """One snapshot: the copies made so far (memo), the buffers taken, the streams to wait on."""

    def __init__(self, pool: SnapshotPool, live: frozenset[int] = frozenset(), only: frozenset[int] | None = None):
        self.pool = pool
        self.live = live
        self.only = only
        self.free = dict(pool._buffers)  # not yet claimed by this snapshot
        self.used: dict[Key, Any] = {}
        self.memo: dict[int, Any] = {}  # id(object) -> its copy (one object met twice: one copy)
        self.storages: dict[tuple[Any, int, int], Any] = {}  # (device, data_ptr, nbytes) -> buffer
        self.streams: list[Any] = []
        self.keep: list[Any] = []  # the originals, alive until the copies are synchronised

    def copy(self, obj: Any, name: str, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, range)):
            return obj  # immutable
        found = self.memo.get(id(obj))
        if found is not None:
            return found
        out = self._copy(obj, name, path)
        self.memo[id(obj)] = out
        self.keep.append(obj)
        return out

    def _copy(self, obj: Any, name: str, path: str) -> Any:
        if _is_tensor(obj):
            return self._tensor(obj, name, path)
        if self.only is not None and not isinstance(obj, (dict, list, tuple)):
            # The second half of a lazy snapshot walks the first half's private copy: what is
            # not a tensor was copied there, and copying it again would only lengthen the wait
            # of the optimizer step held for this half.
            return obj
        if isinstance(obj, (bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, dict):
            if type(obj) is dict:
                return {k: self.copy(v, name, f"{path}/{k}") for k, v in obj.items()}
            # A subclass (a state_dict's OrderedDict and its _metadata): same class, same
            # attributes, then every value replaced by its copy (the keys keep their order).
            out = copy.copy(obj)
            if getattr(out, "__dict__", None) and self.only is None:
                out.__dict__.update(copy.deepcopy(obj.__dict__))
            for k, v in obj.items():
                out[k] = self.copy(v, name, f"{path}/{k}")
            return out
        if isinstance(obj, list):
            items = [self.copy(v, name, f"{path}/{i}") for i, v in enumerate(obj)]
            if type(obj) is list:
                return items
            same = copy.copy(obj)  # a list subclass: its class and attributes kept
            same[:] = items
            return same
        if isinstance(obj, tuple):
            items = [self.copy(v, name, f"{path}/{i}") for i, v in enumerate(obj)]
            if type(obj) is tuple:
                return tuple(items)
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        # Anything else (numpy arrays, sets, user objects) is deep-copied: correct, not pooled.
        return copy.deepcopy(obj)

    def _tensor(self, t: Any, name: str, path: str) -> Any:
        torch = deps.torch
        if self.only is not None and (t.device.type != "cpu" or t.untyped_storage().data_ptr() not in self.only):
            return t  # copied by the first half already
        plain = type(t) in (torch.Tensor, torch.nn.Parameter)
        if not plain or t.layout != torch.strided or t.device.type == "meta" or t.is_quantized:
            # Subclasses (DTensor...), sparse and quantized tensors: a fresh copy of their own.
            return t.detach().clone().cpu() if t.device.type not in ("cpu", "meta") else t.detach().clone()
        src = t.untyped_storage()
        if self.live and t.device.type == "cpu" and src.data_ptr() in self.live:
            return t  # kept live: copied later by the caller's own rule
        nbytes = src.nbytes()
        where = (t.device, src.data_ptr(), nbytes)
        host = self.storages.get(where)
        if host is None:
            host = self.storages[where] = self._copy_storage(t, src, nbytes, name, path)
        view = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if type(t) is torch.nn.Parameter:
            return torch.nn.Parameter(view, requires_grad=t.requires_grad)
        if t.requires_grad:
            view.requires_grad_(True)  # torch.save records the flag
        return view

    def _copy_storage(self, t: Any, src: Any, nbytes: int, name: str, path: str) -> Any:
        torch = deps.torch
        cuda = t.device.type == "cuda"
        key: Key = (name, path, nbytes, cuda)
        buf = self.free.pop(key, None)
        if buf is None:  # met somewhere else than last time: any free buffer of its size
            other = next((k for k in self.free if k[2:] == key[2:]), None)
            buf = self.free.pop(other) if other is not None else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.used[key] = buf
        if nbytes == 0:
            return buf.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(src)
        if cuda:
            stream = self.pool._stream(t.device)
            if stream not in self.streams:
                stream.wait_stream(torch.cuda.current_stream(t.device))
                self.streams.append(stream)
            with torch.cuda.stream(stream):
                buf.copy_(whole, non_blocking=True)
        elif t.device.type == "cpu":
            buf.copy_(whole)
        else:  # another accelerator: a blocking copy
            buf.copy_(whole.cpu())
        return buf.untyped_storage()

    def finish(self) -> None:
        """Wait for every device-to-host copy: after this the caller may change its tensors."""
        for stream in self.streams:
            stream.synchronize()
        self.keep.clear()


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


__all__ = ["SnapshotPool"]
