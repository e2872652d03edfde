"""The manifest: a checkpoint's files with sizes and checksums, its per-rank parts (format /2), the files ranks claim into it, and verification of stored bytes against it.

Internal. Importing this package imports nothing.
"""
