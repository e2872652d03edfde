"""Hand-written explanations, shown in docs/benchmarks.md under a table whose goal is missed.

Keyed by table id. Written from the fsync census and cProfile output the run prints below each
missed table, and from interleaved prototype runs of the proposed core changes (same machine,
2026-11-29, proposed to the core as patches). Update them when the core changes and a rerun shows a
different picture; a table whose goals are all met shows none of this.
"""

_CRC = (
    "**torch.save's zip CRC32** (`txckpt/serialization.py`, `write_object`, the `torch.save` "
    "branch). torch.save computes a CRC32 of every record by default: a second pass over every "
    "byte at ~1.3 GB/s on this CPU (measured: 134 ms for 170 MiB of optimizer state, against "
    "~1 ms to serialise the same state with the CRC off, and 19 ms to xxh3-hash it). It is "
    "the largest CPU cost of a save, and it is redundant: txckpt already hashes every byte with "
    "xxh3-128 on the way, and `torch.load` never checks the zip CRCs (only `unzip -t` / "
    "`zipfile.testzip` would flag them). DCP writes raw tensor bytes without a CRC, which is "
    "why it beats txckpt at 1 GiB and above. Fix: wrap the `torch.save` call in "
    "`torch.utils.serialization.config.patch({'save.compute_crc32': False})` (fall back to "
    "plain torch.save where that config does not exist)."
)

_WRITE_BEHIND = (
    "**No write-behind** (`txckpt/storage/local.py`, `_DurableFile`). Bytes go to the page "
    "cache while serialising and the disk only starts when `close()` calls fsync, so a durable "
    "save costs serialise + flush, one after the other. Fix: in `_DurableFile.write`, every "
    "32 MiB call `sync_file_range(fd, start, len, SYNC_FILE_RANGE_WRITE)` (libc via ctypes; "
    "asynchronous: it queues write-back and returns), so the disk writes while the serialiser "
    "runs and the final fsync waits only for the tail. Alone it gains little while the CRC "
    "pass keeps the CPU the bottleneck; with the CRC gone the two overlap."
)

_FSYNCS = (
    "**Metadata fsyncs** (`txckpt/transactions.py`, `Transaction._commit`; "
    "`txckpt/publication.py`, `RenamePublication.publish`). Besides one fsync per data file a "
    "save issues 7 more (census above): the staging directory twice (`sync_dir(key)`, then "
    "again inside `create_exclusive` after linking the manifest), the manifest, the log entry "
    "and its directory, then the root and the home directory after the publishing rename; "
    "~3-5 ms each here, as much as the raw fsync of 64 MiB. Two are redundant: the "
    "`sync_dir(key)` before the manifest (the directory fsync in `create_exclusive` persists "
    "every entry of the directory) and the fsync of the home directory after the rename (a "
    "rename is one journal transaction; syncing the root persists both sides on ext4/xfs)."
)

