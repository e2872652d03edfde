"""The S3 backend family: S3 and S3-compatible stores through s3fs's client, with parallel ranged reads and multipart uploads.

Internal. Importing this package imports nothing; `txckpt._storage.open_storage` chooses it.
"""
