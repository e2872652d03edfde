"""The zygote: a preloaded fork server for the suite's Python child processes (the server side of
tests/harness/zygote.py, which starts it and documents it).

    python tests/children/zygote_server.py SOCKET_PATH

Imports the heavy third-party modules once (torch, transformers with its Trainer, accelerate,
safetensors, fsspec/s3fs), never txckpt nor a module of tests/, and runs no torch computation (no
intra-op/OpenMP thread pool exists at a fork). Then it serves SOCKET_PATH, one thread, one
connection per child: a request (JSON: argv, env, cwd; the child's fds 0/1/2 attached) is
answered with ``{"pid": N}``, the server forks the child, and when the child ends the server
(its real parent) reaps it and sends ``{"status": WAIT_STATUS}``. The server exits when its stdin
(the lifeline, whose other end the test process holds) reaches EOF, SIGKILLing the children it
still has.

The child behaves like ``python ARGV`` started by subprocess: default signal dispositions (SIGINT
raises KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored), the request's environment only, cwd, argv
and sys.path as that interpreter would compute them, its stdio on the given fds; it runs the
script, ``-m`` module or ``-c`` code as ``__main__`` and exits as an interpreter does (SystemExit
semantics, an uncaught exception prints its traceback and exits 1, then threading._shutdown,
atexit callbacks, stdio flush, ``os._exit``).
"""

import atexit
import builtins
import io
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
import threading
import traceback
import types

HERE = os.path.abspath(__file__)
# What a fresh interpreter's sys.path holds after its script directory and PYTHONPATH.
_BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
_START_ENV = dict(os.environ)

PRELOAD = ("torch", "safetensors.torch", "transformers", "accelerate", "fsspec", "s3fs")


def _preload() -> list[str]:
    import importlib

    loaded = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        loaded.append(name)
    if "transformers" in loaded:
        # transformers resolves its names lazily: these load the Trainer's modules.
        from transformers import (  # noqa: F401
            PreTrainedModel,
            Trainer,
            TrainerCallback,
            TrainingArguments,
        )
    for name in ("txckpt", "tests"):
        assert not any(m == name or m.startswith(name + ".") for m in sys.modules), f"{name} was imported"
    return loaded


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        if not chunk:
            raise EOFError("client closed before its request was complete")
        data += chunk
        fds += got
    return json.loads(data), fds


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall((json.dumps(msg) + "\n").encode())
    except OSError:
        pass  # the client went away; the child is still reaped


def _reset_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets them at start-up
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _stdio(env: dict) -> None:
    """The zygote's own sys.stdin/stdout/stderr objects (libraries imported here may hold them,
    as logging handlers do) now sit on the child's fds 0/1/2: set them up as a fresh interpreter
    would for this environment."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    enc = env.get("PYTHONIOENCODING")
    kw: dict = {}
    if enc:
        name, _, errors = enc.partition(":")
        if name:
            kw["encoding"] = name
        if errors:
            kw["errors"] = errors
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=unbuffered, **kw)
    sys.stderr.reconfigure(
        line_buffering=True, write_through=unbuffered, **({"encoding": kw["encoding"]} if "encoding" in kw else {})
    )
    if "encoding" in kw:
        sys.stdin.reconfigure(**kw)


def _main_code(argv: list[str], cwd: str) -> tuple[types.CodeType | None, str | None, str]:
    """sys.argv[0] handling of ``python ARGV``: the code to run (None for ``-m``), the module
    (for ``-m``), and sys.path[0]."""
    if argv[0] == "-c":
        return compile(argv[1], "<string>", "exec"), None, ""
    if argv[0] == "-m":
        return None, argv[1], cwd
    path = os.path.abspath(argv[0])
    with io.open_code(path) as f:
        source = f.read()
    return compile(source, path, "exec"), None, os.path.dirname(os.path.realpath(path))


def _strip_own_frames(tb):
    while tb is not None and tb.tb_frame.f_code.co_filename == HERE:
        tb = tb.tb_next
    return tb


def _child(req: dict, fds: list[int], close: list) -> None:
    code = 1
    try:
        for c in close:
            try:
                c.close() if hasattr(c, "close") else os.close(c)
            except OSError:
                pass
        _reset_signals()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        env, cwd, argv = req["env"], req["cwd"], list(req["argv"])
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        _stdio(env)
        tempfile.tempdir = None  # recomputed from this environment's TMPDIR
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew
            sys.modules["numpy"].random.seed()
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        try:
            main_code, module, path0 = _main_code(argv, cwd)
        except OSError as e:
            sys.stderr.write(f"{sys.executable}: can't open file {argv[0]!r}: [Errno {e.errno}] {e.strerror}\n")
            sys.stderr.flush()
            os._exit(2)
        sys.path[:] = [path0, *(os.path.abspath(p) for p in pythonpath), *_BASE_PATH]
        sys.argv = ["-c", *argv[2:]] if argv[0] == "-c" else (["-m", *argv[2:]] if module else argv)
        code = _run(main_code, module, argv)
    except BaseException:  # noqa: BLE001 - the zygote's own failure, reported as the child's
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(code)


def _run(main_code, module, argv) -> int:
    interrupted = False
    try:
        if module is not None:
            import runpy

            runpy._run_module_as_main(module, alter_argv=True)  # what ``python -m`` calls
        else:
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            if argv[0] != "-c":
                main.__file__ = main_code.co_filename
            sys.modules["__main__"] = main
            exec(main_code, main.__dict__)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with it
        interrupted = isinstance(e, KeyboardInterrupt)
        tb = _strip_own_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    try:
        threading._shutdown()  # joins the non-daemon threads
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001
            if f is sys.stdout and code == 0:
                code = 120  # as Py_FinalizeEx does when stdout cannot be flushed
    if interrupted:  # an uncaught KeyboardInterrupt: the interpreter dies by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(e: SystemExit) -> int:
    c = e.code
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    try:
        sys.stderr.write(f"{c}\n")
    except Exception:  # noqa: BLE001
        pass
    return 1


def serve(path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the test process's; the lifeline ends us
    before = dict(os.environ)
    loaded = _preload()
    # What the preloaded imports set themselves (torch's inductor: TORCHINDUCTOR_CACHE_DIR): the
    # test process has the same values once it imported them too, and that is no difference.
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(0, selectors.EVENT_READ, "lifeline")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    sys.path[:] = _BASE_PATH  # tests/children/ is not for the children
    print(
        json.dumps({"pid": os.getpid(), "threads": _threads(), "preloaded": loaded, "set_by_imports": set_by_imports}),
        flush=True,
    )
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline":
                if not os.read(0, 4096):
                    for pid, _conn in children.values():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os._exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    conn.settimeout(30)
                    req, fds = _recv_request(conn)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, [listener, conn, sel, *(c for _, c in children.values()), *children])
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                _send(conn, {"pid": pid})
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                _send(conn, {"status": status})
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
