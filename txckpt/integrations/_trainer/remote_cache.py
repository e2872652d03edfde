"""The local cache of a Trainer whose txckpt root is remote (``txckpt_root="s3://..."``).

Upstream reads and writes checkpoints through local paths, so with a remote root the Trainer
(txckpt.integrations.transformers) works on local copies, all under one directory of the run
(``txckpt_cache_dir``, default ``<output_dir>/.txckpt-cache``):

* ``<cache>/<txid>/checkpoint-N``: verified copies of committed checkpoints (the one resumed, the
  best model loaded at the end), dropped after the run's first commit;
* ``<cache>/push/<txid>/checkpoint-N``: Hub push sources, removed once their push is done;
* ``<cache>/staging``: the transactions' local scratch directories, uploaded at commit.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import txckpt
from txckpt import errors as _errors
from txckpt._base.coordination import coordination_timeout, current_coordinator, decide_on_rank0, raise_if_any_failed

from .paths import (
    CACHE_DIR_NAME,
    PUSH_DIR_NAME,
    STAGING_DIR_NAME,
    STAGING_ENV,
    TRAINER_NAMING,
    env_var,
)

log = logging.getLogger("txckpt.transformers")


class RemoteCache:
    """The cache of one Trainer (``trainer``: its settings and ``args`` are read at each use, as
    they may be set after the Trainer is built)."""

    def __init__(self, trainer: Any):
        self._trainer = trainer
        #: Local copies made for Hub pushes, with the push job reading them.
        self.push_copies: list[tuple[str, Any]] = []
        #: The copy rank 0 fetched (and so verified) while resuming, by remote path.
        self.verified: dict[str, str] = {}

    @property
    def directory(self) -> str:
        t = self._trainer
        if t.txckpt_cache_dir is not None:
            return os.path.abspath(os.fspath(t.txckpt_cache_dir))
        return os.path.join(os.path.abspath(t.args.output_dir), CACHE_DIR_NAME)

    @property
    def _storage_options(self) -> dict[str, Any] | None:
        return self._trainer.txckpt_storage_options

    # ----- staging ---------------------------------------------------------------------------
    def make_scratch(self, tx: Any) -> None:
        """On a remote root ``tx.directory`` is a local scratch directory (uploaded at commit).
        txckpt creates it under ``$TXCKPT_STAGING_DIR``, else the system temp dir; unless the
        user chose, put it in the run's cache, next to output_dir, not in a possibly small /tmp
        (and where the next run's start removes what a hard kill left)."""
        if os.environ.get(STAGING_ENV):
            _ = tx.directory  # reading the property creates the directory
            return
        base = os.path.join(self.directory, STAGING_DIR_NAME)
        os.makedirs(base, exist_ok=True)
        with env_var(STAGING_ENV, base):
            _ = tx.directory  # created now, while the variable names the run's cache

    def clean_staging(self) -> None:
        """Remove scratch directories that a hard-killed save left in the cache's staging dir.
        Runs at train() start on each node's local rank 0, before any rank can save."""
        base = os.path.join(self.directory, STAGING_DIR_NAME)
        if os.environ.get(STAGING_ENV) or not os.path.isdir(base):
            return
        for name in os.listdir(base):
            if name.startswith("txckpt-"):
                log.info("removing the staging leftover %s", os.path.join(base, name))
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)

    # ----- Hub push sources --------------------------------------------------------------------
    def push_copy(self, remote: str) -> str:
        """Rank 0: a verified local copy of committed checkpoint ``remote`` for a Hub push, in
        ``<cache>/push/<txid>/checkpoint-N`` (the name upstream gives the pushed folder). Copies
        whose push has finished are removed first."""
        self.drop_push_copies()
        manifest = txckpt.read_manifest(remote, storage_options=self._storage_options)
        dest = os.path.join(self.directory, PUSH_DIR_NAME, manifest.txid, TRAINER_NAMING.public(manifest.step))
        return self.fetch_here(remote, dest)

    def drop_push_copies(self) -> None:
        """Remove the push sources whose upload has finished (rank 0)."""
        keep = []
        for path, job in self.push_copies:
            if job is None or job.is_done():
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            else:
                keep.append((path, job))
        self.push_copies = keep

    # ----- checkpoint copies -------------------------------------------------------------------
    def fetch_timeout(self) -> float:
        """A fetch happens between two collectives: the others wait for the download."""
        t = self._trainer
        return max(coordination_timeout(t.txckpt_timeout), float(getattr(t.args, "ddp_timeout", 0) or 0))

    def fetch_here(self, remote: str, dest: str) -> str:
        """This process's verified copy of committed checkpoint ``remote`` at ``dest`` (reused if
        it already holds the same manifest and verifies)."""
        so = self._storage_options
        if self.verified.pop(remote, None) == dest:
            return dest  # fetched and verified by this resume's fallback check: not twice
        try:
            return txckpt.fetch_checkpoint(remote, dest, storage_options=so)
        except OSError as e:
            if isinstance(e, _errors.TxckptError) or not os.path.isfile(os.path.join(dest, txckpt.MANIFEST_NAME)):
                raise
            # Another process renamed its copy into dest while this one downloaded: check that one.
            return txckpt.fetch_checkpoint(remote, dest, storage_options=so)

    def fetch_for_resume(self, path: str) -> str:
        """Rank 0, while resuming with a fallback: fetch (and so verify) ``path`` into the cache,
        remembered so that the fetch of every rank that follows does not fetch it twice."""
        m = txckpt.read_manifest(path, storage_options=self._storage_options)
        dest = os.path.join(self.directory, m.txid, TRAINER_NAMING.public(m.step))
        self.verified = {path: self.fetch_here(path, dest)}
        return path

    def fetch_committed(self, remote: str) -> str:
        """Every rank: a verified local copy of committed checkpoint ``remote`` in
        ``<cache>/<txid>/checkpoint-N``. Rank 0 reads the manifest and fetches first; then each
        other node's local rank 0; then the remaining ranks (which, on one node or a shared
        cache, find the copy and only verify it). So no two processes ever download into the
        same directory at once. Any rank's failure is raised on every rank."""
        coord = current_coordinator(self.fetch_timeout(), "fetch")

        def read() -> dict[str, Any]:
            m = txckpt.read_manifest(remote, storage_options=self._storage_options)
            return {"txid": m.txid, "step": m.step}

        info = decide_on_rank0(read, phase="fetch", coordinator=coord)
        dest = os.path.join(self.directory, info["txid"], TRAINER_NAMING.public(info["step"]))
        if coord.world_size == 1:
            return self.fetch_here(remote, dest)
        local_rank = int(getattr(self._trainer.args, "local_process_index", coord.rank))
        turns = (coord.rank == 0, coord.rank != 0 and local_rank == 0, coord.rank != 0 and local_rank != 0)
        for mine in turns:
            own: BaseException | None = None
            if mine:
                try:
                    self.fetch_here(remote, dest)
                except BaseException as e:  # noqa: BLE001 - every rank must learn it
                    own = e
            raise_if_any_failed(own, phase="fetch", coordinator=coord)
        return dest

    def drop_cached_copies(self) -> None:
        """After the first commit of a train() on a remote root, nothing reads the cache's
        checkpoint copies any more (upstream reads the resumed one before the first update step;
        the commit's collectives mean every rank is past that; an earlier run's best copy is
        stale): remove them (not staging, not push sources), on each node, then barrier so no
        rank fetches into the cache (the best model at the end) while another still removes."""
        t = self._trainer
        if int(getattr(t.args, "local_process_index", 0)) == 0:
            cache = self.directory
            for name in os.listdir(cache) if os.path.isdir(cache) else []:
                if name not in (STAGING_DIR_NAME, PUSH_DIR_NAME):
                    shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
        current_coordinator(t.txckpt_timeout, "cache cleanup").barrier()
