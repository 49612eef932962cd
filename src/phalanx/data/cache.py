"""A node's cache of verified chunks of remote datasets, on its local disk, shared by the node's ranks.

    ROOT/<dataset key>/locks                  one byte-range lock per chunk (``lockf``): who is fetching it
    ROOT/<dataset key>/<shard>/<chunk>        a chunk's bytes (by numbers), written whole under a temporary name,
                                              then renamed

- **Shared safely**: a rank takes a chunk's lock without blocking before it fetches it; a rank that finds the
  lock held waits for the chunk to appear (or the lock to be let go: then it fetches it itself), so a node
  downloads each chunk once however many ranks need it. The kernel lets go a dead process's locks.
- **Bounded**: ``budget`` bytes for the whole root, every dataset and job on the node together. Past it, the
  least recently used chunks are deleted. A rank that reads a deleted chunk through a map it holds still
  reads it (the file lives until the map goes); one that needs it again fetches it again.
- **Never bad bytes**: a chunk is written only once its checksum matched, and each process checks a cached
  chunk again when it maps it (a crash before the disk wrote it all, a bad disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

TMP = ".tmp"
KEY = re.compile(r"[0-9a-f]{20}")
CHUNK = re.compile(r"[0-9]{6,}(\.[0-9]+\.tmp)?")
STALE_TMP_S = 3600.0  # a temporary file this old was left by a process that died while writing it


def cache_root() -> Path:
    """phalanx's cache on this machine: ``$PHALANX_CACHE``, default ``~/.cache/phalanx``."""
    return Path(os.environ.get("PHALANX_CACHE", Path.home() / ".cache" / "phalanx"))


def dataset_key(url: str, index: bytes) -> str:
    """The cache directory of a dataset: its address and its index, so a dataset rewritten in place gets a new
    one and never mixes its chunks with the old ones'."""
    return hashlib.sha256(url.encode() + b"\0" + index).hexdigest()[:20]


class ChunkCache:
    def __init__(self, root: Path, key: str, budget: int, sharers: int = 1):
        self.root, self.budget, self.sharers = root, budget, sharers
        self.dir = root / key
        self._lock_file: int | None = None  # opened on first use: opening a dataset (preflight) writes nothing
        # Each rank sees its own writes; the others' are seen by scanning, which it does after a
        # 1/(10 x sharers) share of the budget at most, so the node overshoots the budget by 10% at most.
        self._scan_every = max(1, budget // (10 * sharers))
        self._total: int | None = None
        self._since_scan = 0

    def path(self, shard: int, chunk: int) -> Path:
        """Chunk ``chunk`` of the dataset's shard number ``shard`` (numbers: never a name from the index)."""
        return self.dir / f"{shard:05d}" / f"{chunk:06d}"

    def claim(self, ids: Iterable[int]) -> tuple[list[int], list[int]]:
        """(the chunks this process now holds the fetch locks of, those another process is fetching)."""
        mine, theirs = [], []
        for i in ids:
            try:
                fcntl.lockf(self._locks(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i)
                mine.append(i)
            except OSError:
                theirs.append(i)
        return mine, theirs

    def fetching(self, i: int) -> bool:
        """Whether another process holds chunk ``i``'s fetch lock (asked without taking it for long)."""
        mine, _ = self.claim([i])
        self.release(mine)
        return not mine

    def release(self, ids: Iterable[int]) -> None:
        for i in ids:
            fcntl.lockf(self._locks(), fcntl.LOCK_UN, 1, i)

    def _locks(self) -> int:
        """The lock file, kept open while the process lives: closing any descriptor of it would let go every
        lock this process holds on it (POSIX record locks)."""
        if self._lock_file is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = os.open(self.dir / "locks", os.O_RDWR | os.O_CREAT, 0o644)
        return self._lock_file

    def put(self, shard: int, chunk: int, data: bytes, keep: frozenset[Path] = frozenset()) -> None:
        """Store a verified chunk (first making room for it, sparing ``keep``): readers see all of it or none."""
        self.make_room(len(data), keep)
        path = self.path(shard, chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP}")
        tmp.write_bytes(data)
        tmp.replace(path)
        self._since_scan += len(data)

    def used(self, path: Path) -> None:
        """Mark a chunk as just used, for least-recently-used eviction."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)

    def drop(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def make_room(self, incoming: int, keep: frozenset[Path] = frozenset()) -> None:
        known = self._total is not None and self._since_scan < self._scan_every
        if known and self._total + self._since_scan + incoming <= self.budget:
            return
        files = self._scan()
        self._total, self._since_scan = sum(size for _, size, _ in files), 0
        if self._total + incoming <= self.budget:
            return
        target = self.budget * 9 // 10 - incoming  # below the budget, so the next scans are not at once
        for _, size, path in sorted(files):
            if self._total <= target:
                break
            if path not in keep:
                path.unlink(missing_ok=True)
                self._total -= size

    def _scan(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every chunk under the root, every dataset's; stale temporary files go."""
        found, now = [], time.time()
        for dataset in _entries(self.root):
            if not KEY.fullmatch(dataset.name):
                continue  # not a dataset's: the root may be a directory people keep other things in
            for shard in _entries(Path(dataset.path)):
                for entry in _entries(Path(shard.path)):
                    if not CHUNK.fullmatch(entry.name):
                        continue
                    with contextlib.suppress(FileNotFoundError):  # another rank may delete it meanwhile
                        stat = entry.stat()
                        if entry.name.endswith(TMP):
                            if now - stat.st_mtime > STALE_TMP_S:
                                Path(entry.path).unlink(missing_ok=True)
                            continue
                        found.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return found


def _entries(path: Path) -> list[os.DirEntry]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(path) as it:
        return [e for e in it if e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False)]
    return []
