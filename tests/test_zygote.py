"""The zygote (tests/harness/zygote.py): children forked from a preloaded server behave as
``subprocess.run([sys.executable, ...])`` children do: exit codes, signals, atexit, threads,
environment, timeouts, and a fresh txckpt in each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.harness import zygote

pytestmark = pytest.mark.skipif(zygote.disabled(), reason="TXCKPT_TEST_NO_ZYGOTE is set")


def _c(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return zygote.run_python(["-c", code, *args], timeout=60, **kw)


def test_the_server_forks_with_one_thread_and_without_txckpt():
    hello = zygote.server().hello
    assert hello["threads"] == 1, hello
    assert {"torch", "transformers"} <= set(hello["preloaded"]), hello
    p = _c("import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('txckpt', 'tests')))")
    assert (p.returncode, p.stdout) == (0, "[]\n"), p.stderr
    p = _c("import sys; print('transformers.trainer' in sys.modules, 'torch' in sys.modules)")
    assert p.stdout == "True True\n", p.stderr


@pytest.mark.parametrize(
    "code, rc",
    [
        ("pass", 0),
        ("import sys; sys.exit(3)", 3),
        ("raise SystemExit", 0),
        ("import sys; sys.exit('no good')", 1),
        ("import os; os._exit(7)", 7),
    ],
)
def test_exit_codes(code, rc):
    p = _c(code)
    assert p.returncode == rc, p.stderr
    if rc == 1:
        assert p.stderr == "no good\n"


def test_an_uncaught_exception_prints_its_traceback_and_exits_1():
    p = _c("def f():\n    raise ValueError('boom')\nf()")
    assert p.returncode == 1
    assert p.stderr.startswith('Traceback (most recent call last):\n  File "<string>", line 3, in <module>\n'), p.stderr
    assert p.stderr.endswith("ValueError: boom\n"), p.stderr
    assert "zygote" not in p.stderr, p.stderr  # the server's own frames are not the child's


def test_an_uncaught_keyboard_interrupt_dies_by_sigint():
    assert _c("raise KeyboardInterrupt").returncode == -signal.SIGINT


def test_atexit_runs_on_a_normal_exit_and_not_on_sigkill():
    reg = "import atexit, os, signal, sys; atexit.register(lambda: print('atexit ran', flush=True)); "
    assert _c(reg + "print('main')").stdout == "main\natexit ran\n"
    assert _c(reg + "sys.exit(4)").returncode == 4 and _c(reg + "sys.exit(4)").stdout == "atexit ran\n"
    p = _c(reg + "print('main', flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    assert (p.returncode, p.stdout) == (-signal.SIGKILL, "main\n")


def test_a_non_daemon_thread_is_joined_before_exit():
    p = _c(
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "print('main done')"
    )
    assert (p.returncode, p.stdout) == (0, "main done\nthread done\natexit\n"), p.stderr


def test_the_environment_is_the_requested_one_only(monkeypatch):
    monkeypatch.setenv("TXCKPT_ZYGOTE_PARENT_ONLY", "1")
    env = {k: v for k, v in os.environ.items() if k != "TXCKPT_ZYGOTE_PARENT_ONLY"}
    env["TXCKPT_ZYGOTE_CHILD"] = "yes"
    p = _c(
        "import os; print(os.environ.get('TXCKPT_ZYGOTE_PARENT_ONLY'), os.environ['TXCKPT_ZYGOTE_CHILD'],"
        " 'TXCKPT_ZYGOTE_PARENT_ONLY' in open('/proc/self/environ').read())",
        env=env,
    )
    assert p.stdout == "None yes False\n", p.stderr
    assert _c("import os; print(os.environ['TXCKPT_ZYGOTE_PARENT_ONLY'])").stdout == "1\n"  # env=None: ours


def test_argv_cwd_and_sys_path_are_a_fresh_interpreters(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, sys\nprint(sys.argv, __name__, __file__, sys.path[0], os.getcwd())\n")
    p = zygote.run_python([str(script), "x", "y"], cwd=str(tmp_path), timeout=60)
    expect = subprocess.run([sys.executable, str(script), "x", "y"], cwd=str(tmp_path), capture_output=True, text=True)
    assert (p.returncode, p.stdout) == (0, expect.stdout), p.stderr
    p = zygote.run_python(["-m", "json.tool", "--help"], timeout=60)
    assert p.returncode == 0 and "json.tool" in p.stdout, p.stderr
    p = zygote.run_python([str(tmp_path / "missing.py")], timeout=60)
    assert p.returncode == 2 and "can't open file" in p.stderr


def test_a_timeout_kills_the_child_and_raises(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        zygote.run_python(
            [
                "-c",
                f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                "print('up', flush=True); time.sleep(600)",
            ],
            timeout=3,
        )
    assert e.value.output == "up\n"
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pid_file.read_text()), 0)


def test_popen_handle_signals_poll_and_pipes():
    p = zygote.popen_python(
        ["-c", "import sys, time; print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline() == "ready\n"
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM and p.returncode == -signal.SIGTERM
    p.stdout.close()
    q = zygote.popen_python(
        ["-c", "import sys; sys.stdout.write(sys.stdin.read().upper())"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert q.communicate("abc", timeout=60) == ("ABC", "") and q.returncode == 0


def test_each_child_imports_txckpt_afresh():
    mutate = "import txckpt._base.naming as n; print(n.__dict__.setdefault('_zygote_probe', 0)); n._zygote_probe = 1"
    assert _c(mutate).stdout == "0\n"
    assert _c(mutate).stdout == "0\n"  # the first child's change died with it


def test_concurrent_requests_from_threads():
    out: dict[int, subprocess.CompletedProcess] = {}

    def one(i: int) -> None:
        out[i] = _c("import sys, time; time.sleep(0.5); sys.exit(int(sys.argv[1]))", str(i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: p.returncode for i, p in out.items()} == {i: i for i in range(6)}


@pytest.mark.process  # zygote.server() starts the zygote when no test before it did
def test_what_the_preloaded_imports_set_is_no_difference(monkeypatch):
    """A variable the zygote's own imports set (its hello lists them) is no difference at that
    value, and still one at another."""
    assert zygote.server().hello["set_by_imports"].items() <= zygote.SET_BY_IMPORTS.items()
    monkeypatch.setitem(zygote.SET_BY_IMPORTS, "TORCH_SET_BY_AN_IMPORT", "1")
    assert zygote.import_time_differences({**zygote.START_ENV, "TORCH_SET_BY_AN_IMPORT": "1"}) == []
    assert zygote.import_time_differences({**zygote.START_ENV, "TORCH_SET_BY_AN_IMPORT": "2"}) == [
        "TORCH_SET_BY_AN_IMPORT"
    ]


def test_a_test_process_that_ran_a_trainer_in_process_still_forks_from_the_zygote(monkeypatch):
    """What in-process Trainer tests leave in the test process's environment (read when used,
    not at import) keeps its children forks of the zygote."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_elsewhere")
    assert int(_c("import os; print(os.getppid())").stdout) == zygote.server().proc.pid


