"""A preloaded fork server ("zygote") for the suite's Python child processes.

Most of ``make test``'s time was child interpreters importing torch and transformers (about 8 s
of one core per ``python -c "from transformers import Trainer"`` on the 2-core machines), and the
Trainer tests start several a test. The zygote (tests/children/zygote_server.py) is a server
process started lazily once per test process (per pytest-xdist worker) that imports torch,
transformers (with its Trainer), accelerate, safetensors and fsspec/s3fs once, runs no torch
computation (no OpenMP pool exists when it forks), and imports neither txckpt nor tests: every
child imports txckpt fresh, under its own environment. Each child is a real process, forked by
the zygote, which is its parent and reaps it:

- :func:`run_python` is ``subprocess.run([sys.executable, *argv], capture_output=True,
  text=True, env=..., cwd=..., timeout=...)``; a timeout SIGKILLs the child and raises
  :class:`subprocess.TimeoutExpired` with what it printed so far;
- :func:`popen_python` is ``subprocess.Popen([sys.executable, *argv], ...)``: a handle with
  ``pid``, ``poll``, ``wait(timeout)``, ``returncode`` (``-N`` for a death by signal N),
  ``send_signal``/``terminate``/``kill``, ``communicate`` and ``stdout``/``stderr`` pipes.

``argv`` is what follows the interpreter on a command line: ``[script, *args]``,
``["-m", module, *args]`` or ``["-c", code, *args]``. The child gets exactly the environment given
(``env=None``: this process's, as subprocess does), that cwd, sys.argv and sys.path as a fresh
interpreter computes them (PYTHONPATH included), default signal dispositions, PYTHONUNBUFFERED
and PYTHONIOENCODING honoured, and exits as an interpreter does (SystemExit codes, an uncaught
exception's traceback and exit 1, non-daemon threads joined, atexit callbacks, stdio flushed).

What a fork cannot give a child, so such a launch runs as a plain subprocess instead (counted in
``FALLBACKS``): an environment that differs from the zygote's in a variable that torch,
transformers, accelerate, huggingface_hub or the interpreter read at import or start-up
(``import_time_differences``). Except for a few such variables that the suite sets for whole
groups of children (``OWN_SERVER_VARIABLES``: ``OMP_NUM_THREADS=1``, which OpenMP reads when torch
loads): a request that differs from
the suite's environment in those only goes to a zygote of its own, started with those values
(one per distinct set of values, at most ``MAX_SERVERS`` zygotes per test process, counting the
first; a request that would need one more falls back). What differs from a fresh interpreter and is accepted: the hash seed
(shared by the zygote's children), and modules the zygote imported are already in sys.modules
(as after the child's own first import of them).

Only the ``test`` and ``campaign`` tiers use it: starting the server is a child process, which
the fast tier refuses (tests/harness/tiers.py counts run_python/popen_python as spawners).

``TXCKPT_TEST_NO_ZYGOTE=1`` turns it off: every launch is a plain subprocess (to rule the zygote
out when a child behaves oddly).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

SERVER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "children", "zygote_server.py")
#: The environment the zygote starts with: this process's when the suite imported this module
#: (before any test's monkeypatch).
START_ENV = dict(os.environ)
#: Launches that ran as plain subprocesses, and why.
FALLBACKS: list[str] = []
#: Variables the zygote's preloaded imports set themselves, with their values (from its hello):
#: a test process that made the same imports in-process has them too, and that is no difference.
SET_BY_IMPORTS: dict[str, str] = {}

#: Read by the interpreter at start-up or by the preloaded libraries at import: a child whose
#: environment differs from the zygote's in one of these cannot be a fork of it.
_IMPORT_TIME_PREFIXES = (
    "TRANSFORMERS_",
    "HF_",
    "HUGGINGFACE_",
    "ACCELERATE_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NCCL_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "TOKENIZERS_",
    "XDG_",
    "DEEPSPEED",
    "DS_",
    "USE_",
    "PYTHON",
    "LD_",
    "MALLOC_",
)
_IMPORT_TIME_NAMES = frozenset(
    {
        "HOME",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LC_ALL",
        "LC_CTYPE",
        "LANG",
    }
)
#: Handled in the child (tests/children/zygote_server.py) or not read at start-up. The last two
#: match the prefixes but are read when used, not at import (the child's os.environ is the
#: request's): accelerate's is_cuda_available() leaves PYTORCH_NVML_BASED_CUDA_CHECK=1 in a test
#: process that ran a Trainer in-process, and torch's inductor sets TORCHINDUCTOR_CACHE_DIR when
#: imported; a clean-clone `make test` fell back to plain subprocesses for every launch after them.
_HANDLED = frozenset(
    {
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TORCHINDUCTOR_CACHE_DIR",
    }
)
#: Import-time variables whose value, where a request's differs from the suite's, gets a zygote of
#: its own started with that value (instead of a plain subprocess), for a value the suite sets for
#: a group of torch-importing children. None does yet: test_trainer_remote.py's one OMP_NUM_THREADS=1
#: child costs as much through a zygote of its own (22.2 s) as plain (19.6 s). Not PYTHONWARNINGS (the CLI
#: tests'): their children import txckpt.cli only (0.39 s plain, 0.24 s forked), and a zygote of
#: their own costs 7 s to start, what their ~90 launches a worker save (measured: test_cli.py 70.7 s
#: plain, 74.4 s with it).
OWN_SERVER_VARIABLES = frozenset({"OMP_NUM_THREADS"})
#: Zygotes one test process (one pytest-xdist worker) may hold, the default one included: each
#: holds torch and transformers (about 350 MB) and costs one heavy import to start, so a value set
#: by one test only is better a plain subprocess than a server of its own.
MAX_SERVERS = 3


def disabled() -> bool:
    return os.environ.get("TXCKPT_TEST_NO_ZYGOTE", "") not in ("", "0")


def import_time_differences(env: dict[str, str], start: dict[str, str] | None = None) -> list[str]:
    """The variables read at import/start-up in which ``env`` differs from the zygote's."""
    start = START_ENV if start is None else start
    out = []
    for k in sorted(set(env) | set(start)):
        if k in _HANDLED or env.get(k) == start.get(k):
            continue
        if k in SET_BY_IMPORTS and env.get(k) == SET_BY_IMPORTS[k]:
            continue
        if k in _IMPORT_TIME_NAMES or k.startswith(_IMPORT_TIME_PREFIXES):
            out.append(k)
    return out


