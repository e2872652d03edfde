"""docs/remote.md's how-to ("Using a remote root") runs as written, against the local servers.

The fenced blocks whose info string names a store (```bash s3, ```python gcs, ...) are taken
from the doc itself, so the doc cannot drift from what works: per store, in order, into one
bash script (a python block becomes ``python - <<'EOF'``), run with ``set -euo pipefail``. The
only change is the server's address: the doc's 127.0.0.1:9000 / :4443 / :10000 become the ports
the fixtures' servers listen on. Credentials and endpoints come from the doc's own lines: the
test removes the session's fake AWS credentials, endpoint and emulator variables first (the
config files stay /dev/null and the instance metadata service off: nothing leaves the machine).
GCS and Azure skip where their emulators are not installed (see the end of docs/remote.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "remote.md")
DOC_ADDRESS = {"s3": "http://127.0.0.1:9000", "gcs": "http://127.0.0.1:4443", "azure": "http://127.0.0.1:10000"}
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)
_DROP = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "STORAGE_EMULATOR_HOST",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, store, body) of every fenced block, in the doc's order."""
    out = []
    for info, body in _FENCE.findall(text):
        words = info.split()
        out.append((words[0] if words else "", words[1] if len(words) > 1 else "", body))
    return out


def howto_script(store: str) -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    lines = ["set -euo pipefail"]
    for lang, tag, body in blocks(text):
        if tag != store:
            continue
        assert lang in ("bash", "python"), f"a {store} block in {lang}: the test runs bash and python"
        lines.append(body if lang == "bash" else f"python - <<'EOF'\n{body}EOF")
    assert len(lines) > 2, f"docs/remote.md has no runnable {store} blocks"
    return "\n".join(lines) + "\n"


def run_howto(store: str, endpoint: str, tmp_path) -> str:
    script = howto_script(store)
    assert DOC_ADDRESS[store] in script, "the doc's address for the local server changed"
    script = script.replace(DOC_ADDRESS[store], endpoint)
    # `python` and `txckpt` as a user has them: this interpreter, and its `python -m txckpt`.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("python", ""), ("txckpt", " -m txckpt")):  # a symlink loses the venv
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"the {store} how-to failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_the_doc_has_a_runnable_how_to_for_each_store():
    for store in DOC_ADDRESS:
        howto_script(store)
    with open(DOC, encoding="utf-8") as f:
        policies = [body for lang, _, body in blocks(f.read()) if lang == "json"]
    assert policies and all(json.loads(b)["Statement"] for b in policies)  # the IAM policy parses


@pytest.mark.s3
def test_the_s3_how_to_runs_as_written(s3_server, tmp_path):
    s3_server.reset()
    out = run_howto("s3", s3_server.endpoint_url, tmp_path)
    assert out.count("s3://my-bucket/run-1/.txckpt/tx/") >= 2 and "checkpoint-100" in out, out
    assert "ok: the store refused the second create" in out, out
    # The first-run idiom: nothing to resume on a prefix never written, then its checkpoint.
    assert "first run: resume from None\n" in out, out
    assert "restart: resume from s3://my-bucket/run-2/.txckpt/tx/" in out and "/checkpoint-100\n" in out, out


@pytest.mark.gcs
def test_the_gcs_how_to_runs_as_written(gcs_server, tmp_path):
    out = run_howto("gcs", gcs_server.endpoint_url, tmp_path)
    assert "gs://my-gcs-bucket/run-1/.txckpt/tx/" in out and "checkpoint-100" in out, out


@pytest.mark.azure
def test_the_azure_how_to_runs_as_written(azure_server, tmp_path):
    out = run_howto("azure", azure_server.endpoint_url, tmp_path)
    # adlfs names the path abfs:// (fsspec's first protocol of the filesystem), not az://
    assert "://my-container/run-1/.txckpt/tx/" in out and "checkpoint-100" in out, out