def test_an_import_time_variable_or_the_switch_falls_back_to_a_plain_subprocess(monkeypatch):
    assert zygote.import_time_differences({**zygote.START_ENV, "TXCKPT_X": "1", "PYTHONUNBUFFERED": "1"}) == []
    assert zygote.import_time_differences({**zygote.START_ENV, "HF_HUB_OFFLINE": "0"}) == ["HF_HUB_OFFLINE"]
    before = len(zygote.FALLBACKS)
    p = _c("import os; print(os.getppid())", env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert int(p.stdout) == os.getpid() and len(zygote.FALLBACKS) == before + 1
    monkeypatch.setenv("TXCKPT_TEST_NO_ZYGOTE", "1")
    assert int(_c("import os; print(os.getppid())").stdout) == os.getpid()
    monkeypatch.delenv("TXCKPT_TEST_NO_ZYGOTE")
    assert int(_c("import os; print(os.getppid())").stdout) == zygote.server().proc.pid


def test_an_own_server_variable_gets_a_zygote_started_with_its_value(monkeypatch):
    """OMP_NUM_THREADS=1 (read by OpenMP when torch loads) is not a fallback but a zygote of its
    own, started with it: its children see what a fresh interpreter with it sees. A third
    distinct value with MAX_SERVERS zygotes running falls back."""
    probe = "import os, torch; print(os.getppid(), torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fresh = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    before = len(zygote.FALLBACKS)
    p = _c(probe, env=env)
    assert p.returncode == 0, p.stderr
    ppid, threads, omp = p.stdout.split()
    own = zygote.server((("OMP_NUM_THREADS", "1"),))
    assert int(ppid) == own.proc.pid != zygote.server().proc.pid
    assert (threads, omp) == tuple(fresh.stdout.split()[1:]) == ("1", "1")
    assert len(zygote.FALLBACKS) == before
    monkeypatch.setattr(zygote, "MAX_SERVERS", 2)
    p = _c("import os; print(os.getppid())", env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert int(p.stdout) == os.getpid() and len(zygote.FALLBACKS) == before + 1
    assert "2 zygotes run already" in zygote.FALLBACKS[-1]
