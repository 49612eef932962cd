"""``checkpoint.every_steps: auto``: how often to save, from what a save costs and how often the job fails.

Young (1974) and Daly (2006): with saves that cost C seconds of training each and failures every M seconds
on average, the time lost per unit of work (saving, plus redoing the work since the last save) is least
with saves sqrt(2 C M) apart. C is measured: the training time the last save blocked. M is the job's mean
time between failures: ``resilience.mtbf_hours``, by default the Llama 3 report's rate (419 unexpected
interruptions in 54 days on 16,384 GPUs: one per ~50,700 GPU-hours) scaled by the job's processes, and
updated with the failures this run has seen, counting the prior as one failure in one prior MTBF.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.obs.rates import default_mtbf_hours, young_daly_s

FIRST_EVERY_STEPS = 10  # until a save's cost has been measured
__all__ = ["FIRST_EVERY_STEPS", "Interval", "choose", "default_mtbf_hours"]


@dataclass(frozen=True)
class Interval:
    steps: int
    seconds: float  # Young/Daly's optimum
    cost_s: float
    step_s: float
    mtbf_hours: float
    failures: int

    def why(self) -> str:
        return (
            f"checkpoint every {self.steps} step(s): Young/Daly sqrt(2 x {self.cost_s * 1e3:.0f} ms per save x "
            f"{self.mtbf_hours:,.3g} h between failures) = {self.seconds:,.1f} s at {self.step_s:.3f} s per step "
            f"({self.failures} failure(s) seen so far)"
        )


def choose(cost_s: float, step_s: float, prior_mtbf_hours: float, failures: int, run_hours: float) -> Interval:
    """The interval for a save costing ``cost_s`` and steps of ``step_s``, after ``failures`` in ``run_hours``."""
    mtbf_hours = (prior_mtbf_hours + run_hours) / (1 + failures)
    seconds = young_daly_s(cost_s, mtbf_hours * 3600)
    return Interval(max(1, round(seconds / step_s)), seconds, cost_s, step_s, mtbf_hours, failures)
