"""Local emulators of the remote stores txckpt supports, for tests and benchmarks alike.

``emulators.s3``     moto's S3 server on 127.0.0.1 behind a middleware that counts requests,
                     injects faults and makes conditional writes atomic (as S3 does);
``emulators.gcs``    fake-gcs-server;
``emulators.azure``  Azurite's blob service;
``emulators.seaweedfs`` a SeaweedFS cluster (master, three replicated volume servers, filer, S3
                     gateway): a real distributed object store, with faults to inject.

A top-level package rather than part of tests/, so that benchmarks/ uses the same servers without
importing the test suite. Not part of the txckpt wheel (pyproject finds only txckpt*).
"""

import importlib.util
import socket


def missing(*modules: str) -> str | None:
    """The first of ``modules`` that is not installed, or None."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that cannot report the one it picked."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
