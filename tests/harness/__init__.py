"""The test suite's shared machinery.

``tests.harness.backends``  the pytest plugin of roots on every backend and the emulators they run
                            on (loaded by tests/conftest.py; the servers live in ``emulators/``).
"""
