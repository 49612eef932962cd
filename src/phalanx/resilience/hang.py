"""Hang detection from step heartbeats: a rank that reported a step and then makes no progress for longer than
the hang timeout is hung. (A collective stalled on a lost peer never returns, and gloo cannot abort it: the
only remedy is to kill the processes and restart, which the supervisor does.)

The timeout is the spec's ``resilience.hang_timeout_s``, or with ``auto`` derived from the step times seen so
far in the run: max(3x their p99, a floor), the floor covering the occasional long step (a sync checkpoint, an
evaluation). Ranks are watched only once they report, so start-up (compilation, data preparation) and scripts
that do not use the worker SDK's heartbeat are never taken for hangs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

AUTO_FLOOR_S = 120.0
AUTO_FACTOR = 3.0
WINDOW = 1000  # step times kept for the p99: the recent ones


@dataclass(frozen=True)
class Stall:
    rank: int  # the rank behind
    step: int  # the steps it completed (a heartbeat's step counts from 0; what people read, from 1)
    silent_s: float  # the longest any rank has gone without progress
    timeout_s: float


class HangDetector:
    def __init__(self, timeout_s: float | str):
        self.fixed = timeout_s if isinstance(timeout_s, int | float) else None
        self._intervals: deque[float] = deque(maxlen=WINDOW)  # seconds per step, per rank, across attempts
        self._last: dict[int, tuple[int, float]] = {}  # rank -> (step, when it was first seen)
        self.first_progress: float | None = None  # when this attempt's first step was seen

    def reset(self) -> None:
        """A new attempt: forget the ranks' positions (step times stay: the job is the same)."""
        self._last.clear()
        self.first_progress = None

    @property
    def latest_step(self) -> int | None:
        """The furthest step any rank has reported in this attempt."""
        return max((step for step, _ in self._last.values()), default=None)

    def timeout_s(self) -> float:
        if self.fixed is not None:
            return float(self.fixed)
        if not self._intervals:
            return AUTO_FLOOR_S
        ordered = sorted(self._intervals)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return max(AUTO_FACTOR * p99, AUTO_FLOOR_S)

    def observe(self, rank: int, step: int, now: float) -> None:
        if self.first_progress is None:
            self.first_progress = now
        last = self._last.get(rank)
        if last is None or step != last[0]:
            if last is not None and step > last[0]:
                self._intervals.append((now - last[1]) / (step - last[0]))
            self._last[rank] = (step, now)

    def stalled(self, now: float) -> Stall | None:
        """If some rank has been silent past the timeout: the rank behind the others (the lowest step, then
        the longest silent), which the rest are most likely waiting for, and the longest silence."""
        timeout = self.timeout_s()
        silent = max((now - since for _, since in self._last.values()), default=0.0)
        if silent <= timeout:
            return None
        rank, (step, _) = min(self._last.items(), key=lambda item: item[1])
        return Stall(rank, step + 1, silent, timeout)
