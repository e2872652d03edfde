"""The base layer: the vocabulary every floor shares (names, layout, references, checksums, deferred imports) and local mechanisms (file I/O, coordination between ranks, progress, random state).

Internal: users import from `txckpt` (docs/api.md). Importing this package imports nothing.
"""
