"""A prepared dataset in object storage (``s3://bucket/prefix``, or any fsspec URL), read in chunks through the
node's cache (``data/cache.py``).

A shard is fetched in chunks of the index's ``chunk_bytes``, each checked against the index's checksum of it
(a dataset prepared before chunks were recorded is fetched a whole shard at a time, checked by its sha256), so
a node downloads only the chunks its own ranks' samples lie in. Chunks are fetched concurrently (fsspec's
``cat_ranges``), ahead of the trainer by the loader, and a failed or bad fetch is tried again:

- the store unreachable, erroring or slow, a fetch cut short, or an object gone that was there at the start (a
  store coming back from a restart may say so for a while): again with backoff, for ``fetch_timeout_s``; then
  ``DataFetchError`` names the chunk and the last error (an infrastructure failure: restarted), or, for an
  object still gone, ``DatasetError`` (the dataset was deleted or overwritten: not retried);
- bytes that do not match their checksum, ``CORRUPT_TRIES`` times running: ``DatasetError`` naming the shard
  (the object in the store is corrupt; not retried, since it would fail the same way).

Credentials are the store's own conventions (for S3: the ``AWS_*`` environment variables, profiles, and
``AWS_ENDPOINT_URL`` for S3-compatible stores); a URL carrying them is refused by the spec.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from phalanx.data.cache import ChunkCache, cache_root, dataset_key
from phalanx.data.shards import INDEX, DatasetError, Shard, TokenDataset, is_url, read_index, shards_of
from phalanx.spec.model import Data
from phalanx.storage import bytes_digest, file_digest

CORRUPT_TRIES = 3
BACKOFF_S = (0.1, 5.0)  # the first wait between tries, and the longest
WAIT_POLL_S = 0.01
OPEN_CHUNKS = 4096  # chunks a process keeps mapped
RUN = 8  # neighbouring chunks fetched in one request, at most
CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


class DataFetchError(RuntimeError):
    """The object store did not give a chunk within the fetch budget (an outage, not the data: restartable)."""


def open_store(url: str, timeout_s: float) -> tuple[AbstractFileSystem, str]:
    """The filesystem and path of ``url``: a filesystem of its own (fsspec would hand back one made earlier in
    the process, with the endpoint and credentials the environment had then), and for S3 one try per request
    (neither s3fs nor botocore retrying on its own), bounded within the fetch budget, so that a frozen store is
    a failed try, not a wait: our retries are the policy."""
    options: dict[str, Any] = {"skip_instance_cache": True}
    s3 = url.split("://", 1)[0] in ("s3", "s3a")
    if s3:
        bounds = {"connect_timeout": min(5.0, timeout_s), "read_timeout": min(30.0, timeout_s)}
        options["config_kwargs"] = {**bounds, "retries": {"max_attempts": 1}}
    try:
        fs, root = url_to_fs(url, **options)
    except (ImportError, ValueError) as e:  # fsspec: a protocol it does not know, or one whose package is missing
        raise DatasetError(f"{url}: cannot be read ({e}); for s3:// install phalanx[s3]") from None
    if s3:
        fs.retries = 1  # s3fs's own loop, 5 tries by default
    return fs, root.rstrip("/")


def refused(what: str, error: BaseException) -> None:
    """Raise a DatasetError if the store refused us (no or wrong credentials, no permission): trying again would
    not help, and the person who runs the job has something to fix."""
    names = {c.__name__ for c in type(error).__mro__}
    if isinstance(error, PermissionError) or names & CREDENTIAL_ERRORS:
        raise DatasetError(
            f"{what}: the store refused it ({error!r}); give credentials as the store expects them (for S3: "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and AWS_ENDPOINT_URL for an S3-compatible "
            "store) with read access to the dataset"
        ) from None


def fetch_with_retries(what: str, fetch, timeout_s: float):
    """``fetch()``, tried again with backoff on errors for ``timeout_s``; then a DataFetchError naming ``what``."""
    deadline, wait = time.monotonic() + timeout_s, BACKOFF_S[0]
    while True:
        try:
            return fetch()
        except FileNotFoundError:
            raise
        except Exception as e:  # any store error is a try that failed, unless the store refused us
            refused(what, e)
            if time.monotonic() + wait > deadline:
                raise DataFetchError(f"{what}: not fetched in {timeout_s:g} s (data.fetch_timeout_s): {e!r}") from e
            time.sleep(wait)
            wait = min(2 * wait, BACKOFF_S[1])


@dataclass(frozen=True)
class CacheSettings:
    """Where a node keeps remote datasets' chunks, how much of its disk they may take, and how long a chunk may
    keep failing to arrive: the spec's ``data.cache_dir``, ``cache_bytes`` and ``fetch_timeout_s``."""

    root: Path = field(default_factory=lambda: default_cache_dir())
    budget: int = Data.model_fields["cache_bytes"].default
    fetch_timeout_s: float = Data.model_fields["fetch_timeout_s"].default
    sharers: int = field(default_factory=lambda: int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def default_cache_dir(configured: str | None = None) -> Path:
    """The node's data cache: ``PHALANX_DATA_CACHE`` (which ``--local-nodes`` sets, one per simulated node),
    else the spec's ``data.cache_dir``, else ``$PHALANX_CACHE/data``."""
    return Path(os.environ.get("PHALANX_DATA_CACHE") or configured or cache_root() / "data")


def open_dataset(
    path: str | Path, verify: Literal["full", "size"] = "full", cache: CacheSettings | None = None
) -> TokenDataset:
    """A prepared dataset wherever it lives: a local directory (or file:// URL), memory-mapped, its shards checked
    as ``verify`` says; else at an fsspec URL, read through the node's cache (``cache``; the defaults without it),
    its shards' sizes checked now and each chunk when it is fetched."""
    if not is_url(path) or str(path).startswith("file://"):
        return TokenDataset(str(path).removeprefix("file://"), verify)
    return open_remote(str(path), cache or CacheSettings())


def open_remote(url: str, settings: CacheSettings) -> TokenDataset:
    """A remote dataset, once its index is read and every shard object found there, of its size."""
    fs, root = open_store(url, settings.fetch_timeout_s)
    name = f"{url.rstrip('/')}/{INDEX}"
    try:
        raw = fetch_with_retries(name, lambda: fs.cat_file(f"{root}/{INDEX}"), settings.fetch_timeout_s)
    except FileNotFoundError:
        raise DatasetError(
            f"{name}: not found; {url} is not a prepared dataset, or its `phalanx data prepare` did not finish "
            "(run it again to resume)"
        ) from None
    index = read_index(name, raw)
    shards = shards_of(index)
    fs.invalidate_cache(root)  # fsspec keeps listings: a process that opened the dataset before would see the old
    listed = fetch_with_retries(url, lambda: fs.ls(root, detail=True), settings.fetch_timeout_s)
    sizes = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry.get("size") for entry in listed}
    width = np.dtype(index["dtype"]).itemsize
    for shard in shards:
        if shard.file not in sizes:
            raise DatasetError(f"{url.rstrip('/')}/{shard.file}: shard missing (listed in {name})")
        if sizes[shard.file] != shard.tokens * width:
            raise DatasetError(
                f"{url.rstrip('/')}/{shard.file}: {sizes[shard.file]} bytes, expected {shard.tokens * width} "
                f"({shard.tokens} tokens): truncated or overwritten; prepare the dataset again"
            )
    cache = ChunkCache(settings.root, dataset_key(url, raw), settings.budget, settings.sharers)
    reader = RemoteShards(fs, url, root, index, shards, np.dtype(index["dtype"]), cache, settings.fetch_timeout_s)
    return TokenDataset.over(url, index, reader)


