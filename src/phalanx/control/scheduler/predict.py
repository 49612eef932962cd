"""Duration prediction from what is known when a job is submitted: how long its tenant's recent jobs of the
same size ran (many teams resubmit the same experiment with a new seed or learning rate). Never the job's own
duration: the simulator feeds this only with jobs that have finished."""

from __future__ import annotations

import statistics
from collections import deque


class DurationPredictor:
    def __init__(self, window: int = 20, min_samples: int = 3, default_s: float = 3600.0):
        self.window, self.min_samples, self.default_s = window, min_samples, default_s
        self._history: dict[tuple[str, int | None], deque[float]] = {}

    def record(self, tenant: str, gpus: int, duration_s: float) -> None:
        for key in ((tenant, gpus), (tenant, None)):
            self._history.setdefault(key, deque(maxlen=self.window)).append(duration_s)

    def predict(self, tenant: str, gpus: int) -> float:
        """The median of the tenant's last ``window`` jobs of this size, else of any size, else ``default_s``."""
        for key in ((tenant, gpus), (tenant, None)):
            history = self._history.get(key)
            if history is not None and len(history) >= self.min_samples:
                return statistics.median(history)
        return self.default_s
