"""``txckpt verify``: every file of a root's committed checkpoints (or of one checkpoint) read and
checked against its manifest, every problem reported."""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from .._log import log as commit_log
from ..errors import ManifestError, SpecialFileError, TxckptError
from .._base.layout import LOG_DIR, META_DIR
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import FileEntry, Manifest, read_manifest_at
from .._base.progress import bar as progress_bar, bar_wanted
from .._read.reader import names_a_checkpoint
from .._storage import open_storage
from .._storage.base import Storage
from .._manifest.verify import FileProblem, check_file, locate_damage
from .common import EXIT_OK, EXIT_PROBLEM, UsageError, human_bytes, open_root_arg, print_json
from .._base.layout import is_url


# ----- verify --------------------------------------------------------------------------------------
class _Task:
    __slots__ = ("storage", "key", "where", "entry")

    def __init__(self, storage: Storage, key: str, where: str, entry: FileEntry):
        self.storage, self.key, self.where, self.entry = storage, key, where, entry


def _check_file(task: _Task) -> tuple[int, str | None]:
    """(bytes read, the problem as ``txckpt verify`` prints it, or None): txckpt._manifest.verify's check,
    worded for a list of every problem."""
    where, entry = task.where, task.entry
    try:
        size, _ = check_file(task.storage, task.key, entry, stream=True)
    except FileProblem as p:
        if p.kind == "symlink":
            return 0, f"{where}: a symlink that leaves the root (refused)"
        if p.kind == "missing":
            return 0, f"{where}: missing (the manifest lists it, {entry.size} bytes)"
        if p.kind == "directory":
            return 0, f"{where}: a directory where the manifest lists a file"
        if p.kind == "size":
            return p.size, f"{where}: {p.size} bytes, the manifest says {entry.size} (truncated or rewritten)"
        damage = locate_damage(task.storage, task.key, task.key.rsplit("/", 1)[-1], entry)
        return p.size, (
            f"{where}: checksum mismatch (xxh3-128 {p.digest}, the manifest says {entry.checksum}): "
            "its bytes changed after the commit" + (f"; {damage}" if damage else "")
        )
    except SpecialFileError as e:
        return 0, f"{where}: a {e.kind}, not a regular file (not read: reading would block)"
    except OSError as e:
        return 0, f"{where}: unreadable ({e})"
    return size, None


def _plan_checkpoint(
    storage: Storage, key: str, where: str, expected: Any | None, problems: list[str], warnings: list[str]
) -> tuple[Manifest | None, list[_Task]]:
    prefix = f"{key}/" if key else ""
    try:
        data = storage.read_bytes(f"{prefix}{MANIFEST_NAME}")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        problems.append(f"{where}/{MANIFEST_NAME}: missing (not a committed txckpt checkpoint)")
        return None, []
    except SpecialFileError as e:
        problems.append(f"{where}/{MANIFEST_NAME}: a {e.kind}, not a regular file (not read)")
        return None, []
    try:
        manifest = read_manifest_at(storage, key, Manifest.decode(data, f"{where}/{MANIFEST_NAME}"), where)
    except ManifestError as e:
        problems.append(str(e))
        return None, []
    if expected is not None:
        if manifest.txid != expected.txid:
            problems.append(f"{where}/{MANIFEST_NAME}: names txid {manifest.txid}, the log expects {expected.txid}")
            return None, []
        if manifest.digest != expected.digest:
            problems.append(
                f"{where}/{MANIFEST_NAME}: differs from the manifest the log committed "
                f"(digest {manifest.digest}, committed {expected.digest}): replaced after the commit"
            )
    tasks = [
        _Task(storage, f"{prefix}{name}", f"{where}/{name}", entry) for name, entry in sorted(manifest.files.items())
    ]
    try:
        listed = {name for name, _ in storage.walk_files(key)}
        extra = sorted(listed - set(manifest.files) - {MANIFEST_NAME} - set(manifest.meta_files()))
        if extra:
            warnings.append(
                f"{where}: {len(extra)} file(s) not in the manifest (added after the commit?): "
                + ", ".join(extra[:10])
                + (" ..." if len(extra) > 10 else "")
            )
    except OSError:
        pass
    return manifest, tasks


