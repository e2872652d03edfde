"""torchrun target of tests/test_dcp.py's process-based async test: each rank saves an FSDP2
model (+ Adam) at every step given with ``dcp.async_save(..., async_checkpointer_type=PROCESS)``
through TransactionalWriter, one save after the other, and prints one ``RESULT <rank> <json>``
line per save. DCP's background process is spawned once per rank and serves every save; it
re-imports this file, hence the ``__main__`` guard.

    torchrun --nproc_per_node 2 dcp_async_process.py ROOT STEPS REF_DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import torch.distributed as dist

    from tests.children import dcp_workers as cw

    root, steps, ref_dir = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        out = cw.save(
            rank, world, root=root, step=step, ref_file=os.path.join(ref_dir, f"ref-{step}.pt"), mode="async-process"
        )
        # One write(2) per line: both ranks share torchrun's stdout, and print's separate writes
        # of its parts interleaved there ("RESULTRESULT 0 ...").
        os.write(1, f"RESULT {rank} {json.dumps({'step': step, **out})}\n".encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
