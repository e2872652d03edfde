"""The operations the crash sweeps exercise, each as a (build, run) pair over any backend.

``build(url, so)`` creates the template root the operation starts from and returns what the
checker needs to know (which checkpoints a crash may leave lookup returning, what retention may
retire, which legacy or foreign files must survive). ``run(url, so, expect)`` is the operation
under test, run in a child that is crashed at each of its storage operations.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from .core import payload, write_legacy


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    build: Callable[[str, Any], dict[str, Any]]
    run: Callable[[str, Any, dict[str, Any]], Any]
    backends: tuple[str, ...] = ("local", "memory", "s3")


def _save(url, so, step, tag):
    import txckpt

    return txckpt.save_checkpoint(url, step, payload(tag, step), storage_options=so)


def _root(url, so):
    from txckpt._root.root import CheckpointRoot

    return CheckpointRoot(url, so)


def _b64(d: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in d.items()}


# ----- save -------------------------------------------------------------------------------------
def build_save(url, so):
    _save(url, so, 2, "A-2")
    return {"allowed": ["A-2", "A-4"]}


def run_save(url, so, expect):
    return _save(url, so, 4, "A-4")


# ----- a transaction whose files other code writes into tx.directory ----------------------------
def run_txdir(url, so, expect):
    import torch

    import txckpt

    p = payload("A-4", 4)
    with txckpt.transaction(url, 4, storage_options=so) as tx:
        tx.save("model.safetensors", p["model.safetensors"])
        with tx.open("extra.dat", "wb") as f:
            f.write(p["extra.dat"])
        # save_pretrained-style writers: plain files (and a sub-directory) in tx.directory.
        with open(os.path.join(tx.directory, "optimizer.pt"), "wb") as f:
            torch.save(p["optimizer.pt"], f)
        with open(os.path.join(tx.directory, "trainer_state.json"), "w") as f:
            json.dump(p["trainer_state.json"], f)
        os.makedirs(os.path.join(tx.directory, "sub"), exist_ok=True)
        with open(os.path.join(tx.directory, "sub", "notes.txt"), "w") as f:
            f.write("written by other code\n")
    return tx.path


# ----- the first save on an empty root ----------------------------------------------------------
def build_first(url, so):
    return {"allowed": [None, "A-2"]}


def run_first(url, so, expect):
    return _save(url, so, 2, "A-2")


# ----- fork (resume to an older step) and re-save a step another lineage committed --------------
def build_fork(url, so, save=_save):
    for s in (2, 4, 6):
        save(url, so, s, f"A-{s}")
    return {"allowed": ["A-6", "A-2", "B-4"]}


def run_fork(url, so, expect, save=_save):
    import txckpt

    txckpt.resume(url, step=2, storage_options=so)
    return save(url, so, 4, "B-4")


# ----- publish over a checkpoint-N that another tool wrote --------------------------------------
def build_foreign(url, so):
    _save(url, so, 2, "A-2")
    files = write_legacy(_root(url, so).storage, "checkpoint-4", "F-4", 4)
    return {
        "allowed": ["A-2", "A-4"],
        "foreign_names": ["checkpoint-4"],
        "foreign": {"name": "checkpoint-4", "files": _b64({k.split("/", 1)[1]: v for k, v in files.items()})},
    }


# ----- retention --------------------------------------------------------------------------------
def _retention_policy():
    from txckpt._maintenance.retention import RetentionPolicy

    return RetentionPolicy(keep_last=2, abandoned=0)


def build_retention(url, so, save=_save):
    """A-1..A-5, a fork at 2, B-3 and B-4: retention lets 4 go. ``save``: how each is saved."""
    import txckpt
    from txckpt._maintenance.retention import plan_retention

    for s in (1, 2, 3, 4, 5):
        save(url, so, s, f"A-{s}")
    txckpt.resume(url, step=2, storage_options=so)
    for s in (3, 4):
        save(url, so, s, f"B-{s}")
    txckpt.forget_roots()
    going = [c.txid for c in plan_retention(_root(url, so), _retention_policy())]
    assert len(going) == 4, going
    return {"allowed": ["B-4"], "may_retire": going}


def run_retention(url, so, expect):
    from txckpt._maintenance.retention import apply_retention

    return [i.txid for i in apply_retention(_root(url, so), _retention_policy())]


# ----- gc of every kind of garbage --------------------------------------------------------------
def _gc_policy():
    from txckpt._maintenance.retention import RetentionPolicy

    return RetentionPolicy(keep_last=1)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def build_gc(url, so):
    """A root holding every kind of garbage gc reclaims, and two half-done publications."""
    import txckpt
    from txckpt._base.layout import home_key
    from txckpt._log.publication import public_key
    from txckpt._maintenance.retention import plan_retention, retire

    for s in (1, 2, 3, 4, 5):
        _save(url, so, s, f"A-{s}")
    txckpt.forget_roots()
    r = _root(url, so)
    a = {c.step: c.txid for c in r.checkpoints("current")}
    retire(r, [a[1]])  # phase one of a deletion whose phase two crashed
    txckpt.resume(url, step=2, storage_options=so)
    for s in (3, 4):
        _save(url, so, s, f"B-{s}")
    txckpt.forget_roots()
    r = _root(url, so)
    st = r.storage
    b = {c.step: c.txid for c in r.checkpoints("current") if c.lineage != r.history().checkpoints[a[2]].lineage}
    if st.atomic_dir_rename:
        # A fork whose unpublish crashed: abandoned A-5 still holds checkpoint-5.
        st.rename_noreplace(home_key(a[5], 5), public_key(5))
        # A save whose publication crashed: B-4 committed, still at its home.
        st.rename_noreplace(public_key(4), home_key(b[4], 4))
    # A save that crashed before its commit, whose writer is dead.
    dead = f"7-deadbeef-{os.urandom(5).hex()}"
    st.create_exclusive(f".txckpt/tx/{dead}/checkpoint-7/model.safetensors", b"partial", durable=False)
    intent = {
        "txid": dead,
        "step": 7,
        "lineage": "deadbeef",
        "host": socket.gethostname(),
        "pid": _dead_pid(),
        "time": time.time() - 100,
        "world_size": 1,
    }
    st.create_exclusive(f".txckpt/intents/{dead}.json", json.dumps(intent).encode(), durable=False)
    # The intent of a save that committed but died before removing it.
    intent = dict(intent, txid=b[3], step=3)
    st.create_exclusive(f".txckpt/intents/{b[3]}.json", json.dumps(intent).encode(), durable=False)
    # A temp file of an interrupted log append, and an expired reader lease.
    st.create_exclusive(".txckpt/log/.00000000000000000099.json.0123456789ab.tmp", b"{", durable=False)
    st.create_exclusive(
        ".txckpt/readers/x.0123456789ab.json",
        json.dumps({"txid": a[2], "expires": time.time() - 86400, "pid": 1}).encode(),
        durable=False,
    )
    txckpt.forget_roots()
    going = [c.txid for c in plan_retention(_root(url, so), _gc_policy())]
    assert going == [b[3]], going
    return {"allowed": ["B-4"], "may_retire": going}


def run_gc(url, so, expect):
    from txckpt._maintenance.gc import collect_garbage

    rep = collect_garbage(_root(url, so), policy=_gc_policy(), now=time.time() + 7200)
    return [(i.kind, i.key) for i in rep.items]


# ----- adoption of a legacy root ----------------------------------------------------------------
def build_adopt(url, so):
    legacy = {}
    st = _root(url, so).storage
    for s in (2, 4):
        legacy.update(write_legacy(st, f"checkpoint-{s}", f"L-{s}", s))
    return {"allowed": ["L-4"], "legacy": _b64(legacy)}


def build_adopt_save(url, so):
    out = build_adopt(url, so)
    out["allowed"] = ["L-4", "A-6"]
    return out


def run_adopt(url, so, expect):
    return _root(url, so).adopt()


def run_adopt_save(url, so, expect):
    return _save(url, so, 6, "A-6")


# ----- incremental saves (docs/incremental.md): files shared with committed checkpoints ----------
def _frozen():
    import torch

    return {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: past the first prefix boundary


def _save_inc(url, so, step, tag):
    import txckpt

    return txckpt.save_checkpoint(
        url, step, {**payload(tag, step), "frozen.safetensors": _frozen()}, storage_options=so, incremental=True
    )


def build_incremental(url, so):
    for s in (2, 4):
        _save_inc(url, so, s, f"A-{s}")
    return {"allowed": ["A-4", "A-6"]}


def run_incremental(url, so, expect):
    return _save_inc(url, so, 6, "A-6")  # shares frozen.safetensors with A-4 (a link or a server-side copy)


def _save_inc_txdir(url, so, step, tag):
    """An incremental transaction whose files other code writes into tx.directory (a Trainer's
    save): the frozen file equals the previous checkpoint's, so it is shared once hashed (a local
    root: a hard link renamed over the written file) or instead of its upload (an object store)."""
    import txckpt
    from txckpt._save.serialization import write_object

    with txckpt.transaction(url, step, storage_options=so, incremental=True) as tx:
        for name, obj in {**payload(tag, step), "frozen.safetensors": _frozen()}.items():
            with open(os.path.join(tx.directory, name), "wb") as f:
                write_object(name, obj, f)
    return tx.path


def build_incremental_txdir(url, so):
    for s in (2, 4):
        _save_inc_txdir(url, so, s, f"A-{s}")
    return {"allowed": ["A-4", "A-6"]}


def run_incremental_txdir(url, so, expect):
    return _save_inc_txdir(url, so, 6, "A-6")


def build_incremental_fork(url, so):
    return build_fork(url, so, save=_save_inc)


def run_incremental_fork(url, so, expect):
    return run_fork(url, so, expect, save=_save_inc)  # B-4 shares with the lineage it abandons


def build_incremental_retention(url, so):
    return build_retention(url, so, save=_save_inc)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "save",
            "save (3 kinds + raw bytes) over a root with one checkpoint: staging, commit, publish",
            build_save,
            run_save,
        ),
        Scenario(
            "txdir",
            "transaction with files written into tx.directory by other code (commit hashes them)",
            build_save,
            run_txdir,
        ),
        Scenario("first", "first save on an empty root (creates the lineage and the log)", build_first, run_first),
        Scenario(
            "fork",
            "fork (resume to step 2 of 2,4,6) + re-save step 4 + publish over the other lineage's name",
            build_fork,
            run_fork,
        ),
        Scenario(
            "foreign",
            "publish over a checkpoint-N written by another tool (moved to orphans/)",
            build_foreign,
            run_save,
            backends=("local",),
        ),
        Scenario(
            "retention",
            "retention keep_last=2, abandoned TTL 0 (retire entry, then deletion of 4 checkpoints)",
            build_retention,
            run_retention,
        ),
        Scenario(
            "gc",
            "gc with a policy: dead staging, retired data, stale intents, temp file, expired lease, "
            "half-done publish and unpublish",
            build_gc,
            run_gc,
        ),
        Scenario("adopt", "adoption of a legacy root (txckpt adopt)", build_adopt, run_adopt),
        Scenario(
            "adopt-save", "first txckpt save on a legacy root (adopts, then saves)", build_adopt_save, run_adopt_save
        ),
        Scenario(
            "incremental",
            "incremental save sharing an unchanged file with the previous checkpoint",
            build_incremental,
            run_incremental,
        ),
        Scenario(
            "incremental-txdir",
            "incremental transaction whose unchanged file other code wrote into "
            "tx.directory (shared once hashed, or instead of its upload)",
            build_incremental_txdir,
            run_incremental_txdir,
        ),
        Scenario(
            "incremental-fork",
            "fork (resume to step 2 of 2,4,6) + incremental re-save of step 4, sharing with the abandoned lineage",
            build_incremental_fork,
            run_incremental_fork,
        ),
        Scenario(
            "incremental-retention",
            "retention (as 'retention') of checkpoints that all share one file",
            build_incremental_retention,
            run_retention,
        ),
    ]
}