class _Server:
    def __init__(self, key: tuple[tuple[str, str | None], ...] = ()) -> None:
        #: The OWN_SERVER_VARIABLES values this zygote started with, where they differ from the
        #: suite's (``()``: the default zygote); its environment for import_time_differences.
        self.key = key
        self.start_env = _with(START_ENV, key)
        self.dir = tempfile.mkdtemp(prefix="txckpt-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.log = open(os.path.join(self.dir, "server.log"), "wb")
        # numpy's OpenBLAS starts a worker thread at import unless told otherwise: the zygote must
        # fork with one thread (the children's BLAS then runs on one thread, a cost, not a result).
        env = {"OPENBLAS_NUM_THREADS": "1", **self.start_env}
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=self.dir,
        )
        line = self.proc.stdout.readline()  # once the heavy imports are done
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the zygote did not start (exit {self.proc.returncode}): {self.log_text()}")
        self.hello = json.loads(line)
        SET_BY_IMPORTS.update(self.hello.get("set_by_imports", {}))
        self.proc.stdout.close()
        self.owner = os.getpid()

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the lifeline: the server SIGKILLs its children and exits
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _with(env: dict[str, str], key: tuple[tuple[str, str | None], ...]) -> dict[str, str]:
    out = dict(env)
    for k, v in key:
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_LOCK = threading.Lock()
#: This process's zygotes by key (see _Server.key).
_SERVERS: dict[tuple, _Server] = {}


def server_key(env: dict[str, str]) -> tuple[tuple[str, str | None], ...] | None:
    """The key of the zygote that can fork a child with environment ``env``: ``()`` for the
    default one, the OWN_SERVER_VARIABLES values it differs in for another, None when it differs
    in another import-time variable (a plain subprocess, then)."""
    differs = import_time_differences(env)
    if not set(differs) <= OWN_SERVER_VARIABLES:
        return None
    return tuple((k, env.get(k)) for k in differs)


def server(key: tuple[tuple[str, str | None], ...] = ()) -> _Server | None:
    """This process's zygote for ``key`` (server_key), started on first use (a process forked
    from this one starts its own); None when it is not running and MAX_SERVERS others are (one
    place is kept for the default zygote)."""
    with _LOCK:
        pid = os.getpid()
        for k in [k for k, s in _SERVERS.items() if s.owner != pid or s.proc.poll() is not None]:
            del _SERVERS[k]  # a parent's, or dead
        s = _SERVERS.get(key)
        if s is None:
            if len(set(_SERVERS) | {(), key}) > MAX_SERVERS:
                return None
            s = _SERVERS[key] = _Server(key)
            atexit.register(s.close)
        return s


def _fd_for(spec: Any, default: int, mode: str, opened: list[int]) -> tuple[int, int | None]:
    """(the fd to hand to the child, our end of a pipe or None)."""
    if spec is None:
        return default, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        if mode == "r":
            opened.append(r)
            return r, w
        opened.append(w)
        return w, r
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
        opened.append(fd)
        return fd, None
    if spec == subprocess.STDOUT:
        raise ValueError("stderr=STDOUT: not supported by the zygote")
    return (spec if isinstance(spec, int) else spec.fileno()), None


