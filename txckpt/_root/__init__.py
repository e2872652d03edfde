"""A root: lookup, resume and fork, adoption of legacy roots, and resuming past damaged checkpoints.

Internal. Importing this package imports nothing.
"""
