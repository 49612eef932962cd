"""DCP storage writers that hash each file while they write it.

A checkpoint's manifest lists every file's size and checksum (``directory.CHECKSUM``). Reading the files
back to hash them is a second pass over every byte beside training (from the page cache on a local disk, a
second download on S3); here each byte is hashed once, on its way to the file, by the thread that writes
it. DCP writes its files front to back (its writes go through stream wrappers that cannot seek), so the
hash of what was written is the hash of the file; a stream that is seeked anyway gives no hash, and that
file is read back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from phalanx.checkpoint.directory import CHECKSUM
from phalanx.storage import DIGESTS


class _HashingStream:
    def __init__(self, raw: Any):
        self._raw, self._digest, self.size, self.intact = raw, DIGESTS[CHECKSUM](), 0, True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        self._digest.update(view[:written])
        self.size += written
        return written

    def seek(self, *args: Any) -> int:
        self.intact = False
        return self._raw.seek(*args)

    def describe(self) -> dict[str, Any]:
        return {"size": self.size, CHECKSUM: self._digest.hexdigest()}

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (for fsync), close
        return getattr(self._raw, name)


class _HashingFileSystem:
    """DCP's file system with each written file's size and checksum recorded, by file name, in ``written``."""

    def __init__(self, fs: Any):
        self._fs = fs
        self.written: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with self._fs.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        if stream.intact:
            self.written[os.path.basename(os.fspath(path))] = stream.describe()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def hashing_writer(location: str, local: bool) -> tuple[FileSystemWriter, dict[str, dict[str, Any]]]:
    """A writer for ``location`` (a path, or a URL through fsspec) as ``dcp.save`` would pick it, and the
    record it fills: file name -> {size, CHECKSUM} for each file this rank wrote whole."""
    if local:
        writer = FileSystemWriter(location)
    else:  # what dcp.save picks for a URL; torch keeps it in a module of its own
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(location)
    hashing = _HashingFileSystem(writer.fs)
    writer.fs = hashing
    return writer, hashing.written
