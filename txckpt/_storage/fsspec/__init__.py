"""The fsspec backend family: any fsspec file system without atomic directory rename (GCS, Azure, chained URLs) and `memory://`.

Internal. Importing this package imports nothing; `txckpt._storage.open_storage` chooses it.
"""
