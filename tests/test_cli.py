"""The `txckpt` command, through the real console script (and `python -m txckpt`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

import txckpt
from tests.harness.fs import tree
from txckpt import cli

TXCKPT = os.path.join(os.path.dirname(sys.executable), "txckpt")
ENV = {**os.environ, "TXCKPT_DURABLE": "0", "PYTHONWARNINGS": "ignore"}
# The children here stay plain subprocesses, not forks of the zygote (tests/harness/zygote.py):
# PYTHONWARNINGS is read at interpreter start-up, so they would need a zygote of their own (7 s
# to start), and a CLI child imports txckpt.cli only, no torch: 0.39 s plain, 0.24 s forked.
# Measured: this file took 70.7 s plain and 74.4 s through the zygote.


def run(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """Run the installed console script; assert its exit code unless check is None."""
    env = {**os.environ, "TXCKPT_DURABLE": "0", "PYTHONWARNINGS": "ignore"}  # now: S3 fixtures set creds
    p = subprocess.run([TXCKPT, *args], capture_output=True, text=True, env=env, timeout=120)
    if check is not None:
        assert p.returncode == check, f"txckpt {' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def save_steps(root: str, steps, tag: str = "a") -> None:
    for s in steps:
        txckpt.save_checkpoint(
            root, s, {"weights.bin": f"{tag}{s}".encode() * 50, "state.json": {"step": s, "tag": tag}}
        )


@pytest.fixture
def rolled(tmp_path, monkeypatch):
    """A root with a rollback: lineage A saved 2, 4, 6; resume(step=2) forked B, which saved 4."""
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, (2, 4, 6), "a")
    txckpt.forget_roots()
    txckpt.resume(root, step=2)
    save_steps(root, (4,), "b")
    txckpt.forget_roots()
    history = txckpt.CheckpointRoot(root).history()
    b = history.state.head
    (a,) = [lid for lid in history.state.lineages if lid != b]
    return root, a, b


def crash_save(root: str, step: int) -> None:
    """A child process starts a transaction, writes a file and SIGKILLs itself before commit."""
    code = textwrap.dedent(f"""
        import os, signal, txckpt
        with txckpt.transaction({root!r}, {step}) as tx:
            tx.save("weights.bin", b"partial" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr


# ----- log ---------------------------------------------------------------------------------------
def test_log_shows_both_lineages_fork_point_and_abandoned(rolled):
    root, a, b = rolled
    out = run("log", root).stdout
    lines = out.splitlines()
    # HEAD is lineage b, marked with its parent lineage and fork step.
    head_line = next(l for l in lines if "HEAD -> lineage" in l)
    assert f"HEAD -> lineage {b}, forked from {a} at step 2" in head_line
    assert "step 4" in head_line and "current" in head_line and "checkpoint-4" in head_line
    # Lineage a's checkpoints 4 and 6 are drawn on a branch of their own, marked abandoned.
    abandoned = [l for l in lines if "abandoned" in l and l.startswith("| *")]
    assert len(abandoned) == 2, out
    assert any("step 6" in l and a in l for l in abandoned) and any("step 4" in l and a in l for l in abandoned)
    assert all(".txckpt/tx/" in l for l in abandoned)  # kept intact at their homes
    # The branch joins the trunk at the fork point, step 2 of lineage a.
    joint = lines.index("|/")
    fork = lines[joint + 1]
    assert fork.startswith("*") and "step 2" in fork and a in fork and f"fork point of {b}" in fork
    # The legend lists both lineages, the head, and the abandoned steps.
    legend = lines[lines.index("lineages:") + 1 :]
    assert any(l.split()[0] == b and "HEAD" in l and "steps: 4" in l for l in legend)
    assert any(l.split()[0] == a and "steps: 2, 4*, 6*" in l for l in legend)


def test_log_json_and_python_m(rolled):
    root, a, b = rolled
    p = subprocess.run(
        [sys.executable, "-m", "txckpt", "log", root, "--json"], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["head"] == b
    lineages = {l["id"]: l for l in data["lineages"]}
    assert lineages[b]["head"] and lineages[b]["parent_lineage"] == a and lineages[b]["fork_step"] == 2
    assert lineages[a]["abandoned_steps"] == [4, 6] and lineages[a]["steps"] == [2, 4, 6]
    states = {(n["lineage"], n["step"]): n["state"] for n in data["nodes"]}
    assert states == {(b, 4): "current", (a, 6): "abandoned", (a, 4): "abandoned", (a, 2): "current"}
    assert "|/" in data["graph"]


def test_log_head_without_checkpoints_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, (1, 2, 3))
    txckpt.forget_roots()
    txckpt.resume(root, step=1)
    out = run("log", root).stdout.splitlines()
    assert "no checkpoints of its own yet" in out[0] and out[0].startswith("*")
    assert any("step 1" in l and "fork point of" in l for l in out)
    assert sum("abandoned" in l for l in out if "step" in l) == 2


def test_log_max_count_on_300_saves_prints_a_screenful(tmp_path, monkeypatch):
    """-n 5 prints 5 checkpoints, a legend with the step list abbreviated, and how many it left
    out; without -n every checkpoint is drawn, the legend still one line per lineage."""
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, range(10, 3001, 10))
    txckpt.forget_roots()
    out = run("log", root, "-n", "5").stdout.splitlines()
    assert len(out) <= 15, out
    assert [l.split()[2] for l in out if l.startswith("*")] == ["3000", "2990", "2980", "2970", "2960"]
    (legend,) = [l for l in out if "steps:" in l]
    assert "steps: 10, 20, 30, ..., 2980, 2990, 3000 (300 checkpoints)" in legend and len(legend) < 160
    assert "295 older checkpoint(s) not shown (-n 5)" in out[-1]
    full = run("log", root, "--max-count", "300").stdout.splitlines()
    assert sum(l.startswith("*") for l in full) == 300 and "not shown" not in full[-1]
    assert sum("steps:" in l for l in full) == 1 and len(max(full, key=len)) < 160
    data = json.loads(run("log", root, "-n", "3", "--json").stdout)
    assert [n["step"] for n in data["nodes"]] == [3000, 2990, 2980] and data["omitted"] == 297
    assert run("log", root, "-n", "0", check=2).returncode == 2


