"""Names and path tests of the Trainer integration (txckpt.integrations.transformers): where
upstream's checkpoint directories are, and whether a path is remote, inside a root, or names a
step. No transformers import: the modules of the integration share these."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Iterator

from ..layout import is_local_path, is_url

#: Upstream's names (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR, trainer.TRAINER_STATE_NAME).
PREFIX_CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")

#: A remote root's local cache, under output_dir, and its parts (trainer_remote.RemoteCache).
CACHE_DIR_NAME = ".txckpt-cache"
STAGING_DIR_NAME = "staging"
PUSH_DIR_NAME = "push"
STAGING_ENV = "TXCKPT_STAGING_DIR"


def is_remote(path: str) -> bool:
    """A root or checkpoint that the Trainer cannot read through local paths (any fsspec URL
    but file://)."""
    return not is_local_path(path)


def named_step(path: str, parent: str) -> int | None:
    """K if ``path`` is ``<parent>/checkpoint-K``."""
    if is_url(path) != is_url(parent):
        return None
    head, name = (path.rstrip("/").rsplit("/", 1) + [""])[:2] if is_url(path) else os.path.split(path)
    m = CHECKPOINT_RE.match(name)
    same = head.rstrip("/") == parent.rstrip("/") if is_url(path) else os.path.realpath(head) == os.path.realpath(parent)
    return int(m.group(1)) if m and same else None


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
    m = CHECKPOINT_RE.match(os.path.basename(path.rstrip("/").rstrip(os.sep)))
    return int(m.group(1)) if m else None


def step_of(path: str) -> int | None:
    """The global step of a local checkpoint directory: its trainer_state.json's, else its name's."""
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None


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
