"""``txckpt gc``, ``adopt`` and ``resume``: the commands that change a root."""

from __future__ import annotations

import argparse

from .._api import verify_checkpoint
from ..errors import CheckpointNotFoundError, IntegrityError
from .._maintenance.gc import collect_garbage
from .._log.lineage import History
from .._manifest.manifest import Manifest
from .._base.progress import bar as progress_bar, bar_wanted
from .._maintenance.retention import RetentionPolicy
from .._root.root import CheckpointRoot
from .common import EXIT_OK, EXIT_PROBLEM, human_bytes, open_root_arg, print_json


# ----- gc ------------------------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    policy = None
    if args.keep_last is not None or args.keep_every is not None or args.abandoned_ttl is not None:
        policy = RetentionPolicy(
            keep_last=args.keep_last,
            keep_every=args.keep_every,
            keep_best=args.keep or [],
            abandoned="keep" if args.abandoned_ttl is None else args.abandoned_ttl,
        )
    with progress_bar("gc", enabled=not args.dry_run and bar_wanted(args.no_progress, args.json)):
        report = collect_garbage(root, dry_run=args.dry_run, grace_seconds=args.grace, policy=policy)
    if args.json:
        print_json(report.to_json())
        return EXIT_PROBLEM if report.errors else EXIT_OK
    verb_remove = "would remove" if args.dry_run else "removed"
    for item in report.items:
        if item.kind in ("publish", "unpublish"):
            verb = (
                ("would " + item.kind) if args.dry_run else (item.kind + "ed" if item.done else item.kind + " FAILED")
            )
        elif item.kind == "policy":
            verb = "would remove" if args.dry_run else ("removed" if item.done else "kept")
        else:
            verb = verb_remove if (args.dry_run or item.done) else "FAILED to remove"
        size = f"  {human_bytes(item.bytes)}" if item.bytes else ""
        if item.held:  # hard links of live checkpoints keep these bytes: removing the item frees none of them
            size += f"{'' if size else '  0 B'} (+{human_bytes(item.held)} held by other links)"
        err = f"  [{item.error}]" if item.error else ""
        print(f"{verb:<16} {item.kind:<9} {item.key}{size}  ({item.reason}){err}")
    for item in report.kept:
        print(f"{'kept':<16} {item.kind:<9} {item.key}  ({item.reason})")
    for o in report.orphans:
        print(
            f"{'orphan (kept)':<16} {'orphan':<9} {o}  (moved aside by txckpt; inspect it, then delete "
            "it or move it back by hand)"
        )
    if not report.items:
        print("nothing to collect")
    else:
        n = len([i for i in report.items if i.kind not in ("publish", "unpublish")])
        names = [
            f"{k} checkpoint name(s) {'would be ' if args.dry_run else ''}{kind}ed"
            for kind in ("publish", "unpublish")
            if (k := sum(i.kind == kind and (args.dry_run or i.done) for i in report.items))
        ]
        held = (
            (
                f"; {human_bytes(report.held)} of their files {'would stay' if args.dry_run else 'stay'}, held by "
                "live checkpoints' links"
            )
            if report.held
            else ""
        )
        print(
            f"{n} item(s), {human_bytes(report.bytes)} {'reclaimable' if args.dry_run else 'reclaimed'}{held}"
            + "".join(f"; {x}" for x in names)
            + (f", {len(report.errors)} error(s)" if report.errors else "")
        )
    return EXIT_PROBLEM if report.errors else EXIT_OK


# ----- adopt ---------------------------------------------------------------------------------------
def cmd_adopt(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    if root.state().seq >= 0:
        msg = {"adopted": None, "message": f"{root.url} already has a txckpt log; nothing to adopt"}
    else:
        steps = root.legacy_checkpoints()
        with progress_bar("adopt", enabled=bar_wanted(args.no_progress, args.json)):  # bytes hashed
            lid = root.adopt()
        msg = {
            "adopted": lid,
            "steps": steps,
            "message": (
                f"adopted steps {', '.join(map(str, steps))} of {root.url} as lineage {lid}"
                if lid
                else f"another process adopted {root.url} first; nothing to do"
                if root.state().seq >= 0
                else "nothing to adopt"
            ),
        }
    if args.json:
        print_json(msg)
    else:
        print(msg["message"])
    return EXIT_OK


# ----- resume --------------------------------------------------------------------------------------
def cmd_resume(args: argparse.Namespace) -> int:
    root = open_root_arg(args.root, args.storage_options)
    before = root.history()
    head_before = before.state.head
    current_before = {c.txid: c for c in before.in_view(None)}
    tip = before.state.head_tip
    verified = _verify_resume_point(root, before, args) if args.step is not None else None
    if not args.json and args.step is not None:  # before the fork's warning (stderr) names what it abandons
        print(
            f"verified step {args.step}: {len(verified.files)} file(s), {human_bytes(verified.total_bytes)}, "
            "each against its checksum"
            if verified is not None
            else f"step {args.step} was NOT verified (--no-verify): a damaged file shows only when a restart loads "
            "it; `txckpt verify` checks it",
            flush=True,
        )
    if args.step is None or (tip is not None and tip.step == args.step):
        # Nothing to roll back: only say where a restart continues. root.resume() would also
        # claim the lineage for this command's session, fencing off the job that is writing
        # it (StaleLineageError at its next save); the operator's command is no writer.
        path = root.get_last_checkpoint()
    else:
        path = root.resume(args.step)
    after = root.history()
    current_after = {c.txid for c in after.in_view(None)}
    abandoned = [c for t, c in current_before.items() if t not in current_after]
    forked = after.state.head != head_before
    result = {
        "path": path,
        "head": after.state.head,
        "forked": forked,
        "previous_head": head_before,
        "abandoned": [{"step": c.step, "lineage": c.lineage, "txid": c.txid} for c in abandoned],
        "verified": verified is not None,
    }
    if args.json:
        print_json(result)
        return EXIT_OK
    if path is None:
        print(f"{root.url} has no checkpoint to resume from; training starts from scratch")
    elif forked:
        print(
            f"resumed at {path}: new lineage {after.state.head} (the current one from now on); "
            f"{len(abandoned)} checkpoint(s) of lineage {head_before} are abandoned and kept intact."
        )
        print(
            "A training job still writing this root with the old lineage will be refused "
            "(StaleLineageError) at its next save; restart it with resume."
        )
    else:
        print(f"{path} is already the newest checkpoint of the current lineage {after.state.head}; nothing changed")
    return EXIT_OK


def _verify_resume_point(root: CheckpointRoot, history: History, args: argparse.Namespace) -> Manifest | None:
    """Verify the checkpoint ``--step`` names before anything forks onto it: a rollback onto a
    damaged checkpoint makes it the current lineage's newest, which the restart then fails to
    load. Its manifest, or None with ``--no-verify``. Raises what the lookup raises (missing,
    retired) and IntegrityError for damage (exit 1), saying what to do."""
    c = history.find(step=args.step)
    if args.no_verify:
        return None
    key = root.publication.locate(c.ref)
    if key is None:
        raise CheckpointNotFoundError(
            f"step {c.step} (txid {c.txid}) is committed but its data is missing; nothing was forked. Pick "
            "another step (`txckpt ls`)"
        )
    try:
        return verify_checkpoint(root.storage.full_path(key), storage_options=args.storage_options)
    except IntegrityError as e:
        raise IntegrityError(
            f"refusing to resume at step {c.step}: it fails verification ({e}); nothing was forked. Pick "
            "another step (`txckpt ls`, `txckpt verify ROOT`), or pass --no-verify to fork onto it anyway",
            path=e.path,
        ) from e
