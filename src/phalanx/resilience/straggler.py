"""Straggler detection from the compute time each rank reports with its heartbeat (see train/timing.py).

A rank whose median compute over its last ``WINDOW`` reported steps stays above ``factor`` times the median
of the other ranks' is a straggler: every step of the job waits for it. It is reported (rank, node, how much
slower), once per attempt; the job goes on: a straggler is slow, not broken.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 10
MIN_GAP_S = 0.002  # below this the difference is timer noise, whatever the ratio


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float  # its median compute per step
    others_s: float  # the median of the other ranks' medians

    @property
    def ratio(self) -> float:
        return self.compute_s / self.others_s


class StragglerDetector:
    def __init__(self, factor: float):
        self.factor = factor
        self._seen: dict[int, deque[tuple[int, float]]] = {}
        self._reported: set[int] = set()

    def reset(self) -> None:
        self._seen.clear()
        self._reported.clear()

    def observe(self, rank: int, step: int, compute_s: float) -> None:
        seen = self._seen.setdefault(rank, deque(maxlen=WINDOW))
        if not seen or seen[-1][0] != step:
            seen.append((step, compute_s))

    def check(self) -> Straggler | None:
        """A straggler not reported yet in this attempt, if there is one."""
        if len(self._seen) < 2 or any(len(s) < WINDOW for s in self._seen.values()):
            return None
        medians = {rank: statistics.median(c for _, c in seen) for rank, seen in self._seen.items()}
        for rank, mine in sorted(medians.items(), key=lambda item: -item[1]):
            others = statistics.median(m for r, m in medians.items() if r != rank)
            if rank not in self._reported and mine > self.factor * others and mine - others > MIN_GAP_S:
                self._reported.add(rank)
                return Straggler(rank, mine, others)
        return None
