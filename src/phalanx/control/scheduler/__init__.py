"""The scheduling core: pure functions and plain data, no I/O and no clock (the caller passes time in), so that
the control plane and the trace simulator run the same decisions."""

from phalanx.control.scheduler.cluster import Cluster, Node
from phalanx.control.scheduler.placement import Placement, place

__all__ = ["Cluster", "Node", "Placement", "place"]
