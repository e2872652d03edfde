"""Directories of their own: ``TransactionalAccelerator.save_state(d)`` for a local ``d`` that is
not a checkpoint of a root (``"initial"``, ``tempfile.mkdtemp()``, ``out/state``; docs/accelerate.md,
"Directories of their own"; docs/protocol.md §13).

``d`` holds what stock accelerate writes there, plus ``txckpt-manifest.json``: the checkpoint is
read on its manifest's word, as a copy outside any root is (protocol §6a), so stock
``Accelerator.load_state(d)`` loads it too. Nothing is written to a root, and no directory
becomes one: a save is one transaction of a private, short-lived root beside ``d``,
``<parent>/.<name>.txckpt-<12 hex>/`` (every rank writes into its staging, rank 0 commits as
in any root, protocol §8), whose committed checkpoint then takes ``d``'s place in one
``renameat2(RENAME_EXCHANGE)``; the private root, holding the previous content by then, is
deleted. A crash leaves ``d`` with its previous committed content (or, where the filesystem has
no exchange and the crash falls between the two renames that replace it, no ``d``, with the
previous content kept in the private root and put back by the next save), never a mix, and at
most a hidden private root that the next save of ``d`` deletes once its writer is gone.

``d`` is replaced only if every file in it is one that stock would overwrite (a file of the new
checkpoint) or one of the checkpoint it holds (listed in its manifest): other files (a user's
logs, a project directory) are never deleted; the save raises instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from typing import Callable

from txckpt._base import fileio
from txckpt._base.coordination import decide_on_rank0
from txckpt.errors import InvalidArgumentError, ManifestError
from txckpt._maintenance.intents import GRACE_SECONDS, process_start, writer_status
from txckpt._base.layout import MANIFEST_NAME
from txckpt._manifest.manifest import Manifest, read_manifest_at
from txckpt._manifest.parts import TREE_NAME, part_name
from txckpt._root.root import CheckpointRoot
from txckpt._storage import open_storage

log = logging.getLogger("txckpt")

#: Inside a private root: who writes it (``intents``' liveness record), and where the previous
#: content waits while a filesystem without exchange replaces ``d`` by two renames.
OWNER_NAME = "owner.json"
PREVIOUS_NAME = "previous"
_NAME_CHARS = 200  # of d's name kept in the private root's (a file name is at most 255 bytes)


def private_prefix(name: str) -> str:
    return f".{name[:_NAME_CHARS]}.txckpt-"


def _private_re(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(private_prefix(name)) + r"[0-9a-f]{12}$")


def _manifest_of(d: str) -> Manifest | None:
    """The manifest ``d`` holds, or None (none, or not one txckpt wrote)."""
    try:
        with open(os.path.join(d, MANIFEST_NAME), "rb") as f:
            return read_manifest_at(open_storage(d), "", Manifest.decode(f.read(), d), d)
    except (OSError, ValueError, ManifestError):
        return None


def dir_step(d: str) -> int | None:
    """The step of the checkpoint ``d`` holds, if it holds one."""
    m = _manifest_of(d)
    return None if m is None else m.step


def _sync(path: str, durable: bool) -> None:
    if durable:
        fileio.fsync_dir(path)


def reclaim(parent: str, name: str) -> None:
    """Delete the private roots of ``parent/name`` whose writer is gone; first put back the
    previous content a killed two-rename replacement left, if ``name`` is missing."""
    d = os.path.join(parent, name)
    pattern = _private_re(name)
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return
    for entry in entries:
        if not pattern.fullmatch(entry):
            continue
        path = os.path.join(parent, entry)
        try:
            with open(os.path.join(path, OWNER_NAME)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            owner = None
        gone, why = writer_status(
            owner if isinstance(owner, dict) else None, now=time.time(), grace_seconds=GRACE_SECONDS
        )
        if not gone:
            continue
        previous = os.path.join(path, PREVIOUS_NAME)
        if not os.path.lexists(d) and _manifest_of(previous) is not None:
            fileio.rename_noreplace(previous, d)
            log.warning(
                "%s was missing (a save was killed while replacing it); put back its previous content from %s", d, path
            )
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by a save of %s that did not finish (%s)", path, d, why)


def _check_replaceable(d: str, new: Manifest) -> None:
    if os.path.islink(d) or not os.path.isdir(d):
        raise InvalidArgumentError(f"save_state({d!r}): it exists and is not a directory")
    if fileio.lies_within(os.getcwd(), d):
        raise InvalidArgumentError(
            f"save_state({d!r}) would replace the working directory (or one above it); save into a directory of its own"
        )
    old = _manifest_of(d)
    allowed = set(new.files) | set(old.files if old is not None else ()) | {MANIFEST_NAME}
    if old is not None and old.parts is not None:  # a multi-rank checkpoint's parts and tree (format /2)
        allowed |= {part_name(r) for r in range(old.parts.count)} | {TREE_NAME}
    dirs = {n.rsplit("/", i)[0] for n in allowed for i in range(1, n.count("/") + 1)}
    foreign: list[str] = []
    for top, subdirs, files in os.walk(d):
        rel = os.path.relpath(top, d).replace(os.sep, "/")
        pre = "" if rel == "." else rel + "/"
        for s in list(subdirs):
            if pre + s not in dirs:
                foreign.append(pre + s + "/")
                subdirs.remove(s)
        foreign += [pre + f for f in files if pre + f not in allowed]
        if len(foreign) >= 5:
            break
    if foreign:
        raise InvalidArgumentError(
            f"save_state({d!r}) was not committed: {d} holds files that are neither the checkpoint's "
            f"nor the previous checkpoint's ({', '.join(sorted(foreign)[:5])}), which replacing it "
            "would delete. Save into an empty or new directory, or remove them"
        )


def _install(d: str, committed: str, private: str, durable: bool) -> str:
    """Rank 0: put the committed checkpoint at ``d`` (one exchange), then delete the private root."""
    parent = os.path.dirname(d)
    try:
        if not os.path.lexists(d):
            try:
                fileio.rename_noreplace(committed, d)
                _sync(parent, durable)
                return d
            except FileExistsError:
                pass  # appeared meanwhile: replace it as any existing d
        new = _manifest_of(committed)
        assert new is not None  # the transaction committed it
        _check_replaceable(d, new)
        if not fileio.rename_exchange(committed, d):
            previous = os.path.join(private, PREVIOUS_NAME)
            os.rename(d, previous)
            _sync(parent, durable)  # a crash here: no d; the next save puts previous back
            fileio.rename_noreplace(committed, d)
        _sync(parent, durable)
        return d
    finally:
        shutil.rmtree(private, ignore_errors=True)


def save_dir(
    d: str, step: int, write: Callable[[str], None], *, main: bool, timeout: float | None, durable: bool
) -> str:
    """Save into ``d`` by ``write(directory)`` on every rank, committed as one transaction and
    swapped in atomically (module doc). Returns ``d`` (absolute). Every rank calls it."""
    d = os.path.abspath(os.path.expanduser(d))
    parent, name = os.path.split(d)

    def start() -> str:
        os.makedirs(parent, exist_ok=True)  # as stock save_state's makedirs
        reclaim(parent, name)
        private = os.path.join(parent, private_prefix(name) + uuid.uuid4().hex[:12])
        fileio.makedirs_durable(private, durable)
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": process_start(),
            "time": time.time(),
            "directory": d,
        }
        with open(os.path.join(private, OWNER_NAME), "w") as f:
            json.dump(owner, f)
        return private

    private = decide_on_rank0(start, phase="save plan", timeout=timeout)
    try:
        with CheckpointRoot(private, durable=durable).transaction(step, timeout=timeout) as tx:
            write(tx.directory)
    except BaseException:
        if main:
            shutil.rmtree(private, ignore_errors=True)
        raise
    committed = tx.path
    assert committed is not None
    return decide_on_rank0(lambda: _install(d, committed, private, durable), phase="publish", timeout=timeout)


__all__ = ["save_dir", "dir_step", "reclaim", "private_prefix"]