def test_log_unrelated_lineages_get_their_own_lanes(tmp_path, monkeypatch):
    """train() without resume_from_checkpoint on a used output_dir starts a new root lineage;
    it must not be drawn in the lane of the old lineage, as if it were the old tip's child."""
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, (1, 2, 3), "a")
    txckpt.forget_roots()
    txckpt.new_lineage(root)
    out = run("log", root).stdout.splitlines()
    # The new head, before its first save, has no parent: the old lineage starts a lane of its own.
    assert out[0].startswith("*") and "no checkpoints of its own yet" in out[0]
    old = [l for l in out if l.lstrip().startswith("*") and "step" in l]
    assert len(old) == 3 and all(l.startswith("  *") for l in old), out
    save_steps(root, (1, 2), "b")
    txckpt.forget_roots()
    out = run("log", root).stdout.splitlines()
    nodes = [l for l in out if "step" in l and not l.startswith("  ")]
    new = [l for l in nodes if l.startswith("*")]
    assert len(new) == 2 and "HEAD -> lineage" in new[0] and "root lineage" in new[0]
    old = [l for l in out if l.startswith("  *")]
    assert len(old) == 3 and "abandoned" in old[0] and "root lineage" in old[0], out
    assert not any(l.strip() in ("|/", "|") for l in out)  # nothing joins the two histories


def test_log_rollback_keeps_lanes_joined(rolled):
    """A fork still joins its parent's lane at the fork point (the lanes above are unchanged)."""
    root, a, b = rolled
    out = run("log", root).stdout.splitlines()
    assert [l[:3] for l in out[:5]] == ["*  ", "| *", "| *", "|/", "*  "]


def _dot_parts(text: str):
    import re

    nodes = dict(re.findall(r'^\s+(n\d+) \[label="([^"]*)"', text, re.M))
    styles = dict(re.findall(r'^\s+(n\d+) \[label="[^"]*", style="(\w+)"', text, re.M))
    edges = re.findall(r"^\s+(\w+) -> (n\d+)(?: \[([^\]]*)\])?;", text, re.M)
    clusters = re.findall(r'subgraph (cluster_\d+) \{\n\s+label="([^"]*)"', text)
    return nodes, styles, edges, clusters


def test_log_format_dot_draws_steps_forks_abandoned_and_retired(rolled):
    root, a, b = rolled
    save_steps(root, (6, 8), "b")
    txckpt.forget_roots()
    run("gc", root, "--keep-last", "1")  # retires b's 4 and 6
    text = run("log", root, "--format", "dot", "--all").stdout
    assert text.startswith("digraph txckpt {") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    nodes, styles, edges, clusters = _dot_parts(text)
    label = {v.replace("\\n", " "): k for k, v in nodes.items()}
    assert sorted(label) == sorted(
        [
            "step 8 current",
            "step 6 retired",
            "step 4 retired",
            "step 6 abandoned",
            "step 4 abandoned",
            "step 2 current fork point",
        ]
    )
    assert {styles[label["step 6 abandoned"]], styles[label["step 4 abandoned"]]} == {"dashed"}
    assert styles[label["step 6 retired"]] == "dotted" and styles[label["step 8 current"]] == "filled"
    assert sorted(c[1].split("\\n")[0] for c in clusters) == sorted([f"lineage {b} (HEAD)", f"lineage {a}"])
    by_pair = {(x, y): attrs for x, y, attrs in edges}
    fork = label["step 2 current fork point"]
    assert "fork" in by_pair[(fork, label["step 4 retired"])]  # b forked at a's step 2
    assert (fork, label["step 4 abandoned"]) in by_pair  # a's own chain goes on, abandoned
    assert (label["step 6 retired"], label["step 8 current"]) in by_pair
    assert ("HEAD", label["step 8 current"]) in by_pair
    # Without --all the retired ones are left out and the chain skips over them.
    nodes, styles, edges, clusters = _dot_parts(run("log", root, "--format", "dot").stdout)
    label = {v.replace("\\n", " "): k for k, v in nodes.items()}
    assert not any("retired" in k for k in label)
    assert (
        label["step 2 current fork point"],
        label["step 8 current"],
        'label="fork", style="bold", color="#1f5f99"',
    ) in edges
    assert run("log", root, "--format", "dot", "--json", check=2).returncode == 2
    if shutil.which("dot"):  # render it when Graphviz is installed (the test needs no Graphviz)
        p = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "<svg" in p.stdout and not p.stderr, p.stderr


def _run_into_pipe(args, *, read_first: int) -> subprocess.CompletedProcess:
    """Run the console script with stdout a real pipe whose reader closes early: before the
    command starts (``| true``) when read_first is 0, else after reading that many bytes
    (``| head``). The pipe holds 4 KiB, less than the output, so the writer is still writing
    when the reader goes: it must meet the closed pipe, whatever the timing."""
    import fcntl

    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ
    if not read_first:
        os.close(r)
    p = subprocess.Popen([TXCKPT, *args], stdout=w, stderr=subprocess.PIPE, text=True, env=ENV)
    os.close(w)
    if read_first:
        got = b""
        while len(got) < read_first:
            chunk = os.read(r, read_first - len(got))
            assert chunk, "the command wrote less than expected"
            got += chunk
        os.close(r)
    err = p.stderr.read()
    return subprocess.CompletedProcess(p.args, p.wait(timeout=120), None, err)


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(tmp_path, monkeypatch):
    """`txckpt log ROOT | true` and `| head` exit 0 with nothing on stderr (was: a
    BrokenPipeError message and exit 1)."""
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, range(1, 201))
    txckpt.forget_roots()
    assert len(run("log", root).stdout) > 2 * 4096 and len(run("ls", root, "--all").stdout) > 2 * 4096
    for args in (["log", root], ["ls", root, "--all"], ["log", root, "--format", "dot"]):
        for read_first in (0, 100):
            p = _run_into_pipe(args, read_first=read_first)
            assert (p.returncode, p.stderr) == (0, ""), (args, read_first, p.stderr)


