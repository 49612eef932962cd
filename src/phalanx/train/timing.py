"""Per-rank compute time of the blocks' forward passes: the straggler signal.

In synchronous training every rank's step takes as long as the slowest rank's, because the others wait for
it in collectives; the step time cannot say which rank is slow. The time between a block's forward
pre-hook and its forward hook can: FSDP's all-gather (and its wait) runs in FSDP's own pre-hook, registered
before ours, so what is timed is the rank's own compute. On CUDA the interval is measured with events on the
compute stream (read after the step, when the loss has been synchronised); elsewhere with the wall clock.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class ForwardComputeTimer:
    def __init__(self, blocks: list[nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: float | torch.cuda.Event | None = None
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0
        for block in blocks:
            block.register_forward_pre_hook(lambda *_: self._start())
            block.register_forward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = event
        else:
            self._open = time.perf_counter()

    def _stop(self) -> None:
        if self._open is None:
            return
        if isinstance(self._open, float):
            self._seconds += time.perf_counter() - self._open
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._open, end))
        self._open = None

    def take(self) -> float:
        """Seconds of forward compute since the last call (call after the step has synchronised)."""
        seconds = self._seconds + sum(start.elapsed_time(end) for start, end in self._spans) / 1e3
        self._seconds, self._spans = 0.0, []
        return seconds
