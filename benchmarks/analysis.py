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

ANALYSIS: dict[str, str] = {
    "save-device": (
        "Where the time goes (census and profile above; measured 2026-12-01 on this 2-core "
        "machine shared with other jobs, load average 6-10): at 1 GiB the save is bounded by its "
        "writes into the page cache (`write` of `_io.FileIO` ~70% of the wall, xxh3 ~14%, the "
        "fsyncs ~2%), while the O_DIRECT limit moves the same bytes with no CPU copy in "
        "0.6-0.7 s. `sync_file_range(WRITE)`, which `_DurableFile` calls every 4 MiB, submits "
        "the I/O in the caller and blocks while the device queue is full (pure 1 GiB writes from "
        "memory, interleaved: 1.1-3.5 s with it, 1.0-2.0 s without, fsync included), so starting "
        "write-back is not free on this disk.\n\n"
        "Tried, interleaved A/B in one process (5-7 rounds): (1) each data file's fsync deferred "
        "to the batch's `wait()`, so one file's tail is written while the next is serialised "
        "(`txckpt/storage/local.py`, `_LocalWriteBatch`; kept: 256 MiB, 0.85 of the save "
        "before); (2) a write-behind window that waits for, and drops from the cache, what is "
        "more than 16 or 64 MiB behind (pure writes of 1 GiB 1.9-4.6 s -> 0.9-1.3 s, but whole "
        "saves 1.06 s -> 1.29 / 1.28 s: not kept); (3) an O_DIRECT data path from a file's 64th "
        "MiB on, two 8 MiB aligned buffers, a thread writing one while the serialiser fills "
        "the other (0.80 of the buffered save in one run, 1.16-1.19 at 256 MiB and 1 GiB in the "
        "next: not kept). On a loaded machine the CPU-bound side of every comparison pays for "
        "the load and the O_DIRECT limit hardly does.\n\n"
        "What would close it: rerun (2) and (3) on a quiet machine (they are a few dozen lines "
        "each, described above), and hash on a thread of its own, so that the copy into the "
        "page cache (or into the aligned buffer) is the only CPU work in the writer's path."
    ),
    "save-fsync": (
        "What a durable save does on top of the raw side's copy into the page cache: the xxh3 "
        "pass over every byte (`HashingWriter.write` in `txckpt/checksum.py` hashes a whole "
        "tensor, then writes it: two passes over memory, the write's no longer from the cache), "
        "and fixed costs that matter at 64 MiB: 10 fsyncs per save (census above: the three "
        "directories `.txckpt/tx/<txid>/checkpoint-N` created on a fresh root, one per data "
        "file, then manifest, staging directory, log entry, log directory, root), and the files "
        "written and fsynced one after the other (the first file's fsync blocks before the "
        "second file starts). `txckpt/storage/local.py` now starts write-back every 4 MiB (was "
        "32 MiB: 64 MiB, 25 interleaved rounds, 1.53 -> 1.37) with a 1 MiB buffer that large "
        "writes bypass.\n\n"
        "What would close it: (1) `HashingWriter.write` hashing and writing in 1 MiB pieces, "
        "so each piece is written from the cache it was just hashed in (with the unbuffered "
        "large writes of `_DurableFile`, interleaved A/B against one raw write + fsync: 64 MiB "
        "1.32 -> 1.22, 256 MiB 1.04 -> 0.81, 1 GiB 0.99 -> 0.54; an earlier try with 8 MiB "
        "pieces, larger than the 2 MiB L2, showed nothing); (2) at 64 MiB, writing the files "
        "of a `save_checkpoint` in two threads, so one file's fsync overlaps the next file's "
        "serialisation (`CheckpointRoot.save`); (3) fewer commit fsyncs (the manifest written "
        "straight into the private staging directory: O_EXCL, one fsync, no temp file + link)."
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
        "A verified load reads each file once, with `readinto`, into the buffer its tensors are "
        "views of, hashing each chunk as it lands: the largest file in a thread of its own "
        "(`txckpt-hash`, fed chunk by chunk; xxhash releases the GIL), the others in their "
        "reader right after each chunk, from its cache. Each reader decodes its file while the "
        "rest of its hash runs (safetensors and `weights_only=True` torch files; an unrestricted "
        "pickle only once checked) and nothing is returned before every digest matched "
        "(`txckpt/verify.py`, `load_checkpoint_files`; protocol §6a). The trace below shows "
        "what is left of the hash once the read ends: the wait for the digest after the decode. "
        "What the hash still costs is CPU (the note's CPU ratio): hidden where a core is free, "
        "in full where other processes take every core (this machine: 2 vCPUs shared with "
        "other jobs, load average 6-10 during this run), where it slows the readers it shares "
        "the cores with; per-round ratios then range widely.\n\n"
        "**The 4 GiB outlier** (1.9-2.1x before, 94% of the profile \"a lock wait\": the calling "
        "thread waiting for the readers, which cProfile does not see) was the read buffers' "
        "transparent huge pages. This VM is a KVM guest whose balloon reports free memory to the "
        "host (virtio-balloon free page reporting); faulting in a fresh 2.5 GiB huge-page buffer "
        "took 3-20 s against 2.4-3.7 s on small pages, with seconds of host time (`steal` in "
        "/proc/stat) and, in some rounds, hundreds of direct compaction stalls (counted per "
        "round in the note); read with the hash thread right behind the reader's faults, a 1 GiB "
        "load cost 2.5 s of CPU and 119 steal ticks against 1.0 s and 34 on small pages. Which "
        "side of a comparison drew the slow faults decided its ratio. Read buffers are now on "
        "small pages (`fileio.new_buffer`; `TXCKPT_LOAD_HUGE_PAGES=1` opts back in where huge "
        "pages are reliable), on both sides of these comparisons."
    ),
    "load-cold": (
        "Cold, the read from disk dominates and the hash (each chunk as it arrives) and the "
        "decode hide behind it; misses are within the per-round spread of this busy machine "
        "(other jobs share the disk as well as the cores)."
    ),
    "load-stock": (
        "`safetensors.torch.load_file` (safetensors 0.8) maps the file and returns tensors "
        "backed by the mapping: it reads nothing until a tensor is used, and a later change to "
        "the file changes the tensors. The stock side's CPU hardly grows with the checkpoint "
        "(0.49 s at 1 GiB, 0.72 s at 4 GiB on 2026-12-01), so most bytes are not read before "
        "it returns. txckpt reads and "
        "checks every byte before returning, into memory of its own (a verified copy that the "
        "file can no longer change): the warm ratio against a reader that defers its reads is "
        "the cost of reading and hashing the weights at all. The CPU ratio in the note says how "
        "much of it is work, not waiting."
    ),
    "load-memory": (
        "The loaded tensors are views of the one buffer each file is read into, so a load "
        "peaks at about one copy of the checkpoint, verified or not."
    ),
    "memory": (
        "The save streams: the peak above the state is the 1 MiB write buffer of "
        "`_DurableFile` (`txckpt/storage/local.py`, `_WRITE_BUFFER`; 8 MiB before 335f343) plus "
        "pickling scratch; a miss at the smallest size is that constant against a small state, "
        "or the machine's noise in VmHWM."
    ),
    "trainer": (
        "The mixin writes `optimizer.pt` and `scheduler.pt` through the transaction (hashed "
        "while written, no zip CRC32, write-back during the write) and the commit re-reads only "
        "what upstream wrote itself (`model.safetensors`, the JSON and small files). A miss "
        "is the commit's re-read of `model.safetensors` (`claims.hash_staged`, "
        "`txckpt/claims.py`): it once read with an 8 MiB buffer and fsynced after hashing; "
        "`txckpt.fileio.hash_file(path, fsync=durable)` reads through a 1 MiB buffer (hashed "
        "from the cache) and starts the file's write-back before hashing (interleaved A/B, "
        "1.2 GiB: 0.69 -> 0.59 of the stock Trainer + fsync)."
    ),
    "s3-save": (
        "What separates a save from `pipe_file` of its bytes on this setup (client and moto share "
        "one process and its 2 cores, so every CPU cost of either side shows in the wall time). "
        "**Serialising**: `pipe_file` is handed the finished bytes, while the save runs "
        "`torch.save` and the safetensors writer, hashes on the way, and copies each byte once "
        "into the request body (a `BytesIO` that botocore and aiohttp read as it is; before, the "
        "writer kept 1 MiB copies and joined them at `close()`, a second copy of every byte). "
        "Each file's upload runs in the background while the next file is serialised "
        "(`S3Storage.write_batch`, at most 2 files pending, `TXCKPT_S3_PENDING_FILES`), and the "
        "save waits for all of them before it checks the staging and writes the manifest; what "
        "is not overlapped is the first file's serialisation before its PUT and the last file's "
        "PUT. **moto's multipart assembly**: its `CompleteMultipartUpload` concatenates every "
        "part into a new object on the benchmark's own 2 cores, so a multipart file costs the "
        "server its bytes twice; files up to one window of parts (`part_size × max_in_flight`, 64 "
        "MiB, `TXCKPT_S3_MULTIPART_THRESHOLD`) go up as one PutObject, as `pipe_file` sends them. "
        "**Small requests**: 7 per save besides the data, 2-4 ms each here, in 5 round trips "
        "(the intent; the staging listing; manifest; log entry; then at once the hint, the "
        "manifest read-back that makes sure the returned path holds the checkpoint, and the "
        "intent delete), each a step of docs/protocol.md §8; a session that holds its lineage "
        "plans against its own last commit and reads no log first. What would close the rest: "
        "serialising the first file while the intent is written, and the staging listing "
        "overlapped with the manifest's PUT. The row against "
        "`pipe_file` in txckpt's own part shape shows what is txckpt's own cost once the request "
        "shapes are equal."
    ),
}
