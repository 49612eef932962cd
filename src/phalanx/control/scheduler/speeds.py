"""How fast each kind of job runs on each GPU type, as Gavel (OSDI'20) models a fleet of several: a rate per
(kind, type), in whatever unit the kind's runs report (tokens/s for phalanx's jobs; steps/s in Gavel's table).
Measured where jobs of the kind have run, smoothed. Elsewhere estimated from where it has run, scaled by how
the two types compare for the kinds measured on both (the geometric mean of their ratios: what the fleet has
taught), or by their peak FLOP/s before any kind has run on both. Policies compare one kind's rates across
types only (``relative``), so the units never meet."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from phalanx.control.scheduler.cluster import GpuType


class Speeds:
    def __init__(self, types: Mapping[str, GpuType], smoothing: float = 0.3):
        self.types, self.smoothing = types, smoothing
        self.measured: dict[str, dict[str, float]] = {}  # kind -> {type: its smoothed rate}
        self._ratios: dict[tuple[str, str], float] | None = None  # (a, b) -> log(rate on a / rate on b), learned
        self._relative: dict[tuple[str, tuple[str, ...]], dict[str, float]] = {}  # until a figure changes

    def observe(self, kind: str, gpu_type: str, rate: float) -> None:
        """A run of ``kind`` on ``gpu_type`` (one type: a mixed gang says nothing of each) made ``rate``."""
        if not math.isfinite(rate) or rate <= 0 or "+" in gpu_type:
            return
        on = self.measured.setdefault(kind, {})
        old = on.get(gpu_type)
        new = on[gpu_type] = rate if old is None else old + self.smoothing * (rate - old)
        if new != old:
            self._relative.clear()
            if len(on) > 1:
                self._ratios = None  # how the types compare has changed

    def rate(self, kind: str, gpu_type: str) -> float:
        """Measured; else the geometric mean, over the types it was measured on, of each rate scaled by how
        the types compare (``log_ratio``); for a kind never run, how the type compares with the first type.
        A mixed gang ("a+b") runs at the pace of its slowest type."""
        if "+" in gpu_type:
            return min(self.rate(kind, part) for part in gpu_type.split("+"))
        on = self.measured.get(kind)
        if on and gpu_type in on:
            return on[gpu_type]
        if not on:
            return math.exp(self.log_ratio(gpu_type, next(iter(self.types), gpu_type)))
        logs = [math.log(r) + self.log_ratio(gpu_type, t) for t, r in on.items()]
        return math.exp(sum(logs) / len(logs))

    def log_ratio(self, a: str, b: str) -> float:
        """log(rate on ``a`` / rate on ``b``): the mean over the kinds measured on both, else the peak FLOP/s."""
        if self._ratios is None:
            sums: dict[tuple[str, str], list[float]] = {}
            for on in self.measured.values():
                for x, rx in on.items():
                    for y, ry in on.items():
                        if x != y:
                            sums.setdefault((x, y), []).append(math.log(rx / ry))
            self._ratios = {pair: sum(logs) / len(logs) for pair, logs in sums.items()}
        if a == b:
            return 0.0
        learned = self._ratios.get((a, b))
        return learned if learned is not None else math.log(self._peak(a) / self._peak(b))

    def _peak(self, gpu_type: str) -> float:
        known = self.types.get(gpu_type)
        return known.tflops if known is not None and known.tflops > 0 else 1.0

    def relative(self, kind: str, types: Sequence[str]) -> dict[str, float]:
        """Each type's rate for ``kind`` over the best of ``types``: 1.0 for the fastest."""
        key = (kind, tuple(types))
        if (known := self._relative.get(key)) is None:
            rates = {t: self.rate(kind, t) for t in types}
            best = max(rates.values(), default=1.0)
            known = self._relative[key] = {t: r / best for t, r in rates.items()}
        return known
