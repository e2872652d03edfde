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
    id="KI-fence",
    title="A restarted job does not fence the job it replaces: the zombie keeps committing into the current lineage",
    where="txckpt/root.py: CheckpointRoot.resume (step=None) and CheckpointRoot.prepare_save",
    scenario=("Job Z saves 2 and 4. Its restart R (resume_from_checkpoint=True, i.e. txckpt.resume(root)) "
              "resumes 4 and saves 6 while Z still runs. Z's save of 8 commits into the current lineage on top "
              "of R's 6 (its plan's parent is the tip it reads, R's 6), and R's own save of 8 then fails with "
              "StepConflictError: the stale job wins, the live one dies, and the lineage interleaves two "
              "processes' states. Only a rollback (a fork) fences a zombie today."),
    fix=("Give the head lineage a writer epoch: resume() (and the first save of a process) appends a small "
         "'claim' entry (or a fork whose parent is the tip: same view, new lineage id) and remembers it; "
         "State.after_commit refuses a commit whose epoch is not the newest with StaleLineageError. One log "
         "entry per restart; readers are unaffected."),
    reproducer="test_zombie_beside_its_restart_is_fenced",
    pattern=r"\[zombie\] (the stale writer|the restarted job's save)",
))

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
    id="KI-dirsync",
    title="A power cut after the commit can lose the committed checkpoint: the directories a save creates are never fsynced",
    where=("txckpt/transactions.py: Transaction._commit (durable branch); txckpt/storage/local.py: "
           "LocalStorage.open_write / create_exclusive (os.makedirs without fsyncing the new directories' parents)"),
    scenario=("POSIX makes a directory entry durable once its directory is fsynced. A save fsyncs its files and "
              "the staging directory .txckpt/tx/<txid>/checkpoint-N, but never .txckpt/tx/<txid> (holding the entry "
              "checkpoint-N) nor .txckpt/tx (holding <txid>). Its commit entry is linked and log/ fsynced (step 9), "
              "then publication renames the directory and fsyncs the root (step 10). A power cut between the two "
              "keeps the commit and loses the data: lookup falls back to the previous checkpoint with a 'deleted by "
              "hand?' warning, or, on a new root (root, .txckpt, .txckpt/log are new and unsynced too), returns "
              "None. protocol.md section 8 says the entries naming the checkpoint are durable before step 9. In "
              "the ordered-metadata model (ext4 data=ordered, xfs: any fsync commits every earlier metadata "
              "operation) the campaign finds no violation."),
    fix=("Before the commit point, fsync every directory the save created, bottom-up to the first that already "
         "existed: .txckpt/tx/<txid> and .txckpt/tx, and on a new root .txckpt/log, .txckpt, the root and its "
         "parent. LocalStorage can remember which directories its makedirs created and fsync their parents in "
         "sync_dir/create_exclusive; Transaction._commit then calls sync_dir on the staging key's ancestors."),
    reproducer="test_power_cut_after_commit_keeps_the_checkpoint",
    pattern=r"^posix: .*(is committed but its data is missing|\[commit durable\]: \[lookup\])",
))

register(KnownIssue(
    id="KI-log-unprotected",
    title="Log entries carry no checksum: one flipped byte in an old entry makes gc delete a committed checkpoint",
    where="txckpt/log.py: _decode / read_entry; txckpt/lineage.py: History.apply; txckpt/gc.py: collect_garbage (staging)",
    scenario=("A bit flip inside the txid of an abandoned checkpoint's commit entry still parses. The history "
              "then has the wrong txid, so gc takes the checkpoint's home .txckpt/tx/<txid> for a crashed writer's "
              "staging without an intent and deletes it: the data of a committed checkpoint, silently. Flips inside "
              "key names raise an untyped KeyError from lookup, history or gc instead of LogCorruptError."),
    fix=("Give every entry a digest of its canonical JSON (as manifests have) and check it in log._decode, raising "
         "LogCorruptError; validate the entry's structure there too. Defence in depth: gc should not delete a "
         "directory under .txckpt/tx that holds a manifest whose digest verifies without a reason stronger than "
         "'no intent' (e.g. only once the intent is known to have existed, or after a grace period)."),
    reproducer="test_flipped_byte_in_a_log_entry_is_detected",
    pattern=r"^log/.*(\[deleted\]|\[untyped\])",
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
         "for writers on other hosts."),
    reproducer="test_gc_keeps_a_live_writers_staging_when_its_clock_is_behind",
    pattern=r"\[clock\] gc removed the staging of a live writer",
))

