"""Accelerate's integration rooms behind the public module txckpt.integrations.accelerate: output directories and epoch state.

Internal. Importing this package imports nothing.
"""
