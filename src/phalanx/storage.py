"""Durable writes and checksums on local disk or any fsspec filesystem (s3://, gs://, ...), shared by dataset
preparation and checkpoints."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem


def write_atomic(path: str | Path, data: bytes, fs: AbstractFileSystem | None = None) -> None:
    """Readers see the old file or the whole new one, never a part.

    Locally: write a temporary sibling, fsync, rename over ``path``. In an object store a single PUT is
    already all-or-nothing (and a rename would be a copy), so the object is written directly."""
    if fs is not None and not isinstance(fs, LocalFileSystem):
        fs.pipe_file(str(path), data)
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def sha256_file(path: str | Path, fs: AbstractFileSystem | None = None) -> str:
    digest = hashlib.sha256()
    with fs.open(str(path), "rb") if fs is not None else Path(path).open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
