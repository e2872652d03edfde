"""What txckpt reports while it moves data: phase records at DEBUG, one summary at INFO, and
the CLI's progress bars on a terminal (docs/protocol.md §8, "Reporting")."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import txckpt

from tests.harness.zygote import popen_python, run_python

MiB = 1 << 20


def _records(caplog, op: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "txckpt" and getattr(r, "txckpt_op", None) == op]


def test_a_64_mib_s3_save_logs_its_phases_at_debug_and_one_summary_at_info(s3_root, caplog):
    url, opts = s3_root
    tensors = {"w": torch.arange(16 * MiB, dtype=torch.float32)}  # 64 MiB
    caplog.set_level(logging.DEBUG, logger="txckpt")
    path = txckpt.save_checkpoint(url, 7, {"model.safetensors": tensors, "meta.json": {"a": 1}}, storage_options=opts)
    records = _records(caplog, "save")
    phases = [r.txckpt_phase for r in records]
    assert phases == ["staging", "data", "manifest", "commit", "publish", "done"]
    assert all(r.levelno == logging.DEBUG for r in records[:-1])
    data = records[1]
    assert data.txckpt_bytes >= 64 * MiB and "MiB/s" in data.getMessage()
    summary = records[-1]
    assert summary.levelno == logging.INFO
    total = txckpt.read_manifest(path, storage_options=opts).total_bytes
    assert summary.txckpt_bytes == total and summary.txckpt_files == 2
    message = summary.getMessage()
    assert message.startswith("saved step 7: 2 files, 64.0 MiB") and f"({total} bytes)" in message
    assert "MiB/s" in message and message.endswith(path)
    assert summary.txckpt_seconds >= sum(r.txckpt_seconds for r in records[:-1]) - 1e-6
    # The logger's name says "txckpt": no message repeats it.
    assert not any(r.getMessage().startswith("txckpt:") for r in records)


def test_load_and_fetch_log_their_phases_and_one_summary_each(tmp_path, caplog):
    root = str(tmp_path / "out")
    path = txckpt.save_checkpoint(root, 3, {"a.bin": b"x" * MiB, "b.json": [1, 2]})
    caplog.set_level(logging.DEBUG, logger="txckpt")
    caplog.clear()
    txckpt.load_checkpoint(path)
    records = _records(caplog, "load")
    assert [r.txckpt_phase for r in records] == ["manifest", "data", "decode", "done"]
    assert records[-1].levelno == logging.INFO and records[-1].txckpt_bytes == txckpt.read_manifest(path).total_bytes
    assert records[-1].getMessage().startswith("loaded step 3: 2 files, 1.0 MiB")

    caplog.clear()
    dest = str(tmp_path / "cache" / "c3")
    txckpt.fetch_checkpoint(path, dest)
    records = _records(caplog, "fetch")
    assert [r.txckpt_phase for r in records] == ["manifest", "data", "install", "done"]
    assert records[-1].levelno == logging.INFO and records[-1].getMessage().endswith(dest)
    caplog.clear()
    txckpt.fetch_checkpoint(path, dest)  # the cached copy, verified, no download
    assert [r.txckpt_phase for r in _records(caplog, "fetch")] == ["manifest", "cached", "done"]


def test_at_info_a_save_is_one_record_and_at_warning_none(tmp_path, caplog):
    root = str(tmp_path / "out")
    caplog.set_level(logging.INFO, logger="txckpt")
    txckpt.save_checkpoint(root, 1, {"a.bin": b"abc"})
    assert [r.txckpt_phase for r in _records(caplog, "save")] == ["done"]
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="txckpt")
    txckpt.save_checkpoint(root, 2, {"a.bin": b"abc"})
    assert _records(caplog, "save") == []


_TRAIN = r"""
import sys
sys.path.insert(0, {repo!r})
import torch
from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args
from txckpt.integrations.transformers import TransactionalTrainer
torch.manual_seed(0)
args = make_args(sys.argv[1], 2, **({{"log_level": sys.argv[2]}} if sys.argv[2] != "default" else {{}}))
TransactionalTrainer(model=TinyModel(TinyConfig()), args=args, train_dataset=Data(0)).train()
"""


@pytest.mark.trainer
@pytest.mark.parametrize("log_level", ["info", "default"])
def test_a_trainer_save_logs_at_transformers_verbosity(tmp_path, log_level):
    """A Trainer script configures no logging: txckpt's summary shows through transformers'
    handler exactly when transformers logs at INFO (the Trainer's ``log_level``)."""
    pytest.importorskip("transformers")

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = run_python(["-c", _TRAIN.format(repo=repo), str(tmp_path / "out"), log_level], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = [line for line in out.stderr.splitlines() if "saved step 2: " in line]
    if log_level == "info":
        assert len(saved) == 1 and "bytes) in" in saved[0], out.stderr[-3000:]
        assert "save step 2: staging" not in out.stderr  # DEBUG phases stay below INFO
    else:
        assert saved == [], saved


def _cli_on_a_terminal(*argv: str, columns: int = 120) -> tuple[int, str]:
    """Run ``python -m txckpt ARGV`` with stderr on a pseudo-terminal ``columns`` wide (0: a
    terminal that reports no size, as some ``docker exec -t`` and CI ptys do); returns (rc, stderr)."""
    import pty
    import subprocess

    master, slave = pty.openpty()
    if columns:
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = popen_python(["-m", "txckpt", *argv], stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


@pytest.fixture
def two_mib_root(tmp_path):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, {"a.bin": b"a" * MiB, "b.bin": b"b" * MiB})
    return root


def test_verify_and_export_show_a_bar_on_a_terminal_that_stays_on_screen(two_mib_root, tmp_path):
    rc, err = _cli_on_a_terminal("verify", two_mib_root)
    assert rc == 0 and "verify: 100%" in err and "2.10M/2.10M" in err, err
    rc, err = _cli_on_a_terminal("export", two_mib_root, str(tmp_path / "copy"), "--step", "1")
    assert rc == 0 and "export: 100%" in err and "2.10M/2.10M" in err, err


def test_a_terminal_that_reports_no_size_still_gets_a_bar(two_mib_root):
    rc, err = _cli_on_a_terminal("verify", two_mib_root, columns=0)
    assert rc == 0 and "verify: 100%" in err and "2.10M/2.10M" in err, err


def test_no_progress_json_and_a_pipe_show_no_bar(two_mib_root, tmp_path):
    for argv in (
        ["verify", two_mib_root, "--no-progress"],
        ["verify", two_mib_root, "--json"],
        ["export", two_mib_root, str(tmp_path / "c1"), "--step", "1", "--no-progress"],
        ["gc", two_mib_root, "--no-progress"],
    ):
        rc, err = _cli_on_a_terminal(*argv)
        assert rc == 0 and "%|" not in err and "B/s]" not in err, (argv, err)
    piped = run_python(["-m", "txckpt", "verify", two_mib_root], timeout=120)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


def test_adopt_and_gc_bars_count_the_bytes_they_move(tmp_path):
    root = tmp_path / "legacy"
    (root / "checkpoint-5").mkdir(parents=True)
    (root / "checkpoint-5" / "model.bin").write_bytes(b"m" * (3 * MiB))
    rc, err = _cli_on_a_terminal("adopt", str(root))
    assert rc == 0 and "adopt: 3.15MB [" in err, err
    # The adoption's warning is written above the bar, not into its line.
    assert "\radopt: 0.00B [00:00, ?B/s]txckpt" not in err and "adopted 1 checkpoint(s)" in err, err
    # A dead writer's staging (its intent names a pid that does not run) is gc's to reclaim.
    staged = root / ".txckpt" / "tx" / "9-deadbeef-0000000000" / "checkpoint-9"
    staged.mkdir(parents=True)
    (staged / "w.bin").write_bytes(b"w" * (2 * MiB))
    rc, err = _cli_on_a_terminal("gc", str(root), "--grace", "0")
    assert rc == 0 and "gc: 2.10MB [" in err, err


def log_a_save(rank: int, world: int, *, root: str, step: int) -> list[list]:
    """A rank of a 2-process save: the (phase, level, bytes) of every txckpt record it logged."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    logger = logging.getLogger("txckpt")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    txckpt.save_checkpoint(root, step, {f"rank{rank}.bin": bytes([rank]) * ((rank + 1) * MiB)})
    return [[r.txckpt_phase, r.levelname, r.txckpt_bytes] for r in seen if getattr(r, "txckpt_op", "") == "save"]


def test_in_a_process_group_the_summary_is_logged_once_by_rank_0_with_every_ranks_bytes(tmp_path):
    from tests.harness import launcher

    root = str(tmp_path / "out")
    run = launcher.launch(2, log_a_save, str(tmp_path / "res"), root=root, step=4)
    assert all(r.error is None and not r.hung for r in run.results), [(r.error, r.trace) for r in run.results]
    by_rank = {r.rank: r.ok for r in run.results}
    total = txckpt.read_manifest(os.path.join(root, "checkpoint-4")).total_bytes
    assert total == 3 * MiB
    assert by_rank[0] == [
        ["staging", "DEBUG", None],
        ["data (rank 0)", "DEBUG", MiB],
        ["manifest", "DEBUG", None],
        ["commit", "DEBUG", None],
        ["publish", "DEBUG", None],
        ["done", "INFO", total],
    ]
    assert by_rank[1] == [["staging", "DEBUG", None], ["data (rank 1)", "DEBUG", 2 * MiB]]


def test_following_transformers_verbosity_leaves_a_level_the_application_set_alone():
    from transformers.utils import logging as hf_logging

    from txckpt.integrations._trainer.verbosity import follow_transformers_verbosity

    logger = logging.getLogger("txckpt")
    before_level, before_handlers = logger.level, list(logger.handlers)
    before_verbosity = hf_logging.get_verbosity()
    try:
        logger.setLevel(logging.NOTSET)
        hf_logging.set_verbosity_info()
        follow_transformers_verbosity()
        assert logger.level == logging.INFO
        hf_logging.set_verbosity_debug()
        follow_transformers_verbosity()  # follows transformers while it is the one setting it
        assert logger.level == logging.DEBUG
        logger.setLevel(logging.ERROR)  # the application's choice wins from now on
        hf_logging.set_verbosity_info()
        follow_transformers_verbosity()
        assert logger.level == logging.ERROR
    finally:
        hf_logging.set_verbosity(before_verbosity)
        logger.setLevel(before_level)
        logger.handlers[:] = before_handlers


_RESUME = r"""
import sys
sys.path.insert(0, {repo!r})
import torch
from tests.harness.tiny import Data, TinyConfig, TinyModel, make_args
from txckpt.integrations.transformers import TransactionalTrainer
torch.manual_seed(0)
out, steps, resume, level = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
resume = {{"none": None, "true": True}}.get(resume, resume)
args = make_args(out, steps, **({{"log_level": level}} if level != "default" else {{}}))
TransactionalTrainer(model=TinyModel(TinyConfig()), args=args, train_dataset=Data(0)).train(resume_from_checkpoint=resume)
"""


@pytest.mark.trainer
def test_txckpt_lines_in_trainer_output_carry_level_and_origin_and_a_resume_shows_by_default(tmp_path):
    """In a Trainer script that configures no logging: the rollback warning is labelled with its
    level and txckpt as its origin (as transformers labels its own lines), and a plain resume
    prints one INFO line at the default verbosity (the Trainer's ``log_level`` "passive"),
    which an explicit quieter ``log_level`` hides."""
    pytest.importorskip("transformers")

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"

    def run(steps, resume, level="default"):
        p = run_python(["-c", _RESUME.format(repo=repo), str(out), str(steps), resume, level], timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stderr.splitlines()

    run(4, "none")
    # An older checkpoint: a fork, whose warning shows at any verbosity up to WARNING.
    lines = run(2, str(out / "checkpoint-2"), level="warning")
    rollback = [line for line in lines if "rolling back to step 2" in line]
    assert len(rollback) == 1 and rollback[0].startswith("[txckpt] WARNING: "), lines
    assert not [line for line in lines if "resuming" in line], lines  # log_level="warning": INFO hidden
    # A plain restart: one line, at the default verbosity, saying what it continues from.
    txckpt.forget_roots()
    newest = txckpt.get_last_checkpoint(str(out))
    m = txckpt.read_manifest(newest)
    lines = run(m.step, "true")
    resumed = [line for line in lines if "resuming" in line]
    assert resumed == [f"[txckpt] INFO: resuming from step {m.step} of lineage {m.lineage}: {newest}"], lines
