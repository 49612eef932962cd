"""Which training steps are bad: a loss or grad norm that is NaN/Inf, or a loss that spikes. A bad step's
update is not applied; ``resilience.on_nan`` decides what happens next (stop, skip, roll back).

A spike is a loss above ``loss_spike_factor`` times the median of the last ``WINDOW`` good losses, judged
once ``MIN_HISTORY`` are known (the first steps of a run fall fast and prove nothing).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 50
MIN_HISTORY = 10


class LossGuard:
    def __init__(self, spike_factor: float | None):
        self.spike_factor = spike_factor
        self._good: deque[float] = deque(maxlen=WINDOW)

    def problem(self, loss: float, grad_norm: float) -> str | None:
        """What is wrong with a step of this loss and grad norm, or None."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"non-finite loss {loss} / grad norm {grad_norm}"
        if self.spike_factor is not None and len(self._good) >= MIN_HISTORY:
            median = statistics.median(self._good)
            if loss > self.spike_factor * median:
                return f"loss spike {loss:.4g} (over {self.spike_factor:g}x the recent median {median:.4g})"
        return None

    def good(self, loss: float) -> None:
        self._good.append(loss)