# ----- ls / show ---------------------------------------------------------------------------------
def test_ls_states_and_staged_leftover(rolled):
    root, a, b = rolled
    crash_save(root, 6)
    rows = json.loads(run("ls", root, "--json").stdout)
    got = sorted((r["step"], r["lineage"], r["state"]) for r in rows)
    assert got == sorted(
        [(2, a, "current"), (4, a, "abandoned"), (4, b, "current"), (6, a, "abandoned"), (6, b, "staged-leftover")]
    )
    text = run("ls", root).stdout
    assert text.splitlines()[0].split() == ["STEP", "LINEAGE", "SIZE", "TIME", "STATE", "PATH"]
    assert "staged-leftover" in text and "checkpoint-4" in text
    current = json.loads(run("ls", root, "--lineage", "current", "--json").stdout)
    assert [(r["step"], r["lineage"]) for r in current] == [(2, a), (4, b)]


def test_ls_unknown_lineage_exits_1_naming_the_known_ones(rolled):
    """A typo in --lineage used to print "no checkpoints" and exit 0."""
    root, a, b = rolled
    p = run("ls", root, "--lineage", "nosuch", check=1)
    assert p.stdout == "" and "LineageNotFoundError" in p.stderr and "'nosuch'" in p.stderr
    assert f"{b} (HEAD), {a}" in p.stderr
    assert [r["lineage"] for r in json.loads(run("ls", root, "--lineage", a, "--json").stdout)] == [a, a, a]
    with pytest.raises(txckpt.errors.LineageNotFoundError) as e:
        txckpt.CheckpointRoot(root).checkpoints("nosuch")
    assert e.value.lineage == "nosuch" and e.value.known == [b, a]
    assert isinstance(e.value, txckpt.errors.CheckpointNotFoundError)


def test_show_manifest(rolled):
    root, a, b = rolled
    out = run("show", os.path.join(root, "checkpoint-4")).stdout
    assert "step        4" in out and f"lineage     {b}" in out and "state       current (HEAD tip)" in out
    assert f"step 2 of lineage {a}" in out and "weights.bin" in out and "state.json" in out
    data = json.loads(run("show", root, "--step", "2", "--json").stdout)
    assert data["step"] == 2 and data["lineage"] == a and set(data["files"]) == {"weights.bin", "state.json"}
    abandoned = [c for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state == "abandoned"]
    out = run("show", abandoned[0].path).stdout
    assert "state       abandoned" in out
    p = run("show", os.path.join(root, ".txckpt"), check=1)
    assert "txckpt-manifest.json" in p.stderr


def test_show_or_load_a_root_says_it_is_a_root(rolled, tmp_path):
    """`txckpt show ROOT` and `load_checkpoint(ROOT)` said only that ROOT has no manifest."""
    root, a, b = rolled
    p = run("show", root, check=2)
    assert "is a root, not a checkpoint" in p.stderr and "--step N" in p.stderr and "--step 4," in p.stderr
    with pytest.raises(txckpt.errors.NotACheckpointError) as e:
        txckpt.load_checkpoint(root)
    assert e.value.path == root and f"load_checkpoint(get_last_checkpoint({root!r}))" in str(e.value)
    assert isinstance(e.value, txckpt.errors.ManifestError)  # what it raised before, still caught
    legacy = tmp_path / "legacy"
    (legacy / "checkpoint-10").mkdir(parents=True)
    (legacy / "checkpoint-10" / "w.bin").write_bytes(b"w")
    with pytest.raises(txckpt.errors.NotACheckpointError):
        txckpt.read_manifest(str(legacy))
    with pytest.raises(txckpt.errors.ManifestError) as e:  # a plain directory is not a root
        txckpt.load_checkpoint(str(legacy / "checkpoint-10"))
    assert not isinstance(e.value, txckpt.errors.NotACheckpointError)


