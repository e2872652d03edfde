"""Tensor-level reads (issue 47), side by side in one run: ``txckpt.inspect_checkpoint`` and
``diff_checkpoints`` of checkpoints of 1,000 tensors against reading the same facts with stock
safetensors (``safe_open``: keys, dtypes, shapes from the header), and ``txckpt.load_tensors`` of
one 4 MiB tensor of a 1 GiB file against an unverified stock read of it
(``safe_open(...).get_tensor(name).clone()``). Both sides read from the page cache (warm-up
rounds first): the ratio is the cost of txckpt's path (manifest, log check, ranged read, digest
check), not of the disk.

``python -m benchmarks.tensors [--quick|--tiny]`` prints the table; ``python -m benchmarks run
--cases tensors`` puts it in the report."""

from __future__ import annotations

import os
from typing import Any

from . import harness as h

TITLE = "Tensors: inspect, diff, load_tensors"
MiB = 1 << 20


def _shape() -> tuple[int, int, int]:
    """(tensors in the inspect checkpoint, file size of the load benchmark, rounds)."""
    s = h.settings()
    if s.tiny:
        return 50, 8 * MiB, 2
    if s.quick:
        return 1000, 256 * MiB, 7
    return 1000, 1024 * MiB, 11


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _inspect_rows(n: int, reps: int) -> list[dict[str, Any]]:
    import torch
    from safetensors import safe_open

    import txckpt

    base = h.fresh_dir("tensors-inspect")
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i // 10}.p{i % 10}.weight": torch.randn(16, 16, generator=g) for i in range(n)}
    a = txckpt.save_checkpoint(base, 1, {"model.safetensors": model})
    model[next(iter(model))] = torch.zeros(16, 16)
    b = txckpt.save_checkpoint(base, 2, {"model.safetensors": model})
    file_a, file_b = os.path.join(a, "model.safetensors"), os.path.join(b, "model.safetensors")

    def stock_list(path: str) -> list[tuple[str, Any, Any]]:
        with safe_open(path, "pt") as f:
            return [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]

    def stock_diff() -> int:
        # The stock way to tell changed tensors: read both files (no digests to compare).
        with safe_open(file_a, "pt") as fa, safe_open(file_b, "pt") as fb:
            return sum(not torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())

    methods = [
        h.Method("inspect", lambda ctx: txckpt.inspect_checkpoint(a), settle=False),
        h.Method("stock header", lambda ctx: stock_list(file_a), settle=False),
        h.Method("diff", lambda ctx: txckpt.diff_checkpoints(a, b), settle=False),
        h.Method("stock read+compare", lambda ctx: stock_diff(), settle=False),
    ]
    times = h.interleave(methods, reps, warmup=2)
    assert txckpt.diff_checkpoints(a, b).counts()["changed"] == 1
    rows = [
        h.compare(
            f"inspect_checkpoint vs safe_open keys/dtypes/shapes ({n} tensors; goal: <= 50 ms)",
            f"{n} tensors",
            times,
            "inspect",
            "stock header",
            None,
            f"inspect {h.median(times['inspect']) * 1e3:.1f} ms (manifest + log check, 0 tensor bytes)",
        ),
        h.compare(
            f"diff_checkpoints vs reading both files and comparing ({n} tensors; goal: <= 100 ms)",
            f"{n} tensors",
            times,
            "diff",
            "stock read+compare",
            None,
            f"diff {h.median(times['diff']) * 1e3:.1f} ms (two manifests, 0 tensor bytes)",
        ),
    ]
    h.remove(base)
    return rows


def _load_rows(size: int, reps: int) -> list[dict[str, Any]]:
    import torch
    from safetensors import safe_open

    import txckpt

    base = h.fresh_dir("tensors-load")
    # One 4 MiB tensor in the middle of a file of ``size`` bytes, straddling a chunk boundary.
    half = (size - 4 * MiB) // 2 // 4
    tensors = {
        "a.before": torch.ones(half, dtype=torch.float32),
        "b.target": torch.arange(MiB, dtype=torch.float32),
        "c.after": torch.ones(half, dtype=torch.float32),
    }
    path = txckpt.save_checkpoint(base, 1, {"model.safetensors": tensors})
    del tensors
    file = os.path.join(path, "model.safetensors")
    txckpt.load_tensors(path, ["b.target"])  # warm: the page cache holds the file for both sides

    def stock(ctx: Any) -> Any:
        with safe_open(file, "pt") as f:
            return f.get_tensor("b.target").clone()

    methods = [
        h.Method("load_tensors", lambda ctx: txckpt.load_tensors(path, ["b.target"]), settle=False),
        h.Method("stock get_tensor", stock, settle=False),
    ]
    times = h.interleave(methods, reps, warmup=2)
    before = _rchar()
    out = txckpt.load_tensors(path, ["b.target"])
    read = _rchar() - before
    assert torch.equal(out["b.target"], torch.arange(MiB, dtype=torch.float32))
    row = h.compare(
        f"load_tensors (verified) vs safe_open get_tensor().clone() (unverified), 4 MiB of {h.fmt_size(size)}; goal 1.2x",
        size,
        times,
        "load_tensors",
        "stock get_tensor",
        1.2,
        f"txckpt read {read / MiB:.2f} MiB in all (read syscalls: the tensor, the manifest, the log); "
        "the bound is tensor + one 16 MiB chunk + header",
    )
    h.remove(base)
    return [row]


