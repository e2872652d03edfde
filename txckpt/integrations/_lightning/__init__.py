"""Lightning's integration rooms behind the public module txckpt.integrations.lightning: published checkpoint names.

Internal. Importing this package imports nothing.
"""
