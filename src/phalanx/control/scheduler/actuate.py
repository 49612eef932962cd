"""Carrying a round out, the same way for both callers of the scheduling core. ``apply`` hands each decision
to the caller's actuator and, once carried out, records it in the State the next round reads: the simulator's
actuator models what the decision costs; the server's records it in the store, and its executor acts on it
after the commit. So what the simulator measured is what the server runs."""

from __future__ import annotations

from typing import Protocol

from phalanx.control.scheduler.jobs import Admit, Preempt, Round
from phalanx.control.scheduler.state import State


class Actuator(Protocol):
    def admit(self, admit: Admit, now: float) -> bool:
        """Start the job where it was placed; False if it can no longer start (cancelled since the round
        read the state)."""
        ...

    def preempt(self, preempt: Preempt, now: float) -> bool:
        """Ask the victim to checkpoint and leave; False if it is no longer running."""
        ...


def apply(decided: Round, state: State, actuator: Actuator, now: float) -> None:
    """Admissions first, in the round's order (each took its GPUs in that order), then preemptions."""
    for admit in decided.admit:
        if actuator.admit(admit, now):
            state.start(admit.job, admit.placement, now, admit.carve)
    for preempt in decided.preempt:
        if actuator.preempt(preempt, now):
            state.ask_to_evict(preempt.job, preempt.for_job)
