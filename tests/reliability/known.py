"""Known defects of the core that the campaign finds.

Each has a minimal reproducer in tests/test_reliability.py, marked ``xfail(strict=True)``: CI
stays green while the defect is open, and the day it is fixed the reproducer XPASSes, which fails
CI until the mark (and the entry here) is removed. Campaign violations matching ``pattern`` in a
case that lists the issue are reported as *known*; any other violation is new and fails CI.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownIssue:
    id: str
    title: str
    where: str  # file and function
    scenario: str
    fix: str
    reproducer: str  # test in tests/test_reliability.py
    pattern: str  # regex over violation messages


KNOWN: dict[str, KnownIssue] = {}


def register(issue: KnownIssue) -> KnownIssue:
    KNOWN[issue.id] = issue
    return issue


register(KnownIssue(
    id="KI-lease",
    title="acquire_reader_lease grants a lease on a checkpoint whose deletion has begun",
    where="txckpt/retention.py: acquire_reader_lease",
    scenario=("apply_retention appends the retire entry naming step 2, then finish_retired reads the leases "
              "(none). A reader then takes a lease on step 2 as docs/retention.md shows (acquire, then read): the "
              "lease is granted, the reader starts loading, and finish_retired deletes step 2 under it."),
    fix=("After writing the lease, read the log: if the txid is retired (or not committed), delete the lease "
         "and raise CheckpointNotFoundError. With KI-lease-order fixed, a lease that survives this check is "
         "seen by every deleter. Document that a lease is taken before reading."),
    reproducer="test_lease_is_refused_once_deletion_began",
    pattern=r"\[lease\] (acquire_reader_lease granted|rotation deleted checkpoint step 2 while a reader that had announced)",
))

register(KnownIssue(
    id="KI-lease-order",
    title="finish_retired reads the leases before the retired set, so a concurrent retirement deletes a leased checkpoint",
    where="txckpt/retention.py: finish_retired (also apply_retention's phase two)",
    scenario=("Process D (apply_retention) reads the leases (none) in finish_retired. A reader leases step 2 and "
              "checks that it is not retired. Process P (another apply_retention, which decided before the lease) "
              "appends its retire entry; its own finish_retired sees the lease and keeps step 2. D then reads the "
              "retired set, fresh, and deletes step 2 while the reader loads it."),
    fix=("In finish_retired read the history (the retired set) first and the leases after it, as "
         "collect_garbage already does; then any lease written before the deleter read the leases was either "
         "seen, or its reader's re-check happened after the retire entry and failed."),
    reproducer="test_finish_retired_reads_leases_after_the_retired_set",
    pattern=r"\[lease\] rotation deleted checkpoint step 2 while a reader holding a lease \(taken, and re-checked",
))



register(KnownIssue(
    id="KI-gc-clock",
    title="gc deletes a live writer's staging when the writer's clock was behind when it wrote its intent",
    where="txckpt/gc.py: pid_alive (the 'started > since + 2 s' pid-reuse test) and writer_status",
    scenario=("A writer on this host whose time.time() runs an hour behind (a skewed clock, or the host clock "
              "stepped forward during the save) writes an intent whose time precedes its own process start time; "
              "gc concludes the pid was reused by a newer process, calls the writer dead and deletes its staging "
              "while it is writing."),
    fix=("Record the writer's process start time (from /proc, the source gc compares with) in the intent and "
         "compare it with the pid's current start time; wall-clock intent times then only serve the grace period "
         "for writers on other hosts. Also, in Transaction._committed_path, return a path only if locate() "
         "finds the checkpoint there: when gc strikes after the commit's check of the staged files, the commit "
         "entry is appended, publication finds nothing, and the save returns the empty staging path with only "
         "a warning."),
    reproducer="test_gc_keeps_a_live_writers_staging_when_its_clock_is_behind",
    # Its consequence when gc strikes after the commit check: the save returns a path gc removed.
    pattern=r"\[clock\] (gc removed the staging of a live writer|the writer's save returned .* does not verify)",
))



register(KnownIssue(
    id="KI-publish-race",
    title="A lookup racing a publication returns the home path, which the rename then moves: load calls a healthy checkpoint damaged",
    where="txckpt/root.py: get_last_checkpoint; txckpt/api.py: load_checkpoint / verify (txckpt/verify.py)",
    scenario=("Between a save's commit entry and its rename to checkpoint-N, a reader's lookup locates the new tip "
              "at .txckpt/tx/<txid>/checkpoint-N and returns that path; the rename happens; load_checkpoint(path) "
              "raises IntegrityError '... is missing: the checkpoint is damaged' for a healthy committed "
              "checkpoint. Readers polling during saves hit it (about 1 lookup in 150 here)."),
    fix=("When a listed file or the manifest is missing under a .txckpt/tx/<txid>/checkpoint-N path, look the txid "
         "up again (publication.locate by txid and step) and read from where it is now before calling the "
         "checkpoint damaged."),
    reproducer="test_load_follows_a_checkpoint_published_after_lookup",
    pattern=r"\[reader\] the home path lookup returned moved",
))




register(KnownIssue(
    id="KI-manifest-forged",
    title="load_checkpoint trusts a manifest whose digest was recomputed after an edit (a file removed from it)",
    where="txckpt/api.py: load_checkpoint / read_manifest (the manifest is not cross-checked with its commit entry)",
    scenario=("Someone removes a file from a committed checkpoint's manifest and recomputes the manifest's own "
              "digest. load_checkpoint verifies the manifest's self-digest and the files it lists, so it loads the "
              "remaining files without a warning; the commit entry in the log recorded another digest and more files."),
    fix=("When the checkpoint's root is known (its path is <root>/checkpoint-N or <root>/.txckpt/tx/<txid>/...), "
         "cross-check the manifest digest with the commit entry (cheaply for the tip: carry the digest in the "
         "state's tip ref); `txckpt verify ROOT` already compares them."),
    reproducer="test_forged_manifest_is_refused_by_load",
    pattern=r"digest recomputed",
))


register(KnownIssue(
    id="KI-enospc-torch-save",
    title="A full disk in the middle of a torch.save surfaces as torch's RuntimeError, not StorageError",
    where="txckpt/transactions.py: Transaction.save (catches OSError only); txckpt/checksum.py: HashingWriter.write",
    scenario=("tx.save('optimizer.pt', obj) (and save_checkpoint) streams torch.save's zip writer into the staging "
              "file. When one of its writes fails with ENOSPC, torch's writer reports '[enforce fail at "
              "inline_container.cc] unexpected pos ...' as a RuntimeError, which Transaction.save lets through: the "
              "caller gets an untyped error without txckpt's 'the disk is full' advice. Nothing is committed (the "
              "campaign checks that)."),
    fix=("Have the tracked writer remember the first OSError its sink raised, and in Transaction.save, whatever "
         "the serializer raised afterwards, raise errors.storage_error(that OSError) from it."),
    reproducer="test_enospc_inside_torch_save_is_a_storage_error",
    pattern=r"\[enospc\] the operation raised an untyped RuntimeError: \[enforce fail at inline_container",
))


# =================================================================================================
# Found by this campaign and fixed in the core since: their reproducers are regression tests now.
# =================================================================================================
@dataclass(frozen=True)
class FixedIssue:
    id: str
    title: str
    fixed_in: str  # commit
    regression: str  # test in tests/test_reliability.py


FIXED: list[FixedIssue] = [
    FixedIssue("KI-adopt-fsspec", "Adopting a legacy root raised TypeError on every fsspec backend (S3, memory): "
               "adopt() passed durable= to Storage.replace, whose fsspec versions did not take it", "b04223b",
               "test_adopt_on_an_object_store"),
    FixedIssue("KI-fence", "A restarted job did not fence the job it replaced: the zombie went on committing into "
               "the current lineage (on top of the restart's checkpoints), and the restart then failed", "0bc51e7",
               "test_zombie_beside_its_restart_is_fenced"),
    FixedIssue("KI-dirsync", "A power cut between the commit entry's fsync and the publication could lose a "
               "committed checkpoint's data (posix model): the directories a save creates were never fsynced",
               "0bc51e7", "test_power_cut_after_commit_keeps_the_checkpoint"),
    FixedIssue("KI-log-unprotected", "Log entries had no checksum: one flipped bit in an abandoned checkpoint's commit "
               "entry made gc delete that checkpoint's data; flips in key names raised KeyError", "0bc51e7",
               "test_flipped_byte_in_a_log_entry_is_detected"),
    FixedIssue("KI-log-rollback", "A deleted newest log entry silently rolled the root back to the previous state",
               "0bc51e7", "test_a_deleted_newest_log_entry_is_not_silent"),
    FixedIssue("KI-commit-missing", "A save whose staging was removed under it (by gc or by hand) still committed a "
               "manifest naming missing files", "0bc51e7", "test_commit_refuses_when_the_staging_vanished"),
    FixedIssue("KI-storage-untyped", "ENOSPC/EROFS while writing the intent or appending a lineage or fork entry "
               "was a plain OSError (the rest is KI-enospc-staging-fork)", "0bc51e7",
               "test_enospc_writing_the_intent_is_a_storage_error"),
    FixedIssue("KI-enospc-staging-fork", "ENOSPC making a save's staging directory, or while a fork unpublished, was a "
               "plain OSError", "049cbca", "test_enospc_making_the_staging_directory_is_a_storage_error"),
    FixedIssue("KI-log-shortened", "gc acted on a log that had lost its newest entry and deleted that commit's "
               "checkpoint as a leftover", "049cbca", "test_a_deleted_newest_log_entry_is_not_silent"),
]
