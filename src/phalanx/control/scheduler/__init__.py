"""The scheduling core: pure functions and plain data, no I/O and no clock (the caller passes time in), so that
the control plane and the trace simulator run the same decisions."""

from phalanx.control.scheduler.actuate import Actuator, apply
from phalanx.control.scheduler.baselines import Fifo, KueueLike, TiresiasLike
from phalanx.control.scheduler.budgets import enforce as enforce_budgets
from phalanx.control.scheduler.cluster import ANY_TYPE, Cluster, GpuType, Node
from phalanx.control.scheduler.costs import PreemptionCost
from phalanx.control.scheduler.gavel import GavelLike
from phalanx.control.scheduler.jobs import Admit, Job, Preempt, Round, Run, Tenant, Wait
from phalanx.control.scheduler.placement import Placement, place
from phalanx.control.scheduler.policy import PredictiveLas, TypesIgnored
from phalanx.control.scheduler.predict import DurationPredictor
from phalanx.control.scheduler.service import Levels
from phalanx.control.scheduler.speeds import Speeds
from phalanx.control.scheduler.state import Policy, Queue, State

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (PredictiveLas, TypesIgnored, Fifo, KueueLike, TiresiasLike, GavelLike)
}

__all__ = [
    "ANY_TYPE",
    "POLICIES",
    "Actuator",
    "Admit",
    "Cluster",
    "DurationPredictor",
    "Fifo",
    "GavelLike",
    "GpuType",
    "Job",
    "KueueLike",
    "Levels",
    "Node",
    "Placement",
    "Policy",
    "PredictiveLas",
    "Preempt",
    "PreemptionCost",
    "Queue",
    "Round",
    "Run",
    "Speeds",
    "State",
    "Tenant",
    "TiresiasLike",
    "TypesIgnored",
    "Wait",
    "apply",
    "enforce_budgets",
    "place",
]
