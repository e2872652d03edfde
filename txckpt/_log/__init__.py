"""The log and lineages: the create-if-absent commit log, lineage resolution, where a committed checkpoint lives (publication), the commit room, and a root's identity in this process.

Internal. Importing this package imports nothing.
"""