# ----- verify ------------------------------------------------------------------------------------
def flip_byte(path: str, offset: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_verify_flipped_byte_exits_1_and_names_the_file(rolled):
    root, a, b = rolled
    out = run("verify", root).stdout
    assert "verified 4 checkpoint(s)" in out and "OK" in out
    victim = os.path.join(root, "checkpoint-4", "weights.bin")
    flip_byte(victim)
    p = run("verify", root, check=1)
    assert victim in p.stdout and "checksum mismatch" in p.stdout
    assert "1 problem(s)" in p.stdout
    p = run("verify", os.path.join(root, "checkpoint-4"), check=1)
    assert victim in p.stdout
    run("verify", os.path.join(root, "checkpoint-2"))  # the undamaged one still verifies
    data = json.loads(run("verify", root, "--json", check=1).stdout)
    assert data["ok"] is False and len(data["problems"]) == 1 and victim in data["problems"][0]


def test_verify_reports_every_problem(rolled):
    root, a, b = rolled
    ckpts = {(c.lineage, c.step): c for c in txckpt.CheckpointRoot(root).checkpoints("all")}
    flip_byte(os.path.join(root, "checkpoint-2", "weights.bin"))
    abandoned6 = ckpts[(a, 6)].path
    os.remove(os.path.join(abandoned6, "state.json"))
    with open(os.path.join(ckpts[(a, 4)].path, "weights.bin"), "ab") as f:
        f.write(b"more")
    data = json.loads(run("verify", root, "--json", check=1).stdout)
    problems = data["problems"]
    assert len(problems) == 3, problems
    assert any("checkpoint-2/weights.bin" in p and "checksum" in p for p in problems)
    assert any(p.startswith(os.path.join(abandoned6, "state.json")) and "missing" in p for p in problems)
    assert any("bytes, the manifest says" in p for p in problems)


def test_verify_missing_checkpoint_and_edited_manifest(rolled):
    root, a, b = rolled
    import shutil

    shutil.rmtree(os.path.join(root, "checkpoint-4"))
    p = run("verify", root, check=1)
    assert f"step 4 (lineage {b}" in p.stdout and "data is missing" in p.stdout
    m = os.path.join(root, "checkpoint-2", txckpt.MANIFEST_NAME)
    body = json.load(open(m))
    body["step"] = 3
    json.dump(body, open(m, "w"))
    p = run("verify", root, check=1)
    assert "edited after it was written" in p.stdout


# ----- gc ----------------------------------------------------------------------------------------
def test_gc_dry_run_lists_crash_leftover_then_gc_removes_it_and_nothing_else(rolled):
    root, a, b = rolled
    crash_save(root, 6)
    txckpt.forget_roots()
    (leftover,) = [
        n
        for n in os.listdir(os.path.join(root, ".txckpt", "tx"))
        if n not in {c.txid for c in txckpt.CheckpointRoot(root).checkpoints("all")}
    ]
    assert leftover.startswith(f"6-{b}-")
    before = tree(root)
    p = run("gc", root, "--dry-run")
    assert f"would remove     staging   .txckpt/tx/{leftover}" in p.stdout
    assert "writer pid" in p.stdout and "is dead" in p.stdout
    assert f".txckpt/intents/{leftover}.json" in p.stdout
    assert tree(root) == before  # a dry run changes nothing
    p = run("gc", root)
    assert f"removed          staging   .txckpt/tx/{leftover}" in p.stdout
    after = tree(root)
    gone = set(before) - set(after)
    staging = os.path.join(".txckpt", "tx", leftover)
    assert gone == {k for k in before if k == staging or k.startswith(staging + os.sep)} | {
        os.path.join(".txckpt", "intents", f"{leftover}.json")
    }
    assert {k: v for k, v in before.items() if k in after} == after  # nothing else changed
    run("verify", root)
    assert run("gc", root).stdout.strip() == "nothing to collect"
    # The restarted job saves step 6 normally.
    txckpt.forget_roots()
    txckpt.resume(root)
    save_steps(root, (6,), "b")


def test_gc_keeps_a_live_writers_staging(rolled):
    root, a, b = rolled
    code = textwrap.dedent(f"""
        import sys, txckpt
        txckpt.resume({root!r})
        with txckpt.transaction({root!r}, 8) as tx:
            tx.save("weights.bin", b"live" * 10)
            print("staged", flush=True)
            sys.stdin.readline()
        print(tx.path, flush=True)
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "staged"
        p = run("gc", root, "--grace", "0")
        assert "live" in p.stdout and "kept" in p.stdout and "removed" not in p.stdout
        child.stdin.write("go\n")
        child.stdin.flush()
        path = child.stdout.readline().strip()
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert path == os.path.join(root, "checkpoint-8")
    run("verify", path)


def test_gc_keep_last_retires_and_keeps_what_must_stay(rolled):
    root, a, b = rolled
    save_steps(root, (6, 8), "b")
    txckpt.forget_roots()
    p = run("gc", root, "--keep-last", "1", "--dry-run")
    assert p.stdout.count("would remove     policy") == 2  # b's 4 and 6; 2 is a fork point
    p = run("gc", root, "--keep-last", "1")
    infos = {(c.lineage, c.step): c for c in txckpt.CheckpointRoot(root).checkpoints("all")}
    assert infos[(b, 4)].state == "retired" and infos[(b, 6)].state == "retired"
    assert infos[(b, 4)].path is None and infos[(b, 6)].path is None
    assert infos[(a, 2)].state == "current" and infos[(b, 8)].state == "current"
    assert infos[(a, 4)].state == "abandoned" and infos[(a, 4)].path  # abandoned kept by default
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-8"]
    run("verify", root)
    # log hides the retired checkpoints (their data is gone) unless --all, and says so.
    out = run("log", root).stdout
    assert "retired" not in "".join(l for l in out.splitlines() if "step" in l)
    assert "2 retired checkpoint(s) hidden (--all shows them)" in out
    out = run("log", root, "--all").stdout
    assert sum("retired" in l and "(deleted)" in l for l in out.splitlines()) == 2 and "~" in out


def test_gc_summary_counts_the_names_it_publishes(tmp_path, monkeypatch):
    """The summary said "0 item(s)" under a "would publish" line."""
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, (1, 2))
    (c,) = [c for c in txckpt.CheckpointRoot(root).checkpoints() if c.step == 2]
    # What a crash between the commit and the publication leaves: the checkpoint at its home.
    os.rename(os.path.join(root, "checkpoint-2"), os.path.join(root, ".txckpt", "tx", c.txid, "checkpoint-2"))
    lines = run("gc", root, "--dry-run").stdout.splitlines()
    assert lines[0].startswith("would publish    publish   checkpoint-2")
    assert lines[-1] == "0 item(s), 0 B reclaimable; 1 checkpoint name(s) would be published"
    assert run("gc", root).stdout.splitlines()[-1] == "0 item(s), 0 B reclaimed; 1 checkpoint name(s) published"
    assert os.path.isdir(os.path.join(root, "checkpoint-2"))
    assert run("gc", root).stdout.strip() == "nothing to collect"


# ----- adopt / export / resume -------------------------------------------------------------------
def test_adopt_legacy_root(tmp_path):
    root = tmp_path / "legacy"
    for s in (10, 20):
        d = root / f"checkpoint-{s}"
        d.mkdir(parents=True)
        (d / "pytorch_model.bin").write_bytes(b"w" * s)
        (d / "trainer_state.json").write_text(json.dumps({"global_step": s}))
    out = run("log", str(root)).stdout
    assert "no txckpt log" in out and "[10, 20]" in out
    p = run("adopt", str(root))
    assert "adopted steps 10, 20" in p.stdout
    rows = json.loads(run("ls", str(root), "--json").stdout)
    assert [(r["step"], r["state"], r["adopted"]) for r in rows] == [(10, "current", True), (20, "current", True)]
    assert "adopted legacy checkpoints" in run("log", str(root)).stdout
    assert "already has a txckpt log" in run("adopt", str(root)).stdout
    run("verify", str(root))


def test_export_verifies_and_refuses_non_empty_dest(rolled, tmp_path):
    root, a, b = rolled
    dest = str(tmp_path / "exported")
    p = run("export", root, "--step", "4", dest)
    assert "exported step 4" in p.stdout
    assert sorted(os.listdir(dest)) == ["state.json", txckpt.MANIFEST_NAME, "weights.bin"]
    assert open(os.path.join(dest, "weights.bin"), "rb").read() == b"b4" * 50
    run("verify", dest)
    assert txckpt.load_checkpoint(dest)["state.json"] == {"step": 4, "tag": "b"}
    p = run("export", root, "--step", "2", dest, check=2)
    assert "not empty" in p.stderr
    # An abandoned checkpoint, by txid, without the manifest: a plain directory.
    txid = next(c.txid for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.lineage == a and c.step == 6)
    dest2 = str(tmp_path / "plain")
    run("export", root, "--txid", txid, dest2, "--no-manifest")
    assert sorted(os.listdir(dest2)) == ["state.json", "weights.bin"]
    # A damaged source fails the export and leaves nothing behind.
    flip_byte(os.path.join(root, "checkpoint-2", "weights.bin"))
    dest3 = str(tmp_path / "bad")
    p = run("export", root, "--step", "2", dest3, check=1)
    assert "weights.bin" in p.stderr and "damaged" in p.stderr
    assert not os.path.exists(dest3) or os.listdir(dest3) == []


def test_resume_rolls_back_with_the_warning(rolled):
    root, a, b = rolled
    p = run("resume", root, "--step", "2")
    assert "rolling back" in p.stderr and "checkpoint-4" in p.stderr and b in p.stderr
    assert "new lineage" in p.stdout
    txckpt.forget_roots()
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-2")
    out = run("log", root).stdout
    assert "no checkpoints of its own yet" in out
    data = json.loads(run("resume", root, "--json").stdout)
    assert data["forked"] is False and data["path"] == os.path.join(root, "checkpoint-2")
    p = run("resume", root, "--step", "99", check=1)
    assert "CheckpointNotFoundError" in p.stderr


def test_rollback_warning_is_a_short_line_and_an_indented_list(tmp_path):
    """Through logging.basicConfig (what a training script has) the warning used to be one
    ~700-character line starting "WARNING:txckpt:txckpt:"."""
    root = str(tmp_path / "out")
    code = textwrap.dedent(f"""
        import logging, txckpt
        logging.basicConfig()
        for s in range(1, 15):
            txckpt.save_checkpoint({root!r}, s, {{"w.bin": b"x"}})
        txckpt.forget_roots()
        txckpt.resume({root!r}, step=2)
    """)
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    h = txckpt.CheckpointRoot(root).history()
    (old,) = [l for l in h.state.lineages if l != h.state.head]
    assert lines[0] == (
        f"WARNING:txckpt:rolling back to step 2 of lineage {old}: new lineage {h.state.head} abandons 12 checkpoint(s)"
    )
    assert "txckpt:txckpt:" not in p.stderr and all(l.startswith("  ") for l in lines[1:])
    assert max(len(l) for l in lines if root not in l) < 120 and lines[1] == f"  root: {root}"
    listed = [l.split()[0] for l in lines if l.startswith("    checkpoint-")]
    assert listed == [f"checkpoint-{s}" for s in range(3, 13)]
    assert f"... and 2 more (`txckpt log {root}` shows every one)" in p.stderr


def test_resume_at_the_newest_step_does_not_fence_the_running_job(tmp_path, monkeypatch):
    """`txckpt resume ROOT` (and `--step` of the newest checkpoint) says "nothing changed": it
    must not claim the lineage, which made the job writing it fail its next save."""
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    root = str(tmp_path / "out")
    save_steps(root, (1, 2))  # this process is the job writing the root
    log_dir = os.path.join(root, ".txckpt", "log")
    entries = sorted(os.listdir(log_dir))
    for args in ([], ["--step", "2"]):
        p = run("resume", root, *args)
        assert "nothing changed" in p.stdout and p.stderr == ""
    assert json.loads(run("resume", root, "--json").stdout)["forked"] is False
    assert sorted(os.listdir(log_dir)) == entries  # no claim entry
    save_steps(root, (3,))  # the job goes on
    assert txckpt.get_last_checkpoint(root) == os.path.join(root, "checkpoint-3")


# ----- usage and exit codes ----------------------------------------------------------------------
def test_usage_errors_exit_2(tmp_path, rolled):
    root, a, b = rolled
    assert run("ls", str(tmp_path / "nope"), check=2).stderr.startswith("txckpt ls: usage error")
    assert run("log", str(tmp_path), check=2).returncode == 2  # not a txckpt root
    assert run("ls", root, "--storage-option", "novalue", check=2).returncode == 2
    assert run("frobnicate", root, check=2).returncode == 2
    assert run("gc", root, "--keep-last", "0", check=2).returncode == 2
    assert run("export", root, str(tmp_path / "x"), check=2).returncode == 2  # no --step
    assert run("--help", check=0).stdout.count("Exit codes") == 1


def test_every_subcommand_help_opens_with_what_it_does():
    first = {}
    for command in ("log", "ls", "show", "verify", "gc", "adopt", "export", "resume"):
        out = run(command, "--help").stdout
        paragraphs = out.split("\n\n")
        assert paragraphs[0].startswith(f"usage: txckpt {command}")
        assert not paragraphs[1].startswith(("positional", "options")), out  # a description comes first
        first[command] = " ".join(paragraphs[1].split())
    assert first["log"].startswith("Draw the root's lineage graph")
    resume = first["resume"]
    assert "fork a new lineage" in resume and "are abandoned: kept intact" in resume
    assert "StaleLineageError" in resume


def test_storage_options_parse_json():
    assert cli.parse_storage_options(["anon=true", "n=3", "name=bucket", 'd={"a": 1}']) == {
        "anon": True,
        "n": 3,
        "name": "bucket",
        "d": {"a": 1},
    }


def test_memory_root_in_process(capsys):
    root = "memory://txckpt-cli-test/out"
    txckpt.save_checkpoint(root, 1, {"w.bin": b"1" * 10})
    txckpt.save_checkpoint(root, 2, {"w.bin": b"2" * 10})
    txckpt.forget_roots()
    txckpt.resume(root, step=1)
    txckpt.forget_roots()
    assert cli.main(["log", root]) == 0
    out = capsys.readouterr().out
    assert "no checkpoints of its own yet" in out and "abandoned" in out
    assert cli.main(["verify", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert cli.main(["export", root, "--step", "1", "memory://txckpt-cli-test/exported"]) == 0
    import fsspec

    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/txckpt-cli-test/exported/w.bin") == b"1" * 10
    assert cli.main(["gc", root, "--dry-run"]) == 0
    assert "nothing to collect" in capsys.readouterr().out


def test_verify_progress_bar_only_on_a_tty(rolled):
    """tqdm draws on stderr when it is a terminal; piped output carries no bar."""
    pytest.importorskip("tqdm")
    import pty
    import select

    root, a, b = rolled
    assert "verify" not in run("verify", root).stderr
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0x0 tty draws nothing
    p = subprocess.Popen([TXCKPT, "verify", root], stdout=subprocess.PIPE, stderr=slave, env=ENV)
    os.close(slave)
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 0 and "OK" in out
    tty = b""
    while select.select([master], [], [], 0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        tty += chunk
    os.close(master)
    assert b"verify:" in tty


@pytest.mark.s3
def test_cli_on_s3(s3_root, s3_server):
    """log, verify (with a flipped byte), gc --dry-run and gc on an S3 root, through the console
    script, with the endpoint given as --storage-option."""
    url, options = s3_root
    for s in (2, 4, 6):
        txckpt.save_checkpoint(url, s, {"w.bin": b"a" * 100 * s}, storage_options=options)
    txckpt.forget_roots()
    txckpt.resume(url, step=2, storage_options=options)
    txckpt.save_checkpoint(url, 4, {"w.bin": b"b" * 400}, storage_options=options)
    txckpt.forget_roots()
    code = textwrap.dedent(f"""
        import os, signal, txckpt
        opts = {options!r}
        txckpt.resume({url!r}, storage_options=opts)
        with txckpt.transaction({url!r}, 6, storage_options=opts) as tx:
            tx.save("w.bin", b"partial" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    # TXCKPT_S3_PENDING_FILES=0: tx.save returns once w.bin is uploaded (by default its upload
    # may still be on the wire at the kill, and then no staged file is left behind to show).
    p = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TXCKPT_DURABLE": "0", "TXCKPT_S3_PENDING_FILES": "0"},
        capture_output=True,
        timeout=120,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    opt = ["-o", "client_kwargs=" + json.dumps(options["client_kwargs"])]
    r = txckpt.CheckpointRoot(url, options)
    h = r.history()
    b = h.state.head
    (a,) = [lid for lid in h.state.lineages if lid != b]
    out = run("log", url, *opt).stdout
    assert f"HEAD -> lineage {b}, forked from {a} at step 2" in out and f"fork point of {b}" in out
    assert sum("abandoned" in line for line in out.splitlines() if "step" in line) == 2
    rows = json.loads(run("ls", url, *opt, "--json").stdout)
    assert sorted(r_["state"] for r_ in rows) == ["abandoned", "abandoned", "current", "current", "staged-leftover"]
    run("verify", url, *opt)
    # Flip one byte of the current checkpoint-4's file, in place on S3.
    c4 = next(c for c in h.in_view(None) if c.step == 4)
    key = r.publication.locate(c4.ref) + "/w.bin"
    data = bytearray(r.storage.read_bytes(key))
    data[7] ^= 1
    r.storage.replace(key, bytes(data))
    p = run("verify", url, *opt, check=1)
    assert r.storage.full_path(key) in p.stdout and "checksum mismatch" in p.stdout
    # gc: the killed save's staging is listed, then removed, and nothing else.
    staged = [x for x in r.storage.list_dir(".txckpt/tx") if x not in h.checkpoints]
    assert len(staged) == 1
    p = run("gc", url, *opt, "--dry-run")
    assert f"would remove     staging   .txckpt/tx/{staged[0]}" in p.stdout
    before = sorted(k for k, _ in r.storage.walk_files(""))
    run("gc", url, *opt)
    after = sorted(k for k, _ in r.storage.walk_files(""))
    assert set(before) - set(after) == {
        k for k in before if k.startswith(f".txckpt/tx/{staged[0]}/") or k == f".txckpt/intents/{staged[0]}.json"
    }
    assert set(after) <= set(before)


def test_verify_and_export_report_a_fifo_instead_of_hanging(rolled, tmp_path):
    root, a, b = rolled
    p = os.path.join(root, "checkpoint-4", "weights.bin")
    os.unlink(p)
    os.mkfifo(p)  # opening it for reading would wait for a writer forever
    out = run("verify", root, check=1)  # run()'s timeout fails the test if verify blocks
    assert f"PROBLEM: {p}: a FIFO, not a regular file" in out.stdout
    out = run("verify", os.path.join(root, "checkpoint-4"), check=1)
    assert "a FIFO, not a regular file" in out.stdout
    dest = str(tmp_path / "exported")
    out = run("export", root, "--step", "4", dest, check=1)
    assert "a FIFO, not a regular file" in out.stderr
    assert not os.path.exists(dest) or os.listdir(dest) == []
    # The manifest itself replaced by a FIFO: a PROBLEM line too.
    m = os.path.join(root, "checkpoint-2", txckpt.MANIFEST_NAME)
    os.unlink(m)
    os.mkfifo(m)
    out = run("verify", root, check=1)
    assert "PROBLEM: step 2 " in out.stdout and "data is missing" in out.stdout
    out = run("verify", os.path.join(root, "checkpoint-2"), check=1)
    assert f"PROBLEM: {m}: a FIFO, not a regular file" in out.stdout


def test_export_refuses_a_dest_reached_through_a_symlink_into_the_root_and_a_file(rolled, tmp_path):
    root, a, b = rolled
    before = tree(root)
    link = tmp_path / "looks-outside"
    os.symlink(os.path.join(root, ".txckpt", "tx"), link)
    for dest in (str(link / "export"), str(link)):
        p = run("export", root, "--step", "4", dest, check=2)
        assert "lies inside ROOT" in p.stderr
    os.symlink(root, tmp_path / "root-link")
    p = run("export", root, "--step", "4", str(tmp_path / "root-link" / "x"), check=2)
    assert "lies inside ROOT" in p.stderr
    assert tree(root) == before  # nothing written into the root, so gc has nothing to delete
    f = tmp_path / "a-file"
    f.write_bytes(b"keep me")
    p = run("export", root, "--step", "4", str(f), check=2)
    assert "is an existing file" in p.stderr and f.read_bytes() == b"keep me"
    # A symlink to a directory outside the root is a fine destination.
    (tmp_path / "real-out").mkdir()
    os.symlink(tmp_path / "real-out", tmp_path / "out-link")
    run("export", root, "--step", "4", str(tmp_path / "out-link"))
    assert "weights.bin" in os.listdir(tmp_path / "real-out")


_FULL_DISK = r"""
import json, os, subprocess, sys
import txckpt
mnt = sys.argv[1]
root = os.path.join(mnt, "out")
TX = os.path.join(os.path.dirname(sys.executable), "txckpt")
out = {}
for s in (1, 2, 3):
    txckpt.save_checkpoint(root, s, {"w.bin": os.urandom(500_000), "s.json": {"step": s}})
RESERVE = os.path.join(root, ".txckpt", "reserve")
out["reserve_made"] = os.path.getsize(RESERVE) if os.path.exists(RESERVE) else 0

def fill(name):
    with open(os.path.join(mnt, name), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == 28, e
    try:
        with open(os.path.join(mnt, "probe"), "wb") as f:
            f.write(b"x")
            f.flush()
        return False
    except OSError:
        os.unlink(os.path.join(mnt, "probe"))
        return True

out["full"] = fill("filler")
try:
    txckpt.save_checkpoint(root, 4, {"w.bin": b"x" * 100_000})
    out["save"] = "committed"
except txckpt.errors.StorageError as e:
    out["save"] = str(e)
out["reserve_after_save"] = os.path.exists(os.path.join(root, ".txckpt", "reserve"))
p = subprocess.run([TX, "gc", "--keep-last", "1", root], capture_output=True, text=True)
out["gc"] = [p.returncode, p.stdout, p.stderr]
txckpt.forget_roots()
out["left"] = sorted(c.step for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state != "retired")
out["last"] = txckpt.get_last_checkpoint(root)
out["reserve_back"] = os.path.exists(os.path.join(root, ".txckpt", "reserve"))
p = subprocess.run([TX, "verify", root], capture_output=True, text=True)
out["verify"] = p.returncode
# A root whose reserve is gone (an older txckpt's) on a full disk: gc first reclaims what needs no
# log entry (here an uncommitted staging), which makes room for the retire entry.
os.unlink(os.path.join(mnt, "filler"))
for s in (5, 6):
    txckpt.save_checkpoint(root, s, {"w.bin": os.urandom(500_000)})
if os.path.exists(RESERVE):
    os.unlink(RESERVE)
staging = os.path.join(root, ".txckpt", "tx", "0-deadbeef-0000000000", "checkpoint-0")
os.makedirs(staging)
with open(os.path.join(staging, "junk.bin"), "wb") as f:
    f.write(os.urandom(20_000))
out["full2"] = fill("filler2")
p = subprocess.run([TX, "gc", "--keep-last", "2", root], capture_output=True, text=True)
out["gc2"] = [p.returncode, p.stdout, p.stderr]
out["staging_left"] = os.path.exists(staging)
txckpt.forget_roots()
out["left2"] = sorted(c.step for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state != "retired")
# Nothing to reclaim without an entry, and no reserve: gc says what to do, and deletes nothing.
if os.path.exists(RESERVE):
    os.unlink(RESERVE)
out["full3"] = fill("filler3")
p = subprocess.run([TX, "gc", "--keep-last", "1", root], capture_output=True, text=True)
out["gc3"] = [p.returncode, p.stdout, p.stderr]
txckpt.forget_roots()
out["left3"] = sorted(c.step for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state != "retired")
os.unlink(os.path.join(mnt, "filler3"))  # space freed by hand, as the message says
p = subprocess.run([TX, "gc", "--keep-last", "1", root], capture_output=True, text=True)
out["gc4"] = p.returncode
txckpt.forget_roots()
out["left4"] = sorted(c.step for c in txckpt.CheckpointRoot(root).checkpoints("all") if c.state != "retired")
print(json.dumps(out))
"""


def _in_tiny_tmpfs(tmp_path, code, size="4m"):
    """Run ``code`` with a fresh tmpfs of ``size`` mounted at argv[1], in a private mount
    namespace (unshare -rm); skip where the machine does not allow one."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs "$1" && exec "$2" -c "$3" "$1"',
        "sh",
        str(mnt),
        sys.executable,
        code,
    ]
    try:
        p = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs "{mnt}"'], capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        p = None
    if p is None or p.returncode != 0:
        pytest.skip("no private mount namespace here (unshare -rm, mount -t tmpfs)")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_gc_keep_last_frees_space_on_a_100_percent_full_disk(tmp_path):
    out = _in_tiny_tmpfs(tmp_path, _FULL_DISK)
    assert out["full"] is True
    rc, stdout, stderr = out["gc"]
    assert rc == 0, stdout + stderr
    assert out["left"] == [3] and out["last"].endswith("checkpoint-3") and out["verify"] == 0
    # A save on the full disk fails, typed, and leaves the reserve (made with the root) for gc.
    assert "disk is full" in out["save"] and "--keep-last" in out["save"] and not out["save"].endswith("None")
    assert out["reserve_made"] > 0 and out["reserve_after_save"] is True
    assert out["reserve_back"] is True  # the freed space holds it again
    # Without a reserve: the staging goes first, and its space holds the retire entry.
    assert out["full2"] is True
    rc, stdout, stderr = out["gc2"]
    assert rc == 0 and out["staging_left"] is False, stdout + stderr
    assert out["left2"] == [5, 6]
    # Nothing to reclaim first and no reserve: nothing committed is deleted, and the message says
    # what to do; once space is freed by hand, the same command works.
    assert out["full3"] is True
    rc, stdout, stderr = out["gc3"]
    assert rc == 1, stdout + stderr
    assert "Free a few MiB" in stdout + stderr and "--keep-last N` again" in stdout + stderr
    assert ": None" not in stdout + stderr
    assert out["left3"] == [5, 6]
    assert out["gc4"] == 0 and out["left4"] == [6]


# ----- messages that say which file and what to do ------------------------------------------------
def test_non_tensor_in_a_safetensors_file_names_the_file_and_suggests_pt_or_json(tmp_path, monkeypatch):
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    import torch

    root = str(tmp_path / "out")
    with pytest.raises(txckpt.errors.InvalidArgumentError) as e:
        txckpt.save_checkpoint(root, 1, {"model.safetensors": {"w": torch.zeros(2), "lr": 0.1}})
    msg = str(e.value)
    assert msg.startswith("'model.safetensors': its entry 'lr' is a float, not a torch.Tensor")
    assert ".pt" in msg and ".json" in msg
    with pytest.raises(txckpt.errors.InvalidArgumentError) as e:
        txckpt.save_checkpoint(root, 1, {"extra.safetensors": [torch.zeros(2)]})
    assert str(e.value).startswith("'extra.safetensors' takes a dict of name -> torch.Tensor, not a list")
    assert txckpt.get_last_checkpoint(root) is None  # nothing committed


def test_weights_only_refusal_names_the_file_and_the_global(tmp_path, monkeypatch):
    monkeypatch.setenv("TXCKPT_DURABLE", "0")
    import argparse
    import pickle

    import torch

    root = str(tmp_path / "out")
    path = txckpt.save_checkpoint(
        root, 1, {"args.pt": {"args": argparse.Namespace(lr=0.1)}, "w.pt": {"w": torch.ones(1)}}
    )
    with pytest.raises(txckpt.errors.WeightsOnlyError) as e:
        txckpt.load_checkpoint(path)
    err = e.value
    assert err.path == os.path.join(path, "args.pt") and err.global_name == "argparse.Namespace"
    assert str(err).startswith(f"{path}/args.pt: ") and "add_safe_globals([argparse.Namespace])" in str(err)
    assert "weights_only=False" in str(err)
    assert isinstance(err, pickle.UnpicklingError)  # what torch.load raises: old handlers still work
    assert txckpt.load_checkpoint(path, weights_only=False)["args.pt"]["args"].lr == 0.1
    assert torch.equal(txckpt.load_checkpoint(path, files=["w.pt"])["w.pt"]["w"], torch.ones(1))


def test_emulator_skip_messages_give_the_install_commands_of_the_docs_and_ci():
    """The Azure rows' skip message said `npm install -g azurite`; docs/remote.md and .ci/run
    install it into .ci/node and export AZURITE_BLOB."""
    import emulators.azure as s3_server  # the Azurite how-to moved out of tests/ (issue 15)

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    remote = open(os.path.join(here, "docs", "remote.md")).read()
    ci = open(os.path.join(here, ".ci", "run")).read()
    (npm,) = [l for l in remote.splitlines() if l.startswith("npm install")]
    assert npm in s3_server.AZURITE_HOWTO
    assert "azurite@3.37.0" in ci and 'AZURITE_BLOB="$PWD/.ci/node/node_modules/.bin/azurite-blob"' in ci
    assert s3_server.AZURITE_CI_PATH == os.path.join(here, ".ci", "node", "node_modules", ".bin", "azurite-blob")
    assert "-g azurite" not in open(s3_server.__file__).read()


def test_the_new_errors_pickle_with_their_fields():
    """Errors cross process boundaries (ranks, worker pools): they must unpickle, fields kept."""
    import pickle

    from txckpt import errors

    for e, fields in [
        (errors.LineageNotFoundError("m", lineage="x", known=["a", "b"]), {"lineage": "x", "known": ["a", "b"]}),
        (errors.NotACheckpointError("m", path="/r"), {"path": "/r"}),
        (
            errors.WeightsOnlyError("m", path="/r/a.pt", global_name="argparse.Namespace"),
            {"path": "/r/a.pt", "global_name": "argparse.Namespace"},
        ),
    ]:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == "m"
        assert {k: getattr(back, k) for k in fields} == fields
