"""Asynchronous saves: the snapshot of a state and the background thread that commits it.

Internal. Importing this package imports nothing.
"""
