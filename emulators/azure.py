"""Azurite (Azure Blob emulator) on loopback, for the tests' azure rows.

Optional. Installed as .ci/run (and docs/remote.md, "Running the tests") installs it:
  pip install -e '.[emulators]'          adlfs
  npm install --prefix .ci/node azurite@3.37.0 && export AZURITE_BLOB=$PWD/.ci/node/node_modules/.bin/azurite-blob
Azurite is also found without AZURITE_BLOB at that .ci/node path, or as azurite-blob on PATH.
"""

from __future__ import annotations

import os
import threading
from typing import Any

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (  # Azurite's published well-known development key, not a secret
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


#: Where .ci/run installs Azurite (npm --prefix .ci/node).
AZURITE_CI_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci", "node", "node_modules", ".bin", "azurite-blob"
)
AZURITE_HOWTO = (
    "npm install --prefix .ci/node azurite@3.37.0 && export "
    "AZURITE_BLOB=$PWD/.ci/node/node_modules/.bin/azurite-blob (as .ci/run does; docs/remote.md)"
)


def azurite_binary() -> str | None:
    import shutil

    if os.environ.get("AZURITE_BLOB"):
        return os.environ["AZURITE_BLOB"]
    if os.access(AZURITE_CI_PATH, os.X_OK):
        return AZURITE_CI_PATH
    return shutil.which("azurite-blob")


class AzuriteServer:
    """Azurite's blob service (in-memory) on 127.0.0.1, on a port it picks and reports."""

    def __init__(self, binary: str):
        self.binary = binary
        self.proc = None
        self.endpoint_url = ""

    def start(self) -> "AzuriteServer":
        import re
        import subprocess

        self.proc = subprocess.Popen(
            [
                self.binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                "0",
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--loose",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        for line in self.proc.stdout:  # blocks until Azurite reports where it listens
            lines.append(line)
            m = re.search(r"listens on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.endpoint_url = m.group(1)
                break
        if not self.endpoint_url:
            self.proc.wait()
            raise RuntimeError("Azurite did not start:\n" + "".join(lines))
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint_url}/{AZURITE_ACCOUNT};"
        )

    def storage_options(self) -> dict[str, Any]:
        return {"connection_string": self.connection_string, "skip_instance_cache": True}

    def create_container(self, name: str) -> None:
        import adlfs

        adlfs.AzureBlobFileSystem(**self.storage_options()).mkdir(name)