class ZygoteProcess:
    """A child forked by the zygote: the parts of :class:`subprocess.Popen` the suite uses."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict | None = None,
        cwd: str | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        zygote: _Server | None = None,
    ) -> None:
        self.args = [sys.executable, *map(str, argv)]
        self.returncode: int | None = None
        self._lock = threading.Lock()
        cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        if not os.path.isdir(cwd):
            raise FileNotFoundError(2, "No such file or directory", cwd)
        opened: list[int] = []
        try:
            fin, our_in = _fd_for(stdin, 0, "r", opened)
            fout, our_out = _fd_for(stdout, 1, "w", opened)
            ferr, our_err = _fd_for(stderr, 2, "w", opened)
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server = zygote or server()
            self._conn.connect(self._server.path)
            req = {"argv": list(map(str, argv)), "env": dict(os.environ if env is None else env), "cwd": cwd}
            socket.send_fds(self._conn, [(json.dumps(req) + "\n").encode()], [fin, fout, ferr])
        finally:
            for fd in opened:
                os.close(fd)
        self._buf = b""
        msg = self._read_msg(None)
        if "pid" not in msg:
            raise RuntimeError(f"the zygote refused {self.args}: {msg}")
        self.pid: int = msg["pid"]

        def wrap(fd, mode):
            if fd is None:
                return None
            f = io.open(fd, mode + "b")
            return io.TextIOWrapper(f, encoding="utf-8" if mode == "r" else None) if text else f

        self.stdin = wrap(our_in, "w")
        self.stdout = wrap(our_out, "r")
        self.stderr = wrap(our_err, "r")

    def _read_msg(self, timeout: float | None) -> dict:
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            self._conn.settimeout(None if end is None else max(0.0, end - time.monotonic()))
            try:
                chunk = self._conn.recv(4096)
            except (socket.timeout, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"the zygote went away while {self.args} ran: {self._server.log_text()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                status = self._read_msg(timeout)["status"]
                self.returncode = os.waitstatus_to_exitcode(status)
                self._conn.close()
            return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # once reported, the zygote has reaped it: the pid is not ours
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Like Popen.communicate; on a timeout the output read so far stays for the next call."""
        if not hasattr(self, "_chunks"):
            self._chunks: dict[str, list] = {"stdout": [], "stderr": []}
            self._readers = []
            for name in ("stdout", "stderr"):
                f = getattr(self, name)
                if f is not None:
                    t = threading.Thread(target=self._drain, args=(f, self._chunks[name]), daemon=True)
                    t.start()
                    self._readers.append(t)
            if self.stdin is not None:
                if input:
                    try:
                        self.stdin.write(input)
                    except BrokenPipeError:
                        pass
                try:
                    self.stdin.close()
                except BrokenPipeError:
                    pass
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout, *self._sofar())
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        return self._sofar()

    def _sofar(self) -> tuple[Any, Any]:
        out = []
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is None:
                out.append(None)
            else:
                joined = "".join(self._chunks[name]) if isinstance(f, io.TextIOBase) else b"".join(self._chunks[name])
                out.append(joined)
        return out[0], out[1]

    @staticmethod
    def _drain(f, chunks: list) -> None:
        while True:
            data = f.read(65536)
            if not data:
                break
            chunks.append(data)
        f.close()

    def __enter__(self) -> "ZygoteProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None and not f.closed:
                f.close()
        self.wait()


def _route(argv: Sequence[str], env: dict | None) -> tuple[str | None, _Server | None]:
    """(why this launch must be a plain subprocess, or None; the zygote to fork it)."""
    if disabled():
        return "TXCKPT_TEST_NO_ZYGOTE", None
    env = dict(os.environ if env is None else env)
    if server(()) is None:  # the default zygote first: its hello says what its imports set
        return "no zygote could start", None
    key = server_key(env)
    if key is None:
        return f"{argv[0]}: env differs in {import_time_differences(env)}", None
    zygote = server(key)
    if zygote is None:
        return f"{argv[0]}: {MAX_SERVERS} zygotes run already, none with {dict(key)}", None
    return None, zygote


def popen_python(
    argv: Sequence[str],
    *,
    env: dict | None = None,
    cwd: str | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
) -> Any:
    """``subprocess.Popen([sys.executable, *argv], ...)``, forked by the zygote."""
    why, zygote = _route(argv, env)
    if why:
        FALLBACKS.append(why)
        return subprocess.Popen(
            [sys.executable, *map(str, argv)], env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text
        )
    return ZygoteProcess(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text, zygote=zygote)


def run_python(
    argv: Sequence[str],
    *,
    env: dict | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, forked by
    the zygote."""
    why, zygote = _route(argv, env)
    if why:
        FALLBACKS.append(why)
        return subprocess.run(
            [sys.executable, *map(str, argv)],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
            input=input,
        )
    p = ZygoteProcess(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.PIPE if input is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        zygote=zygote,
    )
    try:
        out, err = p.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
