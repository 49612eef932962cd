"""The scheduling core: pure functions and plain data, no I/O and no clock (the caller passes time in), so that
the control plane and the trace simulator run the same decisions."""

from phalanx.control.scheduler.actuate import Actuator, apply
from phalanx.control.scheduler.baselines import Fifo, KueueLike, TiresiasLike
from phalanx.control.scheduler.cluster import Cluster, Node
from phalanx.control.scheduler.costs import PreemptionCost
from phalanx.control.scheduler.jobs import Admit, Job, Preempt, Round, Run, Tenant, Wait
from phalanx.control.scheduler.placement import Placement, place
from phalanx.control.scheduler.policy import PredictiveLas
from phalanx.control.scheduler.predict import DurationPredictor
from phalanx.control.scheduler.service import Levels
from phalanx.control.scheduler.state import Policy, Queue, State

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (PredictiveLas, Fifo, KueueLike, TiresiasLike)}

__all__ = [
    "POLICIES",
    "Actuator",
    "Admit",
    "Cluster",
    "DurationPredictor",
    "Fifo",
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
    "State",
    "Tenant",
    "TiresiasLike",
    "Wait",
    "apply",
    "place",
]