def run_verify(
    target: str,
    options: dict[str, Any],
    *,
    workers: int | None = None,
    progress: bool = False,
    include_abandoned: bool = True,
) -> dict[str, Any]:
    """Verify a root (every committed checkpoint that is not retired) or one checkpoint."""
    storage = open_storage(target, options)
    problems: list[str] = []
    warnings: list[str] = []
    tasks: list[_Task] = []
    checked: list[dict[str, Any]] = []
    if not is_url(target) and not os.path.isdir(target):
        raise UsageError(f"{target} is not a directory")
    if storage.exists(MANIFEST_NAME) or (
        names_a_checkpoint(target, options) and not storage.exists(META_DIR) and not storage.list_dir(LOG_DIR)
    ):
        manifest, t = _plan_checkpoint(storage, "", target.rstrip("/"), None, problems, warnings)
        tasks += t
        if manifest is not None:
            checked.append({"path": target, "step": manifest.step, "txid": manifest.txid, "files": len(t)})
        kind = "checkpoint"
    else:
        root = open_root_arg(target, options)
        kind = "root"
        try:
            # An audit reads every entry (a fresh process's lookups and retention may start from
            # a history snapshot and never read old entries again: damage there shows up here).
            history = commit_log.read_history(root.storage, snapshots=False)
        except TxckptError as e:
            problems.append(str(e))
            history = None
        if history is not None:
            try:
                quick = commit_log.read_history(root.storage)
            except TxckptError as e:
                problems.append(str(e))
            else:
                if quick.base_seq >= 0 and quick.state.seq == history.state.seq and not quick.folds_like(history):
                    problems.append(
                        f"the history snapshot of log entry {quick.base_seq} disagrees with the log; "
                        "delete .txckpt/snapshots/ (snapshots only save reading the log)"
                    )
        if history is not None and history.state.seq < 0:
            legacy = root.legacy_checkpoints()
            if legacy:
                warnings.append(
                    f"{root.url} has no txckpt log: its {len(legacy)} legacy checkpoint(s) carry no "
                    "checksums to verify; `txckpt adopt` records them"
                )
        elif history is not None:
            current = {c.txid for c in history.in_view(None)}
            for c in sorted(history.checkpoints.values(), key=lambda c: (c.step, c.seq)):
                if c.txid in history.retired or (not include_abandoned and c.txid not in current):
                    continue
                key = root.publication.locate(c.ref)
                label = f"step {c.step} (lineage {c.lineage}, txid {c.txid})"
                if key is None:
                    problems.append(
                        f"{label}: committed, but its data is missing from {root.url} "
                        "(no manifest naming it at checkpoint-N or its home)"
                    )
                    continue
                manifest, t = _plan_checkpoint(root.storage, key, root.storage.full_path(key), c, problems, warnings)
                tasks += t
                checked.append(
                    {
                        "path": root.storage.full_path(key),
                        "step": c.step,
                        "txid": c.txid,
                        "lineage": c.lineage,
                        "state": "current" if c.txid in current else "abandoned",
                        "files": len(t),
                    }
                )
    total = sum(t.entry.size for t in tasks)
    workers = workers or min(8, max(2, 2 * (os.cpu_count() or 1)))
    read = 0
    with progress_bar("verify", total=total, enabled=progress) as bar, ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_check_file, t) for t in tasks]
        for done in as_completed(futures):  # the bar moves as each file finishes, in any order
            bar.update(done.result()[0])
        for size, problem in (f.result() for f in futures):  # problems in the files' order
            read += size
            if problem:
                problems.append(problem)
    return {
        "target": target,
        "kind": kind,
        "checkpoints": checked,
        "files": len(tasks),
        "bytes": read,
        "problems": problems,
        "warnings": warnings,
        "ok": not problems,
    }


def cmd_verify(args: argparse.Namespace) -> int:
    started = time.monotonic()
    progress = bar_wanted(args.no_progress, args.json)
    result = run_verify(args.target, args.storage_options, workers=args.workers, progress=progress)
    result["seconds"] = round(time.monotonic() - started, 3)
    if args.json:
        print_json(result)
    else:
        for w in result["warnings"]:
            print(f"warning: {w}")
        for p in result["problems"]:
            print(f"PROBLEM: {p}")
        n = len(result["checkpoints"])
        verdict = "OK" if result["ok"] else f"{len(result['problems'])} problem(s)"
        print(
            f"verified {n} checkpoint(s), {result['files']} file(s), {human_bytes(result['bytes'])} "
            f"in {result['seconds']:.2f}s: {verdict}"
        )
    return EXIT_OK if result["ok"] else EXIT_PROBLEM
