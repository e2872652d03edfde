"""How a root names its checkpoints: ``<prefix><step>``, ``checkpoint-N`` by default.

A root records a naming other than the default in ``.txckpt/naming`` (protocol §2), a small JSON
file created once, if absent, before the root's first log entry, and never changed:
``{"format": "txckpt-naming/1", "prefix": "checkpoint_"}`` (accelerate's ``checkpoint_<i>``). A
root without the file uses ``checkpoint-``. The naming decides the public names of published
checkpoints (§7), which directories of a root without a log are legacy checkpoints (§9), and
which paths have the shape of a published checkpoint (§6a). Homes keep ``checkpoint-N``
(``.txckpt/tx/<txid>/checkpoint-N``): they are txckpt's own.

With :mod:`txckpt._base.layout` this module is the one place that forms and parses checkpoint names:
:meth:`Naming.public` forms ``<prefix><step>``, :meth:`Naming.step_of` parses it in a known
naming (with layout's :func:`~txckpt._base.layout.parse_checkpoint_name`), :func:`split_public` parses a
name whose prefix is not known yet (a path's shape, accelerate's ``save_state(output_dir)``), and
:meth:`Naming.name_of` names a committed checkpoint as the root has it (an adopted
``checkpoint-00500`` keeps its zero padding). The integrations use these too (a Trainer's
``checkpoint-N``: ``integrations/trainer/paths.TRAINER_NAMING``); tests/test_architecture.py
fails on a checkpoint name formed or parsed anywhere else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from ..errors import InvalidArgumentError, LogCorruptError, NamingConflictError
from .layout import CHECKPOINT_PREFIX, NAMING_KEY, TX_DIR, entry_key, parse_checkpoint_name, parse_step

NAMING_FORMAT = "txckpt-naming/1"
#: The fixed name is layout's (homes always use it); the prefix a root chooses is this module's.
DEFAULT_PREFIX = CHECKPOINT_PREFIX
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_+=,@-][A-Za-z0-9_.+=,@-]*$")
#: ``<prefix><digits>`` for a prefix not known yet: the prefix is all but the trailing digits.
_PUBLIC_RE = re.compile(r"^(?P<prefix>.*?)(?P<digits>[0-9]+)$", re.S)


@dataclass(frozen=True)
class Naming:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_prefix(self.prefix)

    def public(self, step: int | str) -> str:  # a str: "N", in messages
        return f"{self.prefix}{step}"

    def step_of(self, name: str) -> int | None:
        """N if ``name`` is ``<prefix>N`` (``checkpoint-00500`` is 500), else None (also for a
        number no step can be: layout.parse_step)."""
        return parse_checkpoint_name(name, self.prefix)

    def name_of(self, step: int, key: str | None = None) -> str:
        """The name committed checkpoint ``step`` has in a root of this naming: the directory
        it was adopted at (``key``, a top-level ``<prefix>N``: ``checkpoint-00500`` stays
        that), else :meth:`public`."""
        if key and not key.startswith(TX_DIR + "/") and "/" not in key and self.step_of(key) == step:
            return key
        return self.public(step)

    def encode(self) -> bytes:
        return json.dumps({"format": NAMING_FORMAT, "prefix": self.prefix}, sort_keys=True).encode()


def check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix) or prefix[-1].isdigit():
        raise InvalidArgumentError(
            f"checkpoint name prefix {prefix!r} is not usable: it must be a non-empty file name of "
            "letters, digits and _.+=,@- that does not start with '.' or end with a digit "
            "(the step follows it: 'checkpoint-' gives checkpoint-500)"
        )


DEFAULT = Naming()


def split_public(name: str) -> tuple[str, int] | None:
    """(prefix, step) of a name ``<prefix><digits>`` whose prefix is not known (``step_4``:
    ``step_``, 4; ``checkpoint-00500``: ``checkpoint-``, 500), the step parsed as layout's
    :func:`~txckpt._base.layout.parse_step` parses every step; None for a name without a non-empty
    prefix or without a step (also a number no step can be). Whether the prefix is usable
    (:func:`check_prefix`), or the root's naming (:meth:`Naming.step_of`), is the caller's question."""
    m = _PUBLIC_RE.match(name)
    if not m or not m.group("prefix"):
        return None
    step = parse_step(m.group("digits"))
    return None if step is None else (m.group("prefix"), step)


def split_name(name: str) -> tuple[Naming, int]:
    """The naming and step of a directory name ``<prefix><digits>`` (``step_4``: ``step_``, 4)."""
    split = split_public(name)
    if split is None:
        raise InvalidArgumentError(
            f"{name!r} does not end with a step number after a prefix (like checkpoint_4 or step_4): "
            "a txckpt checkpoint's name is <prefix><step>, the step below 2**63"
        )
    return Naming(split[0]), split[1]


class NamingStorage(Protocol):
    """What reading and recording the naming needs of a root's storage (``storage.base.Storage``,
    a floor above)."""

    def read_bytes(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def create_exclusive(self, key: str, data: bytes, *, durable: bool) -> None: ...

    def full_path(self, key: str) -> str: ...


def read_naming(storage: NamingStorage) -> Naming | None:
    """The naming recorded in the root, or None where none is (then: the default)."""
    try:
        data = storage.read_bytes(NAMING_KEY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        obj = json.loads(data)
        if obj.get("format") != NAMING_FORMAT:
            raise ValueError(obj.get("format"))
        return Naming(obj["prefix"])
    except (ValueError, KeyError, AttributeError, TypeError, InvalidArgumentError) as e:
        raise LogCorruptError(
            f"{storage.full_path(NAMING_KEY)} is damaged ({e!r}): it records how the root names its "
            'checkpoints. Restore it (its content is {"format": "txckpt-naming/1", "prefix": ...})'
        ) from None


def record_naming(storage: NamingStorage, naming: Naming, *, durable: bool) -> Naming:
    """Make ``naming`` the root's: create ``.txckpt/naming`` if absent (before the root's first log
    entry). Raises :class:`NamingConflictError` if the root has another naming already (a file
    naming another prefix, or a log without the file: the default)."""
    recorded = read_naming(storage)
    if recorded is None:
        if storage.exists(entry_key(0)):
            recorded = DEFAULT
        elif naming != DEFAULT:
            try:
                storage.create_exclusive(NAMING_KEY, naming.encode(), durable=durable)
                return naming
            except FileExistsError:
                recorded = read_naming(storage) or DEFAULT
        else:
            return naming
    if recorded != naming:
        raise NamingConflictError(
            f"{storage.full_path('')} names its checkpoints {recorded.public('N')}, not "
            f"{naming.public('N')}: one root has one naming (recorded in {NAMING_KEY}, or "
            "checkpoint-N where the file is absent). Use another root, or the root's naming",
            root=storage.full_path(""),
            recorded=recorded.prefix,
            requested=naming.prefix,
        )
    return recorded
