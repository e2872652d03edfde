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
    FixedIssue(
        "KI-publish-race",
        "A lookup racing a publication returned the home path, which the rename then "
        "moved: load_checkpoint called a healthy checkpoint damaged (readers now follow the txid, "
        "protocol §6a)",
        "29cfd65",
        "test_load_follows_a_checkpoint_published_after_lookup",
    ),
    FixedIssue(
        "KI-manifest-forged",
        "load_checkpoint trusted a manifest re-digested after an edit (a file removed "
        "from it); the manifest is now cross-checked with the digest its commit entry recorded "
        "(protocol §6a)",
        "29cfd65",
        "test_forged_manifest_is_refused_by_load",
    ),
    FixedIssue(
        "KI-adopt-fsspec",
        "Adopting a legacy root raised TypeError on every fsspec backend (S3, memory): "
        "adopt() passed durable= to Storage.replace, whose fsspec versions did not take it",
        "b04223b",
        "test_adopt_on_an_object_store",
    ),
    FixedIssue(
        "KI-fence",
        "A restarted job did not fence the job it replaced: the zombie went on committing into "
        "the current lineage (on top of the restart's checkpoints), and the restart then failed",
        "0bc51e7",
        "test_zombie_beside_its_restart_is_fenced",
    ),
    FixedIssue(
        "KI-dirsync",
        "A power cut between the commit entry's fsync and the publication could lose a "
        "committed checkpoint's data (posix model): the directories a save creates were never fsynced",
        "0bc51e7",
        "test_power_cut_after_commit_keeps_the_checkpoint",
    ),
    FixedIssue(
        "KI-log-unprotected",
        "Log entries had no checksum: one flipped bit in an abandoned checkpoint's commit "
        "entry made gc delete that checkpoint's data; flips in key names raised KeyError",
        "0bc51e7",
        "test_flipped_byte_in_a_log_entry_is_detected",
    ),
    FixedIssue(
        "KI-log-rollback",
        "A deleted newest log entry silently rolled the root back to the previous state",
        "0bc51e7",
        "test_a_deleted_newest_log_entry_is_not_silent",
    ),
    FixedIssue(
        "KI-commit-missing",
        "A save whose staging was removed under it (by gc or by hand) still committed a manifest naming missing files",
        "0bc51e7",
        "test_commit_refuses_when_the_staging_vanished",
    ),
    FixedIssue(
        "KI-storage-untyped",
        "ENOSPC/EROFS while writing the intent or appending a lineage or fork entry "
        "was a plain OSError (the rest is KI-enospc-staging-fork)",
        "0bc51e7",
        "test_enospc_writing_the_intent_is_a_storage_error",
    ),
    FixedIssue(
        "KI-enospc-staging-fork",
        "ENOSPC making a save's staging directory, or while a fork unpublished, was a plain OSError",
        "049cbca",
        "test_enospc_making_the_staging_directory_is_a_storage_error",
    ),
    FixedIssue(
        "KI-log-shortened",
        "gc acted on a log that had lost its newest entry and deleted that commit's checkpoint as a leftover",
        "049cbca",
        "test_a_deleted_newest_log_entry_is_not_silent",
    ),
    FixedIssue(
        "KI-lease",
        "acquire_reader_lease granted a lease on a checkpoint whose retire entry already existed "
        "(its deletion had begun): the reader started loading and the checkpoint was deleted under it",
        "a0efc6d",
        "test_lease_is_refused_once_deletion_began",
    ),
    FixedIssue(
        "KI-lease-order",
        "finish_retired (apply_retention's phase two) read the leases before the retired set: "
        "a lease taken between the two reads was missed and its checkpoint deleted",
        "a0efc6d",
        "test_finish_retired_reads_leases_after_the_retired_set",
    ),
    FixedIssue(
        "KI-gc-clock",
        "gc deleted a live writer's staging when the writer's clock was behind (the pid-reuse "
        "test compared the pid's start time with the intent's wall-clock time); and a save whose staging was "
        "removed after the commit check returned the empty staging path",
        "7e60a54",
        "test_gc_keeps_a_live_writers_staging_when_its_clock_is_behind",
    ),
    FixedIssue(
        "KI-enospc-torch-save",
        "A full disk in the middle of a torch.save surfaced as torch's RuntimeError "
        "('unexpected pos'), not StorageError",
        "2ef5ec5",
        "test_enospc_inside_torch_save_is_a_storage_error",
    ),
    FixedIssue(
        "KI-lookup-outpaced",
        "A reader's lookup returned None on a root full of committed checkpoints when "
        "the writer saved and rotated (keep_last) between the reader's read of the log and its read of the "
        "tip, which retention had deleted (protocol §6 step 4)",
        "98c760d",
        "test_lookup_is_not_none_when_rotation_deletes_the_tip_it_read",
    ),
    FixedIssue(
        "KI-fold-hint-race",
        "A fold of the history (a reader polling lookup + load on S3) raised "
        "LogCorruptError ('latest names log entry N+1, but the log ends at N') when a writer committed "
        "between the fold's last probe and its read of the latest hint: the hint is now read first "
        "(protocol §4a)",
        "e463833",
        "test_a_commit_landing_while_the_history_is_folded_is_not_taken_for_lost_entries",
    ),
]