def _index_cost_rows(size: int, reps: int) -> list[dict[str, Any]]:
    """What the index adds to a save's one pass over the bytes: ``HashingWriter`` (the writer of
    ``tx.save``) into a sink that drops the bytes, with the indexer's tap and without: the CPU
    the index costs, with no disk in the way."""
    import io

    import torch
    from safetensors.torch import save

    from txckpt._base.checksum import HashingWriter
    from txckpt._manifest.tensor_index import CHUNK_SIZE, Indexer

    n = 64
    data = memoryview(save({f"t{i}": torch.ones(size // n // 4) for i in range(n)}))

    class Null(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            return len(b)

    def write(with_index: bool) -> None:
        # As tx.save writes a safetensors file: chunk digests by the writer, tensors by the tap.
        ix = Indexer("model.safetensors", chunks=False) if with_index else None
        w = HashingWriter(Null(), chunk_size=CHUNK_SIZE if with_index else 0, tap=ix.update if ix else None)
        for i in range(0, len(data), 64 * MiB):  # the writes a serializer makes: large ones
            w.write(data[i : i + 64 * MiB])
        w.close()
        if ix is not None:
            ix.finish(w.size, w.chunks)

    methods = [
        h.Method("indexed", lambda ctx: write(True), settle=False),
        h.Method("file digest only", lambda ctx: write(False), settle=False),
    ]
    times = h.interleave(methods, reps, warmup=1)
    return [
        h.compare(
            f"hash-while-write pass of {h.fmt_size(len(data))}: with the tensor index and chunk digests vs "
            "the file digest alone",
            len(data),
            times,
            "indexed",
            "file digest only",
            None,
            "CPU only (the sink drops the bytes): each byte is hashed three times (file, chunk, tensor) but "
            "the first 16 MiB, whose chunk digest is the file's running digest (twice); chunks are not "
            "hashed in parallel yet",
        )
    ]


def _commit_hash_rows(size: int, reps: int) -> list[dict[str, Any]]:
    """The commit's pass over a safetensors file other code wrote into ``tx.directory``
    (``fileio.hash_file`` with the tensor index's tap, as ``claims.hash_staged`` runs it), from
    the page cache: the tap (chunk and tensor digests) on a second thread, one block behind the
    file's digest, against the one-thread pass (``TAP_THREAD_FROM`` set past the file)."""
    import torch
    from safetensors.torch import save_file

    from txckpt._base import fileio
    from txckpt._manifest.tensor_index import Indexer

    n = 64
    folder = h.fresh_dir("commit-hash")
    path = os.path.join(folder, "model.safetensors")
    save_file({f"t{i}": torch.ones(size // n // 4) for i in range(n)}, path)
    nbytes = os.path.getsize(path)
    real = fileio.TAP_THREAD_FROM

    def hashed(threaded: bool) -> None:
        fileio.TAP_THREAD_FROM = 0 if threaded else 1 << 62
        ix = Indexer("model.safetensors")
        got, _ = fileio.hash_file(path, tap=ix.update)
        ix.finish(got)

    methods = [
        h.Method("tap thread", lambda ctx: hashed(True), settle=False),
        h.Method("one thread", lambda ctx: hashed(False), settle=False),
    ]
    try:
        times = h.interleave(methods, reps, warmup=1)
    finally:
        fileio.TAP_THREAD_FROM = real
        h.remove(folder)
    return [
        h.compare(
            f"commit-time hash of a {h.fmt_size(nbytes)} safetensors file other code wrote: "
            "tensor index on a second thread vs one thread",
            nbytes,
            times,
            "tap thread",
            "one thread",
            None,
            f"page cache warm; {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.2f} at the end",
        )
    ]


def run(quick: bool) -> dict[str, Any]:
    n, size, reps = _shape()
    rows = (
        _inspect_rows(n, reps)
        + _load_rows(size, reps)
        + _index_cost_rows(min(size, 256 * MiB), reps)
        + _commit_hash_rows(min(size, 256 * MiB), reps)
    )
    return {
        "title": TITLE,
        "about": "Medians of interleaved rounds in one process, page cache warm for both sides. "
        "inspect/diff read the manifest only; load_tensors reads the tensor's byte range and checks "
        "its xxh3-128 before returning it; the stock read maps the file and copies the tensor, unchecked.",
        "rows": rows,
        "unit": "s",
    }


def _show(r: dict[str, Any]) -> str:
    return (
        f"{r['case']}\n    txckpt {r['txckpt'] * 1e3:.2f} ms, other {r['other'] * 1e3:.2f} ms, "
        f"ratio {r['ratio']:.3f} (rounds {r['reps']}; {r['note']})"
    )


def main(argv: list[str] | None = None) -> int:
    return h.module_main("python -m benchmarks.tensors", run, _show, argv)


if __name__ == "__main__":
    raise SystemExit(main())
