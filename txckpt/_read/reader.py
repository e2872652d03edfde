"""Reading a committed checkpoint by its path.

A path that get_last_checkpoint (or ``txckpt ls``) returned lies inside a root, at its public
name ``<root>/checkpoint-N`` or at its home ``<root>/.txckpt/tx/<txid>/checkpoint-N``. Knowing the
root lets a reader do two things the manifest alone cannot (docs/protocol.md §6a):

* **cross-check** the manifest with the log: the digest the commit entry recorded must equal the
  manifest's (a manifest edited and re-digested, copied from another root, or left by a save
  that never committed is refused);
* **follow** a checkpoint that moved between the lookup and the read: on rename backends a
  commit is published (home -> public name) and a fork unpublishes (public name -> home) while
  other processes read. The txid does not change, so the reader locates it again and re-reads.

A path outside any root (a fetched copy in a cache, a directory copied elsewhere) is checked
against its own manifest only.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from .._base import fileio
from .._log import log as commit_log
from ..errors import (
    CheckpointNotFoundError,
    IntegrityError,
    InvalidArgumentError,
    ManifestError,
    NotACheckpointError,
)
from .._save.incremental import distrust
from .._base.layout import LOG_DIR, TX_DIR, is_url, parse_checkpoint_name
from .._log.lineage import State
from .._base.layout import MANIFEST_NAME
from .._manifest.manifest import Manifest, read_manifest_at
from .._base.naming import DEFAULT as DEFAULT_NAMING, read_naming, split_public
from .._base.progress import Timer
from .._base.refs import Ref
from .._maintenance.retention import retired_error_at
from .._root.root import CheckpointRoot, open_root
from .._save.serialization import read_object
from .._save.grouped import grouped_request, merge_grouped
from .._storage import open_storage
from .._storage.base import Storage, join
from .._manifest.verify import FALLBACK_HINT, DecodeFailed, load_checkpoint_files, verify_checkpoint_files

T = TypeVar("T")

_HOME_RE = re.compile(r"^(?P<root>.*)/" + re.escape(TX_DIR) + r"/(?P<txid>[^/]+)/(?P<name>[^/]+)$")


@dataclass(frozen=True)
class RootPath:
    """Where a checkpoint path lies: its root, its key in the root, its step and (for a home
    path) the txid the path names."""

    root: str
    key: str
    step: int
    txid: str | None


def parse(path: str | os.PathLike) -> RootPath | None:
    """The root a checkpoint path lies in, judged by its shape alone (None: no root shape)."""
    p = os.fspath(path)
    if not is_url(p):
        p = os.path.abspath(os.path.expanduser(p))  # as LocalStorage reads it
    p = p.rstrip("/")
    m = _HOME_RE.match(p)
    step = parse_checkpoint_name(m.group("name")) if m else None
    if m and m.group("root") and step is not None:
        return RootPath(m.group("root"), f"{TX_DIR}/{m.group('txid')}/{m.group('name')}", step, m.group("txid"))
    # ``<root>/<prefix><step>``: checkpoint-N, or a root's own naming (txckpt/_base/naming.py), checked
    # against the root's naming once the root is open. No prefix starts with '.' (check_prefix).
    head, _, name = p.rpartition("/")
    split = split_public(name) if not name.startswith(".") else None
    if head and split is not None:
        return RootPath(head, name, split[1], None)
    return None


def enclosing_root(path: str | os.PathLike) -> str | None:
    """The directory that would be the root of the checkpoint directory ``path``: the root its
    shape names (:func:`parse`), else its parent (a directory put into a root by hand, say a
    copy). The caller checks that it has a log."""
    where = parse(path)
    if where is not None:
        return where.root
    p = os.fspath(path)
    if not is_url(p):
        p = os.path.abspath(os.path.expanduser(p))
    parts = p.rstrip("/").rsplit("/", 1)
    return parts[0] if len(parts) == 2 and parts[0] else None


def names_a_checkpoint(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``path`` has the name of a checkpoint of the directory it lies in: a home
    (``.txckpt/tx/<txid>/checkpoint-N``), or ``<prefix>N`` in the naming its parent records
    (checkpoint-N where it records none)."""
    where = parse(path)
    if where is None:
        return False
    if where.txid is not None:
        return True
    try:
        naming = read_naming(open_storage(where.root, storage_options)) or DEFAULT_NAMING
    except Exception:  # an unreadable or damaged naming file: judge by the default
        naming = DEFAULT_NAMING
    return naming.step_of(where.key) == where.step


