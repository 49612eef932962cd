"""Launching a job: the supervisor (the attempt loop, on node 0), the node agents of other nodes, the
rendezvous they share, and the worker processes of each node. Imported on first use: the server's executor
imports this package, and the rendezvous imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.lazy import exports

if TYPE_CHECKING:
    from phalanx.launch.agent import NodeAgent
    from phalanx.launch.node import LaunchError
    from phalanx.launch.supervisor import HostedRendezvous, Supervisor
    from phalanx.obs.rundir import Outcome, RunResult

__all__ = ["HostedRendezvous", "LaunchError", "NodeAgent", "Outcome", "RunResult", "Supervisor"]
__getattr__ = exports(
    __name__,
    {
        "NodeAgent": "phalanx.launch.agent",
        "LaunchError": "phalanx.launch.node",
        "HostedRendezvous": "phalanx.launch.supervisor",
        "Supervisor": "phalanx.launch.supervisor",
        "Outcome": "phalanx.obs.rundir",
        "RunResult": "phalanx.obs.rundir",
    },
)
