"""The read: a committed checkpoint read and verified by its path, and a verified local copy of one (fetch).

Internal. Importing this package imports nothing.
"""
