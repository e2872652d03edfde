"""Where the fsspec backends lived before storage/ was split by backend (storage/fsspec.py,
storage/memory.py, storage/s3.py, storage/s3_upload.py). Kept only because modules outside
storage/'s owners still import these names from here (tests/reliability/injectors.py,
tests/test_remote_errors.py); new code imports the backend's own module. Re-exports only: setting
an attribute here (a tuning constant) changes nothing, set it on txckpt.storage.s3.
"""

from __future__ import annotations

from .fsspec import FsspecStorage
from .memory import MemoryStorage
from .s3 import S3_MAX_IN_FLIGHT, S3_MULTIPART_THRESHOLD, S3_PART_SIZE, S3_PENDING_FILES, S3Storage
from .s3_upload import _put_object, _run, _S3Writer, _S3WriteBatch

__all__ = ["FsspecStorage", "MemoryStorage", "S3Storage", "S3_PART_SIZE", "S3_MAX_IN_FLIGHT",
           "S3_MULTIPART_THRESHOLD", "S3_PENDING_FILES", "_put_object", "_run", "_S3Writer", "_S3WriteBatch"]
