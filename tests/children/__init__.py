"""Entry points of the suite's child processes, and nothing else.

The rule (tests/test_architecture.py checks it): a module under tests/ that a child process
starts from (a script run as ``python FILE`` or through torchrun, or a module of rank targets that
tests/harness/launcher.py's forkserver runs) lives here; the libraries that tests and children
import (tracer, fork runner, launcher, crash sweep, the Trainer tests' tiny model, backends) live
in tests/harness/. Only modules here may have an ``if __name__ == "__main__":`` block.

    trainer_rollback.py, trainer_ddp.py,      Trainer runs (one process per command, or torchrun
    trainer_deepspeed_zero3.py,               ranks), run as scripts by tests/test_trainer_*.py
    trainer_zero_consolidate.py
    dcp_async_process.py                      torchrun ranks of tests/test_dcp.py's process-based
                                              async save
    dist_workers.py, dcp_workers.py,          rank targets (``target(rank, world, **kw)``) run by
    claim_workers.py, async_workers.py,       tests.harness.launcher.launch on real gloo ranks
    accelerate_workers.py,
    dcp_incremental_crash.py
"""