class RootContext:
    """A checkpoint path's root, opened, when that root has a log: the root's storage (the one
    storage a read opens: the checkpoint is read through it, at its key), and the log's newest
    state. The process's :class:`~txckpt._root.root.CheckpointRoot` (its folded history, its
    publication) is asked only where that state is not enough: an older checkpoint's commit,
    a checkpoint that moved, one that retention retired."""

    def __init__(
        self, where: RootPath, storage: Storage, state: State, storage_options: Mapping[str, Any] | None = None
    ):
        self.where = where
        self.storage = storage
        self.state = state  # its newest State, read when the context was opened
        self.storage_options = storage_options
        self._root: CheckpointRoot | None = None
        self.prefetched_manifest: bytes | None = None  # the path's manifest, read beside the log

    @property
    def root(self) -> CheckpointRoot:
        """The process's (cached) CheckpointRoot of this root, opened on first use."""
        if self._root is None:
            self._root = open_root(self.where.root, self.storage_options)
        return self._root

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        storage_options: Mapping[str, Any] | None,
        *,
        check_name: bool = True,
        prefetch_manifest: bool = False,
    ) -> "RootContext | None":
        """The context of ``path``'s root, or None when ``path`` lies in none: no root shape, no
        log, or (``check_name``) not a home or a public name in the root's naming. Without
        ``check_name`` the caller asks :meth:`names_a_checkpoint` itself, when it must.

        ``prefetch_manifest``: where each read is a round trip (``Storage.overlap_requests``),
        the path's manifest is read beside the log (:attr:`prefetched_manifest`, None if that
        read failed: the caller's own read then says why). Which of the two lands first does
        not matter: :meth:`check_committed` compares the manifest's digest with the log's."""
        where = parse(path)
        if where is None:
            return None
        storage = open_storage(where.root, storage_options)
        prefetch = prefetch_manifest and storage.overlap_requests and where.key
        manifest = (
            storage.start_concurrently(lambda: storage.read_bytes(join(where.key, MANIFEST_NAME))) if prefetch else None
        )
        try:
            state = commit_log.read_state(storage)  # in this thread: it overlaps its own reads
        finally:
            prefetched = manifest() if manifest is not None else None  # ended, whatever happened
        if state.seq < 0:
            return None  # a directory of plain checkpoints, or a cache: no log to check against
        ctx = cls(where, storage, state, storage_options)
        ctx.prefetched_manifest = prefetched if isinstance(prefetched, bytes) else None
        return ctx if not check_name or ctx.names_a_checkpoint() else None

    def names_a_checkpoint(self) -> bool:
        """Whether the path is a home, or a public name in the root's naming: not a directory
        named otherwise and put into the root by hand (``step_4`` in a checkpoint-N root)."""
        if self.where.txid is not None:
            return True
        return (read_naming(self.storage) or DEFAULT_NAMING).step_of(self.where.key) == self.where.step

    def check_committed(self, manifest: Manifest, path: str) -> None:
        """Raise unless ``manifest`` is the one the log committed for its txid.

        The newest entry carries the head lineage's tip with its manifest digest, so
        checking the newest checkpoint (what a resume loads) costs the two reads of a lookup;
        an older one folds the log (cached and extended incrementally per process)."""
        digest = None
        for info in self.state.lineages.values():
            tip = info.tip
            if tip is not None and tip.txid == manifest.txid and tip.digest:
                digest = tip.digest
                break
        if digest is None:
            digest = self.root.history().committed_digest(manifest.txid)
        if digest is None:
            raise ManifestError(
                f"{path} holds the manifest of txid {manifest.txid}, which {self.storage.full_path('')} never "
                "committed (a save that did not finish, or a checkpoint copied from another root): "
                "load a checkpoint listed by `txckpt ls`, or copy the directory out of the root "
                "to read it on its own manifest's word"
            )
        if digest != manifest.digest:
            raise IntegrityError(
                f"{path}/{MANIFEST_NAME} is not the manifest the log committed for txid "
                f"{manifest.txid} (digest {manifest.digest}, the commit entry recorded {digest}): "
                "it was edited or replaced after the commit; the checkpoint is damaged; "
                f"{FALLBACK_HINT} (`txckpt verify` lists what else is wrong)",
                path=f"{path}/{MANIFEST_NAME}",
            )

    def moved_to(self, txid: str | None, key: str) -> str | None:
        """The key where the checkpoint of ``txid`` (default: the txid the path names) at this
        path's step is now, if not at ``key``."""
        txid = txid or self.where.txid
        if not txid:
            return None
        # The path does not say the lineage, and where a checkpoint lives does not depend on it
        # (the publication reads a ref's txid, step and key): the ref names it by txid and step.
        now = self.root.publication.locate(Ref("", self.where.step, txid))
        return None if now is None or now == key else now


