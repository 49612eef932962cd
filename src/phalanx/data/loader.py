"""What the trainer reads: the global batch of step s is a pure function of (datasets, weights, seed, s);
a data-parallel rank reads its contiguous slice of it, prefetched in a background thread.

The loader's whole state is the next step (and the seed, which the spec holds): O(1) to save and restore.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from phalanx.data.builtin import resolve
from phalanx.data.sampler import GlobalSampler
from phalanx.data.shards import DatasetError, TokenDataset, too_short
from phalanx.spec.model import Data


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

    @classmethod
    def from_spec(cls, data: Data, seq_len: int, seed: int) -> TokenSource:
        datasets = [TokenDataset(resolve(s.path), verify=data.verify) for s in data.sources]
        return cls(datasets, [s.weight for s in data.sources], seq_len, seed, [s.path for s in data.sources])

    def locate(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        """(source, sample index) of the rows that ``dp_rank`` reads at ``step``."""
        per_rank = global_batch // dp_size
        first = step * global_batch + dp_rank * per_rank
        return self.sampler.locate(np.arange(first, first + per_rank))

    def local_batch(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        sources, indices = self.locate(step, global_batch, dp_rank, dp_size)
        batch = np.empty((sources.size, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(sources):
            rows = sources == s
            batch[rows] = self.datasets[s].samples(indices[rows], self.seq_len)
        return torch.from_numpy(batch)


class Prefetcher:
    """Reads the batches of the coming steps in a background thread, ``depth`` ahead of the trainer."""

    def __init__(
        self, source: BatchSource, global_batch: int, dp_rank: int, dp_size: int, start_step: int, depth: int = 2
    ):
        self.next_step = start_step
        self._queue: queue.Queue[tuple[int, torch.Tensor] | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        args = (source, global_batch, dp_rank, dp_size, start_step)
        self._thread = threading.Thread(target=self._run, args=args, name="phalanx-prefetch", daemon=True)
        self._thread.start()

    def _run(self, source: BatchSource, global_batch: int, dp_rank: int, dp_size: int, step: int) -> None:
        try:
            while not self._stop.is_set():
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

    def state_dict(self) -> dict[str, int]:
        return {"step": self.next_step}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
