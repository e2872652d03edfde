"""Typed references that cross modules: a committed checkpoint (:class:`Ref`) and what a lineage
or a manifest follows (:data:`Parent`: a Ref, an :class:`ExternalParent`, or None).

Log entries, snapshots and manifests hold their JSON form (protocol §1 "Ref"), written
by ``to_json`` and read back by ``from_json``/:func:`parent_from_json`: the files on disk are the
same dicts they always were; only the code passes these frozen objects around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Ref:
    """A reference to one committed checkpoint (protocol §1 "Ref"): the commit's own lineage,
    its step and txid, (for adopted checkpoints only) the key its data was committed at, and the
    digest of the manifest the log committed, so a reader of the newest entry can cross-check a
    tip's manifest without reading the whole log. Log entries and snapshots hold its
    :meth:`to_json` form, so what is on disk does not depend on this class."""

    lineage: str
    step: int
    txid: str
    key: str | None = None
    digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire form: key and digest only when set (entries before digests lack it)."""
        r: dict[str, Any] = {"lineage": self.lineage, "step": self.step, "txid": self.txid}
        if self.key is not None:
            r["key"] = self.key
        if self.digest is not None:
            r["digest"] = self.digest
        return r

    @classmethod
    def from_json(cls, d: Any) -> "Ref":
        """Raises KeyError/TypeError/ValueError on a malformed ref (callers word it)."""
        if not isinstance(d, dict):
            raise TypeError(f"a ref is a JSON object, not {d!r}")
        key, digest = d.get("key"), d.get("digest")
        return cls(
            str(d["lineage"]),
            int(d["step"]),
            str(d["txid"]),
            None if key is None else str(key),
            None if digest is None else str(digest),
        )


@dataclass(frozen=True)
class ExternalParent:
    """The parent of a lineage started from a checkpoint outside the root (its path)."""

    path: str

    def to_json(self) -> dict[str, Any]:
        return {"external": self.path}


#: What a lineage (or a manifest) follows: a committed checkpoint, an external path, or nothing.
Parent = Union[Ref, ExternalParent, None]


def parent_to_json(parent: Parent) -> dict[str, Any] | None:
    return None if parent is None else parent.to_json()


def parent_from_json(d: Any) -> Parent:
    """A parent's wire form read back: a ref (it has a txid), {"external": path}, or null.
    Raises ValueError (or KeyError/TypeError) on anything else."""
    if not d:
        return None
    if not isinstance(d, dict):
        raise TypeError(f"a parent is a JSON object or null, not {d!r}")
    if "txid" in d:
        return Ref.from_json(d)
    if "external" in d:
        return ExternalParent(str(d["external"]))
    raise ValueError(f"a parent is a ref, an external path or null, not {d!r}")


def same_ref(a: Parent, b: Parent) -> bool:
    """Whether both name the same checkpoint: equal (lineage, step, txid), key and digest aside."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Ref) and isinstance(b, Ref):
        return (a.lineage, a.step, a.txid) == (b.lineage, b.step, b.txid)
    return not isinstance(a, Ref) and not isinstance(b, Ref)


__all__ = ["Ref", "ExternalParent", "Parent", "parent_to_json", "parent_from_json", "same_ref"]