# ----- the read path: one storage, the manifest checked, the checkpoint followed ---------------------
@dataclass(frozen=True)
class Found:
    """A committed checkpoint found at ``path``, its manifest checked (its own digest, and the
    log's where it lies in a root): read its files through ``storage`` at ``key`` ("" when the
    storage was opened at the checkpoint itself)."""

    path: str
    storage: Storage
    key: str
    manifest: Manifest
    manifest_bytes: bytes  # as stored: what a copy writes

    def file_key(self, name: str) -> str:
        """The key of the checkpoint's file ``name`` in :attr:`storage`."""
        return f"{self.key}/{name}" if self.key else name


def read_own_manifest(
    storage: Storage, key: str, path: str, *, whole: bool = True, data: bytes | None = None
) -> tuple[Manifest, bytes]:
    """The manifest of the checkpoint at ``key`` of ``storage`` (``path``, in messages), its own
    digest checked, and its bytes as stored. ``whole=False``: a /2 manifest's parts are left
    unread (a loading rank reads its share with ``manifest.read_rank_files``). ``data``: its
    bytes, already read from there (:attr:`RootContext.prefetched_manifest`)."""
    name = f"{key}/{MANIFEST_NAME}" if key else MANIFEST_NAME
    local = storage.local_path(name)
    try:
        if data is None and local is not None:  # on a local disk, read as txckpt._manifest.verify reads the files
            with fileio.open_regular_file(local) as f:
                data = f.read()
        elif data is None:
            data = storage.read_bytes(name)
    except (FileNotFoundError, NotADirectoryError):
        if not storage.exists(key):
            raise CheckpointNotFoundError(f"no checkpoint at {path}") from None
        if _is_a_root(storage, key):
            raise NotACheckpointError(
                f"{path} is a checkpoint root (an output_dir), not a checkpoint: load its "
                f"newest checkpoint with load_checkpoint(get_last_checkpoint({path!r})), or "
                "give one checkpoint directory (`txckpt ls ROOT` lists them)",
                path=path,
            ) from None
        raise ManifestError(
            f"{path} has no {MANIFEST_NAME}: it is not a committed txckpt checkpoint "
            "(a staging leftover, or written by another tool; `txckpt adopt` records legacy ones)"
        ) from None
    manifest = Manifest.decode(data, f"{path}/{MANIFEST_NAME}")
    return (read_manifest_at(storage, key, manifest, path) if whole else manifest), data


def _is_a_root(storage: Storage, key: str) -> bool:
    """A txckpt root (it has a log) or a legacy output_dir (it has checkpoint-N directories)."""
    if storage.list_dir(join(key, LOG_DIR)):
        return True
    # A root names its checkpoints its own way (§2); a directory inside the root read through
    # its root's storage (a checkpoint-shaped path) is judged by the default.
    naming = (read_naming(storage) if not key else None) or DEFAULT_NAMING
    return any(naming.step_of(name) is not None for name in storage.list_subdirs(key))


def read_checked(
    path: str | os.PathLike,
    storage_options: Mapping[str, Any] | None,
    attempt: Callable[[Found], T],
    *,
    whole: bool = True,
) -> T:
    """The one read path: resolve ``path`` to its root once, open one storage (the root's, or
    the checkpoint's outside a root), check the manifest, and return ``attempt(found)``, which
    reads the checkpoint's files. If that fails because the checkpoint moved since its path was
    looked up (published, or unpublished by a fork, while this process read), locate it again
    by its txid and run ``attempt`` where it is now, through the same storage: a healthy
    checkpoint is never called damaged because a rename raced the read (docs/protocol.md §6a).
    Each key is tried once. ``whole=False``: ``found.manifest`` of a /2 checkpoint holds only the
    files its manifest lists itself (:func:`read_own_manifest`)."""
    path = os.fspath(path)
    # The root's naming is asked only if the read fails: a manifest the log committed is read
    # through the root whatever the directory's name.
    ctx = RootContext.open(path, storage_options, check_name=False, prefetch_manifest=True)
    if ctx is None:
        storage, key = open_storage(path, storage_options), ""
    else:
        storage, key = ctx.storage, ctx.where.key
    tried = {key}
    prefetched = ctx.prefetched_manifest if ctx is not None else None
    while True:
        txid = None
        try:
            given, prefetched = prefetched, None  # read at the path's first key: that try only
            manifest, data = read_own_manifest(storage, key, path, whole=whole, data=given)
            txid = manifest.txid
            if ctx is not None:
                ctx.check_committed(manifest, path)
            return attempt(Found(path, storage, key, manifest, data))
        except (IntegrityError, ManifestError, CheckpointNotFoundError) as e:
            if ctx is not None and key == ctx.where.key and not ctx.names_a_checkpoint():
                # Not one of the root's names: a directory outside its checkpoints, read on its
                # own manifest's word (protocol §6a), through a storage of its own.
                ctx, storage, key = None, open_storage(path, storage_options), ""
                continue
            moved = ctx.moved_to(txid, key) if ctx is not None else None
            if ctx is None or moved is None or moved in tried:
                if ctx is not None and txid is not None and isinstance(e, IntegrityError):
                    # Damaged where it is, not moved: no incremental save of this process
                    # shares its files (a bit flip that changed no file's identity included).
                    distrust(ctx.root, [txid], [e.path])
                if ctx is not None and txid is None and isinstance(e, CheckpointNotFoundError):
                    # Nothing there: if retention retired what was, say so (not "no checkpoint").
                    # Not `from e` (B904): `or e` re-raises e itself, which would become its own cause.
                    raise retired_error_at(ctx.root, ctx.root.history(), key, path) or e  # noqa: B904
                raise
            tried.add(moved)
            key, path = moved, storage.full_path(moved)
            ctx.state = commit_log.read_state(storage)  # the log as it is now, as a fresh read sees it