@dataclass
class FetchStats:
    """What a process's fetching did since the loader last reported it."""

    needed: int = 0  # chunks the loader asked for
    cached: int = 0  # of them, already on the node's disk
    fetched_bytes: int = 0

    def __add__(self, other: FetchStats) -> FetchStats:
        fetched = self.fetched_bytes + other.fetched_bytes
        return FetchStats(self.needed + other.needed, self.cached + other.cached, fetched)

    def take(self) -> FetchStats:
        """These counts, and this object back to zero."""
        taken = FetchStats(self.needed, self.cached, self.fetched_bytes)
        self.needed = self.cached = self.fetched_bytes = 0
        return taken


class RemoteShards:
    """A remote dataset's shards, read in verified chunks through the node's cache."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        url: str,
        root: str,
        index: dict[str, Any],
        shards: list[Shard],
        dtype: np.dtype,
        cache: ChunkCache,
        fetch_timeout_s: float,
    ):
        self.fs, self.url, self.root, self.shards, self.cache = fs, url.rstrip("/"), root.rstrip("/"), shards, cache
        self.fetch_timeout_s, self.itemsize = fetch_timeout_s, dtype.itemsize
        self.dtype = dtype
        self.stats = FetchStats()
        sizes = [s.tokens * self.itemsize for s in shards]
        chunk_bytes = index.get("chunk_bytes")
        # Per shard: its chunk size and checksums; a dataset without chunk checksums is read a shard at a time.
        chunked = [s.chunks is not None for s in shards]
        self.chunk_bytes = [chunk_bytes if c else max(1, size) for c, size in zip(chunked, sizes, strict=True)]
        self.algorithm = [index.get("chunk_digest", "xxh3_128") if s.chunks else "sha256" for s in shards]
        self.digests = [list(s.chunks) if s.chunks is not None else [s.sha256] for s in shards]
        counts = [max(1, math.ceil(size / cb)) for size, cb in zip(sizes, self.chunk_bytes, strict=True)]
        self.first_chunk = np.cumsum([0, *counts])  # chunk ids run across shards, in token order
        self.sizes = sizes
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # one fetch at a time in a process: the fetch locks are per process

    def chunk_ids(self, shard: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The chunk ids of token positions ``local`` of shards ``shard`` (arrays of one shape)."""
        chunk_tokens = np.asarray(self.chunk_bytes)[shard] // self.itemsize
        return self.first_chunk[shard] + local // chunk_tokens

    def take(self, shard: int, positions: np.ndarray) -> np.ndarray:
        """Tokens at ``positions`` (any shape) of ``shard``, fetching what the node does not hold."""
        chunk_tokens = self.chunk_bytes[shard] // self.itemsize
        flat = positions.ravel()
        order = np.argsort(flat // chunk_tokens, kind="stable")  # grouped by chunk: one gather per chunk
        chunks = flat[order] // chunk_tokens
        firsts = np.flatnonzero(np.diff(chunks, prepend=-1))
        out = np.empty(flat.size, dtype=self.dtype)
        for first, last in zip(firsts, [*firsts[1:], flat.size], strict=True):
            c = int(chunks[first])
            rows = order[first:last]
            out[rows] = self._tokens(int(self.first_chunk[shard]) + c)[flat[rows] - c * chunk_tokens]
        return out.reshape(positions.shape)

    def fetch(self, ids: Iterable[int]) -> None:
        """Make sure the node holds chunks ``ids`` (the loader's look-ahead): fetch the missing ones, waiting for
        those another rank of the node is fetching."""
        ids = sorted(set(ids))
        with self._lock:
            # A chunk this process has mapped stays readable here, even if evicted from the disk since.
            missing = [i for i in ids if i not in self._open and not self._path(i).is_file()]
            keep = frozenset(self._path(i) for i in missing)
            self.stats.needed += len(ids)
            self.stats.cached += len(ids) - len(missing)
            deadline = time.monotonic() + self.fetch_timeout_s
            while missing:
                mine, theirs = self.cache.claim(missing)
                try:
                    self._download([i for i in mine if not self._path(i).is_file()], keep)
                finally:
                    self.cache.release(mine)
                missing = self._await(theirs, deadline)

    def _await(self, ids: list[int], deadline: float) -> list[int]:
        """Wait for chunks other ranks are fetching; those they gave up on (lock let go, no file) are returned."""
        left = []
        for i in ids:
            while not self._path(i).is_file():
                if not self.cache.fetching(i):
                    if not self._path(i).is_file():
                        left.append(i)
                    break
                if time.monotonic() > deadline:
                    raise DataFetchError(
                        f"{self._name(i)}: another rank of this node has been fetching it for more than "
                        f"{self.fetch_timeout_s:g} s (data.fetch_timeout_s)"
                    )
                time.sleep(WAIT_POLL_S)
        return left

    def _download(self, ids: list[int], keep: frozenset[Path]) -> None:
        """Fetch chunks ``ids`` concurrently; tries again those that failed or were bad (see the module's doc)."""
        deadline, wait = time.monotonic() + self.fetch_timeout_s, BACKOFF_S[0]
        bad: dict[int, int] = {}
        while ids:
            spans = [self._span(i) for i in ids]
            got = self._ranges(ids, spans)
            failed, why, missing = [], "", None
            for i, (_, start, end), data in zip(ids, spans, got, strict=True):
                if isinstance(data, FileNotFoundError):  # it was there at the start: a store coming back, maybe
                    missing = i
                if isinstance(data, BaseException):
                    refused(self._name(i), data)
                if isinstance(data, BaseException) or len(data) != end - start:
                    why = repr(data) if isinstance(data, BaseException) else f"{len(data)} of {end - start} bytes"
                    failed.append(i)
                    continue
                shard, chunk = self._locate(i)
                if (found := bytes_digest(data, self.algorithm[shard])) != self.digests[shard][chunk]:
                    bad[i] = bad.get(i, 0) + 1
                    if bad[i] >= CORRUPT_TRIES:
                        raise DatasetError(
                            f"{self._name(i)}: checksum mismatch {CORRUPT_TRIES} times ({self.algorithm[shard]} "
                            f"{found}, the index says {self.digests[shard][chunk]}): the object in the store is "
                            "corrupt; prepare the dataset again"
                        )
                    failed.append(i)
                    continue
                self.cache.put(shard, chunk, data, keep)
                self.stats.fetched_bytes += len(data)
            if failed and time.monotonic() + wait > deadline:
                if missing is not None:
                    raise DatasetError(
                        f"{self.url}/{self.shards[self._locate(missing)[0]].file}: missing from the store for "
                        f"{self.fetch_timeout_s:g} s (data.fetch_timeout_s), though its index lists it and it was "
                        "there when the job started: deleted or overwritten; prepare the dataset again"
                    )
                raise DataFetchError(
                    f"{self._name(failed[0])} and {len(failed) - 1} other chunk(s): not fetched in "
                    f"{self.fetch_timeout_s:g} s (data.fetch_timeout_s); last error: {why or 'checksum mismatch'}"
                )
            if failed:  # into the rank's log: an outage of the store is seen where it happened
                print(
                    f"data: {len(failed)} chunk(s) from {self.url} not fetched ({why or 'checksum mismatch'}); "
                    f"trying again in {wait:g} s (for up to data.fetch_timeout_s = {self.fetch_timeout_s:g} s)",
                    flush=True,
                )
                time.sleep(wait)
                wait = min(2 * wait, BACKOFF_S[1])
            ids = failed

    def _ranges(self, ids: list[int], spans: list[tuple[str, int, int]]) -> list[bytes | BaseException]:
        """Each chunk's bytes (or the error that stopped them): a run of neighbouring chunks of a shard is one
        request of up to ``RUN`` chunks, the requests concurrent (a store's cost is mostly per request)."""
        runs: list[list[int]] = []
        for k, i in enumerate(ids):
            if runs and i == ids[runs[-1][-1]] + 1 and spans[k][0] == spans[k - 1][0] and len(runs[-1]) < RUN:
                runs[-1].append(k)
            else:
                runs.append([k])
        try:
            got = self.fs.cat_ranges(
                [spans[run[0]][0] for run in runs],
                [spans[run[0]][1] for run in runs],
                [spans[run[-1]][2] for run in runs],
                on_error="return",
            )
        except Exception as e:  # the whole batch failed (the store down): every chunk did
            got = [e] * len(runs)
        out: list[bytes | BaseException] = []
        for run, data in zip(runs, got, strict=True):
            first = spans[run[0]][1]
            for k in run:  # a run cut short leaves its last chunks short: they are tried again
                out.append(data if isinstance(data, BaseException) else data[spans[k][1] - first : spans[k][2] - first])
        return out

    def verify(self) -> None:
        """Read every shard from the store and check its sha256 (``phalanx data verify URL``)."""
        for shard in self.shards:
            path, name = f"{self.root}/{shard.file}", f"{self.url}/{shard.file}"
            found = fetch_with_retries(name, lambda path=path: file_digest(path, fs=self.fs), self.fetch_timeout_s)
            if found != shard.sha256:
                raise DatasetError(
                    f"{name}: checksum mismatch (sha256 {found}, index says {shard.sha256}): the shard is corrupt; "
                    "prepare the dataset again"
                )

    def _tokens(self, i: int) -> np.ndarray:
        """Chunk ``i``'s tokens, mapped from the cache (fetched first if the node does not hold it) and checked
        when mapped: the disk may have lost what it was given (a crash before it wrote it all)."""
        if (tokens := self._open.get(i)) is not None:
            self._open.move_to_end(i)
            return tokens
        path, bad = self._path(i), 0
        while True:
            try:
                tokens = _mapped(path, self.dtype)
            except FileNotFoundError:  # evicted since the look-ahead fetched it, or never fetched
                self.fetch([i])
                continue
            shard, chunk = self._locate(i)
            if bytes_digest(tokens, self.algorithm[shard]) == self.digests[shard][chunk]:
                break
            self.cache.drop(path)  # bad bytes on this disk: fetch it again
            bad += 1
            if bad >= CORRUPT_TRIES:
                raise DatasetError(
                    f"{path}: this node's disk gave back other bytes than were written, {bad} times, for "
                    f"{self._name(i)}; check the disk under data.cache_dir"
                )
        self.cache.used(path)
        self._open[i] = tokens
        if len(self._open) > OPEN_CHUNKS:
            self._open.popitem(last=False)
        return tokens

    def _locate(self, i: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.first_chunk, i, side="right")) - 1
        return shard, i - int(self.first_chunk[shard])

    def _span(self, i: int) -> tuple[str, int, int]:
        """(object, first byte, end byte) of chunk ``i``."""
        shard, chunk = self._locate(i)
        start = chunk * self.chunk_bytes[shard]
        return f"{self.root}/{self.shards[shard].file}", start, min(start + self.chunk_bytes[shard], self.sizes[shard])

    def _path(self, i: int) -> Path:
        shard, chunk = self._locate(i)
        return self.cache.path(shard, chunk)

    def _name(self, i: int) -> str:
        _, start, end = self._span(i)
        return f"{self.url}/{self.shards[self._locate(i)[0]].file} (bytes {start}-{end})"


def _mapped(path: Path, dtype: np.dtype) -> np.ndarray:
    """A chunk's tokens, mapped read-only: a plain array over the map (np.memmap's subclass costs more per read)."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # zero bytes cannot be mapped
            return np.empty(0, dtype=dtype)
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=dtype)
