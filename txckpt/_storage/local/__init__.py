"""The local POSIX backend: fsync for durability, link() for create-if-absent, renameat2 for atomic directory moves.

Internal. Importing this package imports nothing; `txckpt._storage.open_storage` chooses it.
"""
