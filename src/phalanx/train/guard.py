"""Which training steps are bad: a loss or grad norm that is NaN/Inf, or a loss that spikes. A bad step's
update is not applied; ``resilience.on_nan`` decides what happens next (stop, skip, roll back).

A spike is a loss above ``loss_spike_factor`` times the median of the last ``WINDOW`` good losses, judged
once ``MIN_HISTORY`` are known (the first steps of a run fall fast and prove nothing).

resilience.on_nan: stop fails (not retried: the same data would do the same); skip goes on past the batch;
rollback reloads the last valid checkpoint and replays from it, which clears a transient fault (a bad
device, a bit flip), and a bad step that comes back at the same step is the data's: that batch is skipped.
More than ``MAX_BAD_IN_A_ROW`` bad steps in a row is not recovery: it stops.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 50
MIN_HISTORY = 10
MAX_BAD_IN_A_ROW = 5


class BadLoss(FloatingPointError):
    """Training produced NaN/Inf or a loss spike, and resilience.on_nan says to stop (or skipping no longer
    helps)."""


class LossGuard:
    def __init__(self, spike_factor: float | None, on_nan: str):
        self.spike_factor, self.on_nan = spike_factor, on_nan
        self._good: deque[float] = deque(maxlen=WINDOW)
        self._in_a_row = 0
        self._rolled_back: set[int] = set()  # bad steps that were replayed from a checkpoint

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
        self._in_a_row = 0

    def bad(self, step: int, what: str) -> bool:
        """A bad step (0-based ``step``, ``what`` was wrong): whether to roll back to the last checkpoint (else
        skip its batch); BadLoss when on_nan says stop or skipping no longer helps."""
        self._in_a_row += 1
        if self.on_nan == "stop" or self._in_a_row > MAX_BAD_IN_A_ROW:
            why = "resilience.on_nan: stop" if self.on_nan == "stop" else f"{self._in_a_row} bad steps in a row"
            raise BadLoss(f"{what} ({why})")
        return self.on_nan == "rollback" and step not in self._rolled_back

    def rolled_back(self, step: int) -> None:
        """``step`` is replayed from a checkpoint: if it is bad again, its batch is skipped."""
        self._rolled_back.add(step)
