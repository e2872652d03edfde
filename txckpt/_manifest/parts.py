"""Per-rank manifest parts (protocol §3a, manifest format /2): the fixed-size record a rank
reports to the committer, and the Merkle tree over the ranks' part digests.

At W ranks the commit must not cost rank 0 O(W) pickled file tables: each rank writes its own
part of the manifest into the staging directory and sends rank 0 only a :data:`RECORD_SIZE`
byte record (its part's digest, the digest of its file names and kinds, its file count and
byte total, a flag). Rank 0 commits the Merkle root over the W part digests; a loading rank
reads its own part plus log2(W) sibling digests and checks them against that root, so what it
reads does not grow with W.

Pure functions over bytes: no storage, no torch (the tensor collective is
:mod:`txckpt._base.coordination`'s).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import xxhash

from ..errors import ManifestError

#: The directory (inside a checkpoint) that holds the parts and the tree.
PARTS_DIR = "txckpt-parts"
#: The flat Merkle tree: every level bottom-up, NODE_SIZE bytes per node.
TREE_NAME = f"{PARTS_DIR}/tree"
NODE_SIZE = 16

#: Record flags. FAILED: the rank raised (its error is gathered on the rare path, as an
#: object). DIRECTORY: ``tx.directory`` was handed out on this rank, so other code may have
#: written files no rank reported: the committer must list the staging (no fast path).
FAILED = 1
DIRECTORY = 2

# part digest, structure digest, file count, byte total, flags: 16 + 16 + 8 + 8 + 8 = 56 bytes.
_RECORD = struct.Struct("<16s16sQQQ")
RECORD_SIZE = _RECORD.size


def part_name(rank: int) -> str:
    """The name (inside the checkpoint) of rank ``rank``'s part."""
    return f"{PARTS_DIR}/{rank}.json"


def is_part_file(name: str) -> bool:
    """Whether ``name`` (inside a checkpoint) is txckpt's part metadata, not a checkpoint file."""
    return name == PARTS_DIR or name.startswith(PARTS_DIR + "/")


def node_digest(data: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of ``data``, as the 16 raw bytes a tree node holds."""
    return xxhash.xxh3_128_digest(data)


def structure_digest(names_and_kinds: Iterable[tuple[str, str]]) -> bytes:
    """The digest of a rank's file names and kinds (sorted): equal from one save to the next
    when the rank saves the same files, whatever their bytes."""
    h = xxhash.xxh3_128()
    for name, kind in sorted(names_and_kinds):
        h.update(name.encode("utf-8", "surrogateescape") + b"\0" + kind.encode() + b"\0")
    return h.digest()


@dataclass(frozen=True)
class Record:
    """What one rank reports to the committer: fixed size, :data:`RECORD_SIZE` bytes."""

    part: bytes = bytes(16)
    structure: bytes = bytes(16)
    files: int = 0
    total_bytes: int = 0
    flags: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.flags & FAILED)

    def encode(self) -> bytes:
        return _RECORD.pack(self.part, self.structure, self.files, self.total_bytes, self.flags)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, rank: int) -> "Record":
        if len(data) != RECORD_SIZE:
            raise ManifestError(
                f"rank {rank}'s report has {len(data)} bytes, not {RECORD_SIZE}: the ranks "
                "run different txckpt versions; install the same txckpt on every rank"
            )
        return cls(*_RECORD.unpack(bytes(data)))


def failed_record(directory: bool = False) -> Record:
    return Record(flags=FAILED | (DIRECTORY if directory else 0))


# ----- the Merkle tree -------------------------------------------------------------------------
def level_sizes(count: int) -> list[int]:
    """How many nodes each level of the tree over ``count`` leaves has, leaves first; an odd
    node is carried up unchanged. The layout of the tree file follows from ``count`` alone."""
    if count < 1:
        raise ManifestError(f"a manifest's parts count must be at least 1, not {count}")
    sizes = [count]
    while sizes[-1] > 1:
        sizes.append((sizes[-1] + 1) // 2)
    return sizes


def level_offsets(count: int) -> list[int]:
    """The byte offset of each level in the tree file."""
    offsets, at = [], 0
    for n in level_sizes(count):
        offsets.append(at)
        at += n * NODE_SIZE
    return offsets


def tree_size(count: int) -> int:
    return sum(level_sizes(count)) * NODE_SIZE


def build_tree(leaves: Sequence[bytes]) -> bytes:
    """The tree file: every level bottom-up (leaf i = part i's digest; a node = xxh3-128 of its
    two children's bytes; an odd last node carried up as it is). Its last 16 bytes: the root."""
    level = list(leaves)
    out = bytearray(b"".join(level))
    while len(level) > 1:
        nxt = [node_digest(level[i] + level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
        out += b"".join(level)
    return bytes(out)


def tree_root(tree: bytes) -> bytes:
    return tree[-NODE_SIZE:]


def proof_nodes(count: int, index: int) -> list[tuple[int, int]]:
    """``(byte offset in the tree file, level)`` of each sibling on leaf ``index``'s path to the
    root, bottom-up; a level where the node has no sibling (carried up) is skipped."""
    out, offsets = [], level_offsets(count)
    for level, n in enumerate(level_sizes(count)[:-1]):
        sibling = index ^ 1
        if sibling < n:
            out.append((offsets[level] + sibling * NODE_SIZE, level))
        index //= 2
    return out


def root_from_proof(leaf: bytes, count: int, index: int, siblings: Sequence[bytes]) -> bytes:
    """The root that leaf ``index`` with these ``siblings`` (in :func:`proof_nodes` order) makes."""
    node, at = leaf, 0
    for n in level_sizes(count)[:-1]:
        if (index ^ 1) < n:
            sibling = siblings[at]
            at += 1
            node = node_digest(node + sibling) if index % 2 == 0 else node_digest(sibling + node)
        index //= 2
    return node


__all__ = [
    "PARTS_DIR",
    "TREE_NAME",
    "NODE_SIZE",
    "RECORD_SIZE",
    "FAILED",
    "DIRECTORY",
    "Record",
    "failed_record",
    "part_name",
    "is_part_file",
    "node_digest",
    "structure_digest",
    "level_sizes",
    "level_offsets",
    "tree_size",
    "build_tree",
    "tree_root",
    "proof_nodes",
    "root_from_proof",
]
