"""The save: one checkpoint as a transaction (staging, per-rank writes, gather, manifest, commit), its file names, incremental sharing, and serialization.

Internal. Importing this package imports nothing.
"""
