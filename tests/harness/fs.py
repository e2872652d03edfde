"""A directory tree as data, for tests that must show a command changed nothing it should not."""

from __future__ import annotations

import hashlib
import os


def tree(root: str) -> dict[str, str]:
    """Every file and directory under ``root`` (relative path) -> its content's sha256, or
    ``"dir"`` for a directory: equal before and after only when nothing was added, removed or
    rewritten."""
    out = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out[rel] = "dir"
        for n in filenames:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.join(rel, n)] = hashlib.sha256(f.read()).hexdigest()
    return out


def flip_byte(path: str, from_end: int = 1, mask: int = 0xFF) -> None:
    """Damage a file in place: XOR the byte ``from_end`` bytes before its end with ``mask``
    (same size, same name: only a checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ mask]))
