"""Names and path tests of the Trainer integration (txckpt.integrations.transformers): where
upstream's checkpoint directories are, and whether a path is remote, inside a root, or names a
step. No transformers import: the modules of the integration share these. Upstream's
``checkpoint-N`` is formed and parsed by the core's naming (:data:`TRAINER_NAMING`, txckpt/_base/naming.py),
never by a regex of its own."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping

from ..._base.layout import is_local_path, is_url
from ..._base.naming import Naming
from ..._root.root import open_root

#: Upstream's names (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR, trainer.TRAINER_STATE_NAME).
PREFIX_CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
#: Upstream's checkpoint directories, ``f"{PREFIX_CHECKPOINT_DIR}-{global_step}"``: the core's
#: default naming. Its step_of parses them as upstream's ``^checkpoint-(\d+)$`` does (zero padding
#: too), in ASCII digits below 2**63 (layout.parse_step: a larger number is none, not a huge int).
TRAINER_NAMING = Naming(PREFIX_CHECKPOINT_DIR + "-")

#: A remote root's local cache, under output_dir, and its parts (remote_cache.RemoteCache).
CACHE_DIR_NAME = ".txckpt-cache"
STAGING_DIR_NAME = "staging"
PUSH_DIR_NAME = "push"
STAGING_ENV = "TXCKPT_STAGING_DIR"


def public_name(root: str, storage_options: Mapping[str, Any] | None, step: int) -> str:
    """Step ``step``'s public name in ``root``, as messages name it: the root's naming
    (``checkpoint-N`` unless the root records another, txckpt/_base/naming.py). A message never fails
    for it: a root whose naming cannot be read now (an error being reported) is named upstream's way."""
    try:
        return open_root(root, storage_options).publication.naming.public(step)
    except Exception:  # noqa: BLE001 - only a name in a message
        return TRAINER_NAMING.public(step)


def is_remote(path: str) -> bool:
    """A root or checkpoint that the Trainer cannot read through local paths (any fsspec URL
    but file://)."""
    return not is_local_path(path)


def named_step(path: str, parent: str) -> int | None:
    """K if ``path`` is ``<parent>/checkpoint-K``."""
    if is_url(path) != is_url(parent):
        return None
    head, name = (path.rstrip("/").rsplit("/", 1) + [""])[:2] if is_url(path) else os.path.split(path)
    step = TRAINER_NAMING.step_of(name)
    same = (
        head.rstrip("/") == parent.rstrip("/") if is_url(path) else os.path.realpath(head) == os.path.realpath(parent)
    )
    return step if same else None


def same_dir(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def is_within(path: str, root: str) -> bool:
    if is_url(path) or is_url(root):
        return path.rstrip("/").startswith(root.rstrip("/") + "/")
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def checkpoint_name_step(path: str) -> int | None:
    """K for a path whose last component is ``checkpoint-K`` (published or a home), else None."""
    return TRAINER_NAMING.step_of(os.path.basename(path.rstrip("/").rstrip(os.sep)))


def step_of(path: str) -> int | None:
    """The global step of a local checkpoint directory: its trainer_state.json's, else its name's."""
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return TRAINER_NAMING.step_of(os.path.basename(os.path.normpath(path)))


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


_LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def check_save_on_each_node(args: Any) -> None:
    """save_on_each_node=True on several nodes makes each node's local rank 0 write its own copy
    of the staging directory on node-local storage, while only global rank 0 commits: refuse."""
    if not getattr(args, "save_on_each_node", False) or args.world_size <= 1:
        return
    local = next((os.environ[v] for v in _LOCAL_WORLD_SIZE_VARS if os.environ.get(v)), None)
    if local is not None and int(local) == args.world_size:
        return  # one node: save_on_each_node changes nothing
    raise ValueError(
        "TransactionalCheckpointMixin does not support save_on_each_node=True across several nodes "
        f"(world size {args.world_size}, local world size {local or 'unknown'}): a txckpt checkpoint "
        "is committed once, by global rank 0, from one staging directory that every rank writes. Put "
        "output_dir on storage all nodes share (or an fsspec URL) and set save_on_each_node=False."
    )