ANALYSIS: dict[str, str] = {
    "save-fsync": (
        "Since 0ad5c80 (from this benchmark's first findings) a durable save no longer computes "
        f"torch.save's zip CRC32, starts write-back while it serialises, and issues 7 fsyncs "
        "instead of 9 (census above); DCP and the stock writers + fsync are now well behind it. "
        "What is left against one raw write + fsync is what txckpt does on top of the same "
        "copy into the page cache, and the profile of the largest size shows it: "
        "`BufferedWriter.write` (the copy into the page cache, which the raw side pays too) "
        "and `xxh3_128.update`, ~20% of the wall time: the checksum is a second pass over "
        "every byte, run after each write returns. At 64 MiB the commit's fixed cost (5 small "
        "fsyncs, ~3-5 ms each here) adds ~15-20%. The ranges show how much of the rest is the "
        "shared machine (load average 6-7 during this run).\n\n"
        "Separate interleaved runs right after this one (same machine, 5 rounds each, the "
        "current core against one raw write + fsync) put the same comparison at 1.04 and "
        "0.60 for 1 GiB and at 1.22 and 0.83 for 4 GiB: at these sizes the goal is met in some "
        "runs and missed in others, and the spread is the machine's. Two ways to take the "
        "hash off the critical path were tried there (`HashingWriter.write` in "
        "`txckpt/checksum.py`): hashing in the caller while a second thread does the "
        "`write(2)` made it worse (1.22 → 1.68 at 4 GiB: both passes compete for the same "
        "memory bandwidth on two vCPUs); hashing each 8 MiB chunk right before writing it, so "
        "the write copies from the CPU cache (one DRAM pass instead of two), measured 0.83 → "
        "0.72 at 4 GiB and 0.60 → 0.70 at 1 GiB, i.e. no clear gain above the noise. Neither "
        "is recommended until a quiet machine shows a difference. The fixed cost that "
        "dominates at 64 MiB could shrink by writing the manifest straight into the private "
        "staging directory (O_EXCL, one fsync, no temp file + link; `Transaction._commit` / "
        "`LocalStorage.create_exclusive`)."
    ),
    "save-dcp": (
        "Up to 256 MiB txckpt beats DCP (DCP's planning and metadata cost); from 1 GiB DCP "
        "wins because it writes tensor bytes raw while txckpt's optimizer file goes through "
        f"torch.save and its CRC32 pass. {_CRC} With that change (and write-behind, see the "
        "physical-limit table) the prototype measured 0.37 of DCP at 1 GiB."
    ),
    "save-nofsync": (
        "Both sides serialise the same way (txckpt streams the same safetensors layout and "
        "calls the same torch.save), so the structural extra is txckpt's xxh3 pass (~0.1 s per "
        "GiB here), the Python-level `HashingWriter.write` per record, and the small "
        "log/manifest/intent files; the per-round ranges show that most of the spread is the "
        "shared machine. The CRC change below would put txckpt well under the stock writers, "
        f"which keep computing it. {_CRC}"
    ),
    "load-warm": (
        "`load_checkpoint` reads each file whole into a new `bytes` (`storage.read_bytes`), "
        "hashes it in a second pass (`verify.py`, `_read_one`), then decodes copies of it "
        "(`serialization.read_object`: `safetensors.torch.load(bytes)` and "
        "`torch.load(io.BytesIO(bytes))`). The verification's own cost is that second pass "
        "over DRAM: 80-115 ms per GiB measured here, 4-10% of a load, so ≤ 1.03 cannot hold "
        "while it is a separate pass. Fix in `verify._read_one`: read in 4 MiB chunks with "
        "`readinto` into one preallocated buffer (`torch.empty(size, dtype=torch.uint8)`, not "
        "a zero-filled bytearray) and update the hasher on each chunk while it is still in "
        "cache, so verify=False and verify=True differ by a cache-hot hash only. The same "
        "buffer removes the decode copies: safetensors tensors as views of it "
        "(`buf[off:end].view(dtype).reshape(shape)` from the parsed header), and `torch.load` "
        "from a small `RawIOBase` reader over it instead of `BytesIO` (a prototype: 1 GiB warm "
        "load 2.4 s → 1.7-1.9 s). Same finding in the report table below: load_checkpoint is "
        "5-7x the stock readers, which read each byte once (safetensors mmaps; torch.load "
        "reads records straight from the file) and hash nothing."
    ),
    "load-cold": (
        "Cold, the read from disk dominates and the hash pass should hide behind it (it does "
        "at the largest size); the misses at smaller sizes are within the per-round spread of "
        "this busy machine. The fix is the same as for the warm case: hash each chunk as it is "
        "read (`verify._read_one`), so the hash overlaps the next chunk's I/O."
    ),
    "memory": (
        "The save streams: the peak above the state is a constant ~6-7 MiB at every size (the "
        "8 MiB `BufferedWriter` of `_DurableFile`, `_WRITE_BUFFER` in "
        "`txckpt/storage/local.py`, plus pickling scratch), which is 10% of a 64 MiB state and "
        "well under 1% from 1 GiB. To meet the goal at 64 MiB too, a 1 MiB write buffer is "
        "enough: tensors arrive in writes larger than the buffer and bypass it anyway."
    ),
    "trainer": (
        "Since 0ad5c80 the commit hashes and fsyncs the Trainer's files in a small pool and "
        "issues fewer directory fsyncs; the profile shows what is left: upstream's own "
        "`torch.save` (`write_record`, with its zip CRC32, the same on both sides), and the "
        "main thread waiting (`lock.acquire`) for the pool, which re-reads all 1.2 GiB with "
        "`readinto` (a copy from the page cache) to hash it before the fsyncs can finish. "
        "The stock side only fsyncs. The per-round range (see the table) is wide on this "
        "busy machine.\n\n"
        "What would close it: (1) in `_hash_and_sync` (`txckpt/transactions.py`), hash through "
        "`mmap` instead of `digest_stream`'s read buffer, so the re-read is a pass over the "
        "page cache without a copy; (2) in the mixin (`txckpt/integrations/transformers.py`), "
        "write the two big files through the transaction instead of letting upstream write "
        "them and re-reading them: override `_save_optimizer_and_scheduler` to "
        "`tx.save(\"optimizer.pt\", self.optimizer.state_dict())` (and the scheduler), which "
        "hashes on the way, skips the redundant zip CRC32 and gets write-behind - on its own "
        "this would put the mixin below the stock Trainer, whose `torch.save` of the 880 MB "
        "optimizer state spends much of its time in that CRC (~1.3 GB/s here)."
    ),
}
