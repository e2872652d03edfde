"""The test suite's shared machinery.

``tests.harness.tracer``    :class:`~tests.harness.tracer.Tracer`, the one operation tracer: counts
                            file operations (or those a subclass interposes: fsspec's memory store,
                            S3 requests) and kills, raises or fails with ENOSPC at one of them. The
                            crash sweeps (tests/crash_harness.py), the distributed sweep
                            (tests/dist_workers.py) and the reliability campaign's injectors
                            (tests/reliability/injectors.py) all count through it;
``tests.harness.procs``     :func:`~tests.harness.procs.run_child`, the one fork runner: fork, run,
                            bring back the JSON result or the error and how the child ended;
``tests.harness.fs``        :func:`~tests.harness.fs.tree`, a directory tree as content hashes;
``tests.harness.backends``  the pytest plugin of roots on every backend and the emulators they run
                            on (loaded by tests/conftest.py; the servers live in ``emulators/``).

Real torch.distributed ranks start from the preloaded forkserver in tests/dist_workers.py (a
launcher, not a fork of the test process: ranks must not inherit its threads).
"""
