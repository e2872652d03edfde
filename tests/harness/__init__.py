"""The test suite's shared machinery: libraries imported by tests and by child processes. The
children's entry points (scripts, rank targets) live in tests/children/.

``tests.harness.tracer``    :class:`~tests.harness.tracer.Tracer`, the one operation tracer: counts
                            file operations (or those a subclass interposes: fsspec's memory store,
                            S3 requests) and kills, raises or fails with ENOSPC at one of them. The
                            crash sweeps (tests/harness/crash_sweep.py), the distributed sweep
                            (tests/children/dist_workers.py) and the reliability campaign's injectors
                            (tests/reliability/injectors.py) all count through it;
``tests.harness.procs``     :func:`~tests.harness.procs.run_child`, the one fork runner: fork, run,
                            bring back the JSON result or the error and how the child ended;
``tests.harness.fs``        :func:`~tests.harness.fs.tree`, a directory tree as content hashes;
``tests.harness.crash_sweep`` the crash sweep built on the two: count a scenario's file operations,
                            SIGKILL a child at each one, check the root in a fresh process;
``tests.harness.launcher``  :func:`~tests.harness.launcher.launch`, real torch.distributed runs: gloo
                            ranks forked from a preloaded forkserver, each running a target of
                            tests/children/;
``tests.harness.tiny``      the Trainer tests' tiny model, data and arguments;
``tests.harness.backends``  the pytest plugin of roots on every backend and the emulators they run
                            on (loaded by tests/conftest.py; the servers live in ``emulators/``).

Real torch.distributed ranks start from the preloaded forkserver of ``tests.harness.launcher`` (a
launcher, not a fork of the test process: ranks must not inherit its threads).
"""
