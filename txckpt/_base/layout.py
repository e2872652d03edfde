"""Every name txckpt writes under a root (docs/protocol.md §2 is the same list, in prose).

This module is the one place that knows them: the ``.txckpt/*`` keys, a checkpoint's home and
its fixed ``checkpoint-N`` name, intents, reader leases, orphans, the ``retiring-<rnd>`` a
deletion moves a checkpoint to, and the temp-file names of the storage's atomic writes. It
imports nothing of txckpt, so every module may use it.

Two things are *not* here: a root's configurable public name (``<prefix><step>``; the prefix is
the root's, recorded in ``.txckpt/naming``) is :mod:`txckpt._base.naming`'s, which parses it with
:func:`parse_step` as this module parses ``checkpoint-N``; and where a committed checkpoint is
*now* (its home, its public name, an adopted key) is :mod:`txckpt._log.publication`'s. No module but
these two forms or parses a checkpoint name (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import os
import re
import time
import uuid

META_DIR = ".txckpt"
LOG_DIR = f"{META_DIR}/log"
LATEST_HINT = f"{META_DIR}/latest"
SNAPSHOT_DIR = f"{META_DIR}/snapshots"
NAMING_KEY = f"{META_DIR}/naming"
TX_DIR = f"{META_DIR}/tx"
INTENTS_DIR = f"{META_DIR}/intents"
READERS_DIR = f"{META_DIR}/readers"
ORPHANS_DIR = f"{META_DIR}/orphans"
RESERVE_KEY = f"{META_DIR}/reserve"

#: The manifest's name inside a checkpoint directory (the only txckpt file there).
MANIFEST_NAME = "txckpt-manifest.json"
#: Homes are always ``checkpoint-N``; it is also the public name of a root without ``.txckpt/naming``.
CHECKPOINT_PREFIX = "checkpoint-"
#: Intents of adopters (``intents/adopt-<L>.<session>.json``) and txids of adopted checkpoints.
ADOPT_INTENT_PREFIX = "adopt-"
ADOPTED_TXID_PREFIX = "adopted-"
#: Steps are ints with 0 <= step < 2**63 (protocol §3); a name with a larger number is no checkpoint.
MAX_STEP = 2**63
_MAX_STEP_DIGITS = len(str(MAX_STEP - 1))

#: Directories whose interrupted create-if-absent and replace writes leave ``*.tmp`` files.
TEMP_DIRS = (META_DIR, LOG_DIR, INTENTS_DIR, READERS_DIR, SNAPSHOT_DIR)
#: Temp files of the storage's atomic writes of ``NAME`` (``txckpt/_storage/local/store.py``):
#: ``.NAME.<12 hex>.tmp`` (create-if-absent, linked into place) and ``NAME.<12 hex>.tmp`` (replace).
_TEMP_RE = re.compile(r"^\.?(?P<name>.+)\.[0-9a-f]{12}\.tmp$")


def parse_step(digits: str) -> int | None:
    """The step that ``digits`` (ASCII digits, zero padding allowed: ``00500`` is 500) names;
    None for anything else, and for a number no step can be (>= 2**63: such a directory is not a
    checkpoint, and is never parsed into an int of thousands of digits)."""
    if not (digits.isascii() and digits.isdigit()):
        return None
    significant = digits.lstrip("0") or "0"
    if len(significant) > _MAX_STEP_DIGITS:
        return None
    step = int(significant)
    return step if step < MAX_STEP else None


def parse_checkpoint_name(name: str, prefix: str = CHECKPOINT_PREFIX) -> int | None:
    """N if ``name`` is ``<prefix>N`` (default ``checkpoint-N``; ``checkpoint-00500`` is 500),
    else None: the one parse of a checkpoint's directory name."""
    return parse_step(name[len(prefix) :]) if name.startswith(prefix) else None


def checkpoint_name(step: int) -> str:
    """``checkpoint-<step>``: a home's directory name (and the default public name)."""
    return f"{CHECKPOINT_PREFIX}{step}"


def entry_key(seq: int) -> str:
    return f"{LOG_DIR}/{seq:020d}.json"


def snapshot_key(seq: int) -> str:
    return f"{SNAPSHOT_DIR}/{seq:020d}.json"


def new_txid(step: int, lineage: str) -> str:
    """A save attempt's txid: ``<step>-<lineage>-<10 hex>`` (adopted checkpoints: :func:`adopted_txid`)."""
    return f"{step}-{lineage}-{uuid.uuid4().hex[:10]}"


def tx_key(txid: str) -> str:
    """``.txckpt/tx/<txid>``: what a save stages under, and what holds a checkpoint's home."""
    return f"{TX_DIR}/{txid}"


def home_key(txid: str, step: int) -> str:
    """``.txckpt/tx/<txid>/checkpoint-N``: where a save writes, and a committed checkpoint's
    place whenever it does not hold its public name."""
    return f"{TX_DIR}/{txid}/{checkpoint_name(step)}"