def read_manifest(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The checked manifest of the checkpoint at ``path`` (:func:`txckpt.read_manifest`)."""
    return read_checked(path, storage_options, lambda found: found.manifest)


def _wanted(found: Found, names: list[str] | None) -> list[str]:
    wanted = sorted(found.manifest.files) if names is None else names
    unknown = [n for n in wanted if n not in found.manifest.files]
    if unknown:
        raise InvalidArgumentError(f"{found.path} has no file(s) {unknown}; it holds {sorted(found.manifest.files)}")
    return wanted


def verify_checkpoint(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Every file's size and checksum checked, and the manifest against the log inside a root
    (:func:`txckpt.verify_checkpoint`)."""

    def attempt(found: Found) -> Manifest:
        verify_checkpoint_files(found.storage, found.manifest, found.path, at=found.key)
        return found.manifest

    return read_checked(path, storage_options, attempt)


def _resume_verify(root: CheckpointRoot) -> Callable[[str], str]:
    """The check a load makes, applied ahead of it by ``resume(on_damaged="fallback")``: every
    file's size and checksum, and the manifest against the log (:func:`verify_checkpoint`).
    Handed to the root (txckpt/_root/fallback.py), which sits below this module."""

    def verify(path: str) -> str:
        verify_checkpoint(path, storage_options=root.storage_options or None)
        return path

    return verify


CheckpointRoot.default_verify = _resume_verify


def load(
    path: str | os.PathLike,
    *,
    files: list[str] | None,
    map_location: Any,
    storage_options: Mapping[str, Any] | None,
    weights_only: bool,
    verify: bool,
    mmap: bool,
) -> dict[str, Any]:
    """:func:`txckpt.load_checkpoint`: read each file once, check it, decode it."""
    names = None if files is None else list(files)
    timer = Timer("load", os.fspath(path))
    decode = functools.partial(read_object, map_location=map_location, weights_only=weights_only)
    # Decoders that are safe on bytes nobody checked yet: they start while the hash ends, and
    # nothing they produce is returned unless it matched. An unrestricted pickle
    # (weights_only=False) runs code: it is decoded only once its file is checked.
    early = ("safetensors", "torch") if weights_only else ("safetensors",)

    def attempt(found: Found) -> tuple[Found, list[str], dict[str, tuple[bool, Any]]]:
        timer.label = f"step {found.manifest.step}"
        timer.phase("manifest")
        wanted = _wanted(found, names if names is None else grouped_request(found.manifest.files, names))
        return (
            found,
            wanted,
            load_checkpoint_files(
                found.storage,
                found.manifest,
                found.path,
                names=wanted,
                verify=verify,
                early=early,
                decode=decode,
                mmap=mmap,
                at=found.key,
            ),
        )

    found, wanted, loaded = read_checked(path, storage_options, attempt)
    manifest = found.manifest
    nbytes = sum(manifest.files[n].size for n in wanted)
    # "data": reading, checking and, for the files decoded on the way, decoding; "decode": the
    # files decoded only once checked.
    timer.phase("data", nbytes)
    out = {}
    for n in wanted:
        decoded, value = loaded[n]
        if isinstance(value, DecodeFailed):
            # Raised only once the file's hash matched (a damaged file is reported as damaged),
            # and after the read: a file that does not decode is not a checkpoint that moved
            # while it was read (read_checked looks for those).
            raise value.error
        out[n] = value if decoded else decode(n, manifest.files[n].kind, value, where=f"{found.path.rstrip('/')}/{n}")
    # A grouped save's shards (txckpt._save.grouped) come back as the one file they were saved
    # as, unless the caller named the shards or their index.
    for n in [n for n in out if n.endswith(".safetensors.index.json")]:
        merged = merge_grouped(n, out[n], out)
        if merged is not None and (names is None or merged[0] in names):
            for shard in (n, *merged[2]):
                del out[shard]
            out[merged[0]] = merged[1]
    timer.phase("decode")
    timer.done("loaded", nbytes, len(wanted), os.fspath(path))
    return out