register(KnownIssue(
    id="KI-commit-missing",
    title="A save whose staging was deleted under it still commits, with a manifest naming missing files",
    where=("txckpt/transactions.py: Transaction._commit; txckpt/storage/local.py: LocalStorage.create_exclusive "
           "(os.makedirs re-creates the deleted staging directory)"),
    scenario=("gc (KI-gc-clock, or a remote writer whose save outlives the grace period) or an operator removes a "
              "save's staging while it runs. _commit trusts the files the ranks reported, create_exclusive "
              "re-creates the directory for the manifest, the commit entry is appended: the save returns a "
              "committed checkpoint whose files are missing, and load raises IntegrityError."),
    fix=("In _commit, check that every reported file exists with its reported size (walk_files already lists "
         "the staging) before the manifest is written, and abort with TransactionAbortedError otherwise; write "
         "the manifest without makedirs (the staging directory must already exist)."),
    reproducer="test_commit_refuses_when_the_staging_vanished",
    pattern=r"\[clock\] the writer's save returned .* but it does not verify",
))

register(KnownIssue(
    id="KI-storage-untyped",
    title="ENOSPC or EROFS before the staging exists surfaces as a plain OSError, not StorageError",
    where=("txckpt/transactions.py: Transaction.__enter__ (prepare_save, write_intent, the staging makedirs); "
           "txckpt/root.py: CheckpointRoot._fork / new_lineage (the log appends of a first save and of a fork)"),
    scenario=("A full disk, or a read-only root, when a save writes its intent or makes its staging directory, "
              "when the first save on a root appends its lineage entry, or when resume(step=K) appends the fork "
              "entry: the caller gets OSError(ENOSPC/EROFS) instead of txckpt.errors.StorageError and its advice. "
              "Nothing is committed or lost (the campaign checks that)."),
    fix=("Convert with errors.storage_error(e, what) there, as Transaction.save already does for file writes: "
         "around prepare_save/write_intent and the makedirs in Transaction.__enter__, and around "
         "commit_log.append in CheckpointRoot._fork and adopt."),
    reproducer="test_enospc_writing_the_intent_is_a_storage_error",
    pattern=(r"\[enospc\] the operation raised an untyped OSError|\[untyped\] (save|resume\(step=2\)) on a "
             r"read-only root"),
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
    id="KI-log-rollback",
    title="A deleted (or lost) newest log entry silently rolls the root back to the previous state",
    where="txckpt/log.py: read_latest (the hint names a missing entry: it lists the log and goes on, silently)",
    scenario=("The newest entry (B-4's commit) is deleted. The `latest` hint still names it; read_latest sees the "
              "entry missing, lists log/ and takes the highest remaining entry without a word: lookup returns the "
              "previous tip (A-2) with no warning, although checkpoint-4 is published and its manifest verifies. "
              "The next save then reuses the lost entry's seq, and B-4 is never seen again by the log."),
    fix=("The hint is written after its entry and entries are never deleted, so a hint ahead of the log means an "
         "entry vanished: log a warning naming the missing seq and `txckpt verify` (or raise LogCorruptError for "
         "writers, so a save cannot reuse the seq); `txckpt verify` can also flag published checkpoint-N whose "
         "manifest names a txid the log does not know."),
    reproducer="test_a_deleted_newest_log_entry_is_not_silent",
    pattern=r"^log/newest: delete: \[silent\]",
))