def txid_of_tx_key(key: str) -> str | None:
    """The txid of a key under ``.txckpt/tx/<txid>/...``; None for a key elsewhere."""
    if not key.startswith(TX_DIR + "/"):
        return None
    return key[len(TX_DIR) + 1 :].split("/", 1)[0] or None


def retiring_key(txid: str) -> str:
    """``.txckpt/tx/<txid>/retiring-<rnd>``: where a deletion moves a published (or adopted)
    checkpoint out of sight before deleting it (protocol §11)."""
    return f"{TX_DIR}/{txid}/retiring-{uuid.uuid4().hex[:8]}"


def intent_key(txid: str) -> str:
    """``.txckpt/intents/<txid>.json``: who writes the staging of ``txid`` (an adopter's: its
    :func:`adopt_intent_id`)."""
    return f"{INTENTS_DIR}/{txid}.json"


def adopt_intent_id(lineage: str, session: str) -> str:
    """The intent id of an adopter: ``adopt-<L>.<session>`` (``intents/adopt-<L>.<session>.json``)."""
    return f"{ADOPT_INTENT_PREFIX}{lineage}.{session}"


def adopted_txid(step: int, lineage: str) -> str:
    return f"{ADOPTED_TXID_PREFIX}{step}-{lineage}"


def lease_key(txid: str) -> str:
    """``.txckpt/readers/<txid>.<nonce>.json``: a reader lease on ``txid``."""
    return f"{READERS_DIR}/{txid}.{uuid.uuid4().hex[:12]}.json"


def orphan_key(name: str, txid: str | None = None) -> str:
    """Where a directory that held a name txckpt needed is moved aside (never deleted):
    ``orphans/<name>.<txid>.<rnd>`` for a committed checkpoint whose home was taken,
    ``orphans/<name>.<time>.<rnd>`` for a directory without a committed manifest."""
    tag = txid if txid else time.strftime("%Y%m%dT%H%M%S")
    return f"{ORPHANS_DIR}/{name}.{tag}.{uuid.uuid4().hex[:8]}"


def temp_name(file_name: str, *, hidden: bool) -> str:
    """A fresh temp file name for an atomic write of ``file_name`` in the same directory:
    ``.x.<12 hex>.tmp`` (hidden: a create-if-absent write, which links it into place) or
    ``x.<12 hex>.tmp`` (a replace). :func:`temp_target` reads both back."""
    return f"{'.' if hidden else ''}{file_name}.{uuid.uuid4().hex[:12]}.tmp"


def temp_target(file_name: str) -> str | None:
    """The name whose atomic write a temp file ``file_name`` belongs to (``.x.<12 hex>.tmp`` and
    ``x.<12 hex>.tmp`` both give ``x``); None if it is not such a temp file."""
    m = _TEMP_RE.match(file_name)
    return m.group("name") if m else None


def is_manifest_temp(file_name: str) -> bool:
    """A temp file of an atomic write of a manifest (a crashed adoption's, inside ``checkpoint-N``)."""
    return temp_target(file_name) == MANIFEST_NAME


def is_url(path: str | os.PathLike) -> bool:
    """Is ``path`` an fsspec URL (``s3://b/x``, ``file:///x``) or chain (``simplecache::s3://b``,
    ``memory::x``) rather than a plain local path? A ``file://`` URL is a URL too (whether it is
    read through local paths is the storage's business: ``txckpt._storage.open_storage``)."""
    p = os.fspath(path)
    return "://" in p or "::" in p


def is_local_path(path: str | os.PathLike) -> bool:
    """Is ``path`` read through local paths: a plain path, or a ``file://`` URL that is not part
    of a chain (``simplecache::file://x`` goes through fsspec)."""
    p = os.fspath(path)
    return not is_url(p) or (p.startswith("file://") and "::" not in p)


__all__ = [
    "META_DIR",
    "LOG_DIR",
    "LATEST_HINT",
    "SNAPSHOT_DIR",
    "NAMING_KEY",
    "TX_DIR",
    "INTENTS_DIR",
    "READERS_DIR",
    "ORPHANS_DIR",
    "RESERVE_KEY",
    "MANIFEST_NAME",
    "CHECKPOINT_PREFIX",
    "MAX_STEP",
    "ADOPT_INTENT_PREFIX",
    "ADOPTED_TXID_PREFIX",
    "TEMP_DIRS",
    "parse_step",
    "parse_checkpoint_name",
    "checkpoint_name",
    "new_txid",
    "entry_key",
    "snapshot_key",
    "tx_key",
    "home_key",
    "txid_of_tx_key",
    "retiring_key",
    "intent_key",
    "adopt_intent_id",
    "adopted_txid",
    "lease_key",
    "orphan_key",
    "temp_name",
    "temp_target",
    "is_manifest_temp",
    "is_url",
    "is_local_path",
]
