"""What the trainer reads: the global batch of step s is a pure function of (datasets, weights, seed, s);
a data-parallel rank reads its contiguous slice of it, prefetched in a background thread.

The loader's whole state is the next step (and the seed, which the spec holds): O(1) to save and restore.
From a dataset in object storage, a second thread fetches the chunks of the coming ``AHEAD`` steps' samples
into the node's cache, so a rank resumed at step s fetches from s on, and only what its own rows need.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from phalanx.data.builtin import resolve
from phalanx.data.remote import CacheSettings, FetchStats, RemoteShards, default_cache_dir, open_dataset
from phalanx.data.sampler import GlobalSampler
from phalanx.data.shards import DatasetError, TokenDataset, is_url, too_short
from phalanx.spec.model import Data

AHEAD = 8  # steps whose chunks the loader fetches before the trainer needs them


class BatchSource(Protocol):
    vocab_size: int

    def local_batch(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> torch.Tensor: ...


class TokenSource:
    def __init__(
        self,
        datasets: Sequence[TokenDataset],
        weights: Sequence[float],
        seq_len: int,
        seed: int,
        names: Sequence[str] | None = None,
    ):
        names = names or [str(d.root) for d in datasets]
        for d, name in zip(datasets, names, strict=True):
            if (short := too_short(d, seq_len)) is not None:
                raise DatasetError(f"data source {name}: {short}")
        self.datasets, self.seq_len = list(datasets), seq_len
        self.vocab_size = max(d.vocab_size for d in datasets)
        self.sampler = GlobalSampler([d.num_samples(seq_len) for d in datasets], weights, seed)
        self.remote = [s for s, d in enumerate(self.datasets) if isinstance(d.reader, RemoteShards)]
        self.fetching = bool(self.remote)

    @classmethod
    def from_spec(cls, data: Data, seq_len: int, seed: int) -> TokenSource:
        cache = None
        if any(is_url(s.path) for s in data.sources):
            cache = CacheSettings(default_cache_dir(data.cache_dir), data.cache_bytes, data.fetch_timeout_s)
        datasets = [open_dataset(resolve(s.path), data.verify, cache) for s in data.sources]
        return cls(datasets, [s.weight for s in data.sources], seq_len, seed, [s.path for s in data.sources])

    @functools.lru_cache(maxsize=4 * AHEAD)  # noqa: B019 - the loader's look-ahead and its reads ask for each step
    def locate(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        """(source, sample index) of the rows that ``dp_rank`` reads at ``step``."""
        per_rank = global_batch // dp_size
        first = step * global_batch + dp_rank * per_rank
        return self.sampler.locate(np.arange(first, first + per_rank))

    def fetch(self, steps: range, global_batch: int, dp_rank: int, dp_size: int) -> FetchStats:
        """Bring onto the node the chunks of ``dp_rank``'s rows of ``steps``; what fetching did since last asked."""
        located = [self.locate(step, global_batch, dp_rank, dp_size) for step in steps]
        sources = np.concatenate([s for s, _ in located])
        indices = np.concatenate([i for _, i in located])
        taken = FetchStats()
        for s in self.remote:
            dataset = self.datasets[s]
            assert isinstance(dataset.reader, RemoteShards)
            if (rows := sources == s).any():
                dataset.reader.fetch(dataset.chunks(indices[rows], self.seq_len).tolist())
            taken += dataset.reader.stats.take()
        return taken

    def check_cache(self, global_batch: int, dp_size: int, steps: int) -> None:
        """A cache that cannot hold the chunks of the steps the loader keeps ahead would fetch them twice."""
        for s in self.remote:
            reader = self.datasets[s].reader
            assert isinstance(reader, RemoteShards)
            chunk = max(reader.chunk_bytes)
            per_sample = 1 + (self.seq_len + 1) * reader.itemsize / chunk  # chunks a window lies in, on average
            need = math.ceil(steps * -(-global_batch // dp_size) * per_sample * reader.cache.sharers) * chunk
            if reader.cache.budget < need:
                raise DatasetError(
                    f"data.cache_bytes = {reader.cache.budget:,} is smaller than the chunks of the {steps} steps "
                    f"the loader keeps ahead on this node ({need:,} bytes for {reader.cache.sharers} rank(s) and "
                    f"chunks of {chunk:,} bytes): make it at least {need:,}"
                )

    def local_batch(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        sources, indices = self.locate(step, global_batch, dp_rank, dp_size)
        batch = np.empty((sources.size, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(sources):
            rows = sources == s
            batch[rows] = self.datasets[s].samples(indices[rows], self.seq_len)
        return torch.from_numpy(batch)


class Prefetcher:
    """Reads the batches of the coming steps in a background thread, ``depth`` ahead of the trainer; from object
    storage, a second thread fetches the chunks of the ``AHEAD`` steps after the one being read."""

    def __init__(
        self, source: BatchSource, global_batch: int, dp_rank: int, dp_size: int, start_step: int, depth: int = 2
    ):
        self.next_step = start_step
        self._queue: queue.Queue[tuple[int, torch.Tensor] | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._fetch: _FetchAhead | None = None
        args = (source, global_batch, dp_rank, dp_size, start_step)
        if isinstance(source, TokenSource) and source.fetching:
            source.check_cache(global_batch, dp_size, AHEAD + depth + 1)
            self._fetch = _FetchAhead(source, global_batch, dp_rank, dp_size, start_step, self._stop)
        self._thread = threading.Thread(target=self._run, args=args, name="phalanx-prefetch", daemon=True)
        self._thread.start()

    def _run(self, source: BatchSource, global_batch: int, dp_rank: int, dp_size: int, step: int) -> None:
        try:
            while not self._stop.is_set():
                if self._fetch is not None and not self._fetch.ready(step):
                    continue
                batch = source.local_batch(step, global_batch, dp_rank, dp_size)
                item = (step, batch.pin_memory() if torch.cuda.is_available() else batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BaseException as e:  # hand the error to the trainer's thread, where it is raised
            self._queue.put(e)

    def next(self) -> torch.Tensor:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        step, batch = item
        assert step == self.next_step, f"prefetcher out of order: got step {step}, expected {self.next_step}"
        self.next_step += 1
        return batch

    def figures(self) -> dict[str, float]:
        """Since last asked, from object storage: bytes fetched, the share of needed chunks the node already held,
        and the time the loader waited for chunks; nothing for local data."""
        return self._fetch.figures() if self._fetch is not None else {}

    def state_dict(self) -> dict[str, int]:
        return {"step": self.next_step}

    def close(self) -> None:
        self._stop.set()
        if self._fetch is not None:
            self._fetch.close()
        self._thread.join(timeout=5)


class _FetchAhead:
    """The fetching thread: keeps the chunks of the steps from the one being read to ``AHEAD`` after it on the
    node, a round of steps at a time (their chunks fetched concurrently); a step being waited for, by itself."""

    def __init__(
        self, source: TokenSource, global_batch: int, dp_rank: int, dp_size: int, step: int, stop: threading.Event
    ):
        self._cond = threading.Condition()
        self._reading, self._fetched, self._stop = step, step, stop
        self._error: BaseException | None = None
        self._stats, self._wait_s = FetchStats(), 0.0
        args = (source, global_batch, dp_rank, dp_size)
        self._thread = threading.Thread(target=self._run, args=args, name="phalanx-fetch", daemon=True)
        self._thread.start()

    def _run(self, source: TokenSource, global_batch: int, dp_rank: int, dp_size: int) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    if self._fetched >= self._reading + AHEAD:
                        self._cond.wait(timeout=0.1)
                        continue
                    # The step being read waits alone (a cold start's first batch), the rest come in one round.
                    last = self._fetched + 1 if self._fetched <= self._reading else self._reading + AHEAD
                    steps = range(self._fetched, last)
                taken = source.fetch(steps, global_batch, dp_rank, dp_size)
                with self._cond:
                    self._fetched, self._stats = steps.stop, self._stats + taken
                    self._cond.notify_all()
        except BaseException as e:  # the reading thread raises it
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def ready(self, step: int) -> bool:
        """Whether ``step``'s chunks are on the node, waiting a little for them (the time is the loader's wait)."""
        started = time.perf_counter()
        with self._cond:
            if self._reading != step:
                self._reading = step
                self._cond.notify_all()
            if self._fetched <= step and self._error is None:
                self._cond.wait(timeout=0.1)
            self._wait_s += time.perf_counter() - started
            if self._error is not None:
                raise self._error
            return self._fetched > step

    def figures(self) -> dict[str, float]:
        with self._cond:
            taken, wait_s = self._stats, self._wait_s
            self._stats, self._wait_s = FetchStats(), 0.0
        return {
            "data_fetched_bytes": taken.fetched_bytes,
            "data_cache_hit_rate": taken.cached / taken.needed if taken.needed else 1.0,
            "data_fetch_wait_s": wait_s,
        }

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5)
