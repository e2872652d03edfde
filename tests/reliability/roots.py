"""A template root and fresh copies of it, on each backend.

``local``  a directory ``<case>/template/root`` copied (``copytree``) for every crash point;
``memory`` a dump of fsspec's in-process store (see injectors.memory_dump), loaded into the store of
           every child and checker process (each process has its own store);
``s3``     a prefix in a bucket of the case's own, copied server-side for every crash point.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import uuid
from typing import Any

from .core import Ctx, rmtree


class Roots:
    def __init__(self, backend: str, ctx: Ctx, name: str = "r"):
        self.backend = backend
        self.ctx = ctx
        self.name = name
        self.so: dict[str, Any] | None = None
        if backend == "local":
            self.template_dir = os.path.join(ctx.workdir, f"{name}-template")
        elif backend == "memory":
            self.uid = uuid.uuid4().hex[:10]
            self.template_blob: bytes | None = None
        elif backend == "s3":
            from . import s3

            assert ctx.s3_endpoint, "no S3 server"
            s3.apply_fake_env()
            self.so = s3.storage_options(ctx.s3_endpoint)
            self.bucket = "rel-" + hashlib.sha1(f"{ctx.workdir}/{name}".encode()).hexdigest()[:16]
            self.client = s3.client(ctx.s3_endpoint)
            self.client.create_bucket(Bucket=self.bucket)
        else:
            raise ValueError(backend)

    # ----- the template ------------------------------------------------------------------------
    def template(self) -> tuple[str, dict[str, Any] | None]:
        """(url, storage_options) of the template root (build it in a child, then ``freeze``)."""
        if self.backend == "local":
            return os.path.join(self.template_dir, "root"), None
        if self.backend == "memory":
            return f"memory://rel-{self.uid}/root", {}
        return f"s3://{self.bucket}/template/root", self.so

    def freeze_in_child(self) -> str | None:
        """Called at the end of the child that built the template: returns what the parent needs
        to recreate it (the memory dump, base64), or None."""
        if self.backend == "memory":
            from .injectors import memory_dump

            return base64.b64encode(memory_dump(self.template()[0])).decode()
        return None

    def set_frozen(self, frozen: str | None) -> None:
        if self.backend == "memory":
            self.template_blob = base64.b64decode(frozen) if frozen else None

    # ----- copies ------------------------------------------------------------------------------
    def fresh(self, point: str) -> tuple[str, dict[str, Any] | None]:
        """A new root holding the template's content; for memory, the copy is made inside each
        child by :meth:`enter_child`."""
        if self.backend == "local":
            d = os.path.join(self.ctx.workdir, "points", f"{self.name}-{point}")
            rmtree(d)
            if os.path.exists(self.template_dir):
                shutil.copytree(self.template_dir, d, symlinks=True)
            else:
                os.makedirs(d)
            return os.path.join(d, "root"), None
        if self.backend == "memory":
            return self.template()[0], {}
        from . import s3

        dst = f"p-{point}/root"
        s3.copy_prefix(self.client, self.bucket, "template/root", dst)
        return f"s3://{self.bucket}/{dst}", self.so

    def enter_child(self, url: str) -> None:
        """In a fresh child: make the root's content what the template holds."""
        if self.backend == "memory":
            from .injectors import memory_load

            memory_load(url, self.template_blob)

    def dump_path(self, point: str) -> str:
        return os.path.join(self.ctx.workdir, "dumps", f"{self.name}-{point}.mem")

    def crash_hook(self, url: str, point: str):
        """What a child does at its crash point before dying (memory: dump the store)."""
        if self.backend != "memory":
            return None
        from .injectors import dump_to_file

        path = self.dump_path(point)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return lambda: dump_to_file(url, path)

    def enter_checker(self, url: str, point: str) -> None:
        """In a fresh checker process: load the state the crashed child left."""
        if self.backend == "memory":
            from .injectors import memory_load

            path = self.dump_path(point)
            with open(path, "rb") as f:
                memory_load(url, f.read())

    def discard(self, url: str, point: str) -> None:
        if self.backend == "local":
            rmtree(os.path.dirname(url))
        elif self.backend == "memory":
            try:
                os.unlink(self.dump_path(point))
            except FileNotFoundError:
                pass
        else:
            from . import s3

            prefix = url.split(f"s3://{self.bucket}/", 1)[1].rsplit("/", 1)[0] + "/"
            ks = s3.keys(self.client, self.bucket, prefix)
            for i in range(0, len(ks), 1000):
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in ks[i : i + 1000]], "Quiet": True}
                )

    @property
    def s3_prefix_of(self):
        return lambda url: url.split(f"s3://{self.bucket}/", 1)[1] if self.backend == "s3" else ""
