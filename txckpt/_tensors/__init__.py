"""Tensor-level checkpoints (issue 47): the tensor index and chunk digests a manifest records
for each file (``index``), and what reads them: inspect, diff and a verified load of named
tensors that reads only their bytes. Internal: the public names are re-exported by ``txckpt``."""
