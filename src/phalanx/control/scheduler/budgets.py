"""Budgets: a tenant whose runs have cost its budget in the period starts nothing more until the period turns
or the budget is raised. Its running jobs go on (stopping them would waste what they have not checkpointed);
its pending jobs, and those it submits, wait out of the queue, saying why. Checked before each round, by the
control plane and the simulator alike."""

from __future__ import annotations

from phalanx.control.scheduler.state import State


def enforce(state: State, now: float) -> None:
    """Hold the pending jobs of each tenant at or over its budget; release those of the others."""
    for tenant in state.tenants.values():
        if tenant.budget is None:
            state.release(tenant.name)
            continue
        spent = state.dollars(tenant.name, now)
        if spent < tenant.budget:
            state.release(tenant.name)
        elif tenant.name not in state.holding:
            state.hold(
                tenant.name,
                f"tenant {tenant.name} has spent ${spent:,.2f} of its ${tenant.budget:,.2f} budget for this period: "
                "its jobs start when the period turns or the budget is raised (its running jobs go on)",
            )
