"""Launching a job: the supervisor (the attempt loop, on node 0), the node agents of other nodes, the
rendezvous they share, and the worker processes of each node."""

from phalanx.launch.agent import NodeAgent
from phalanx.launch.node import LaunchError
from phalanx.launch.supervisor import HostedRendezvous, Supervisor
from phalanx.obs.rundir import Outcome, RunResult

__all__ = ["HostedRendezvous", "LaunchError", "NodeAgent", "Outcome", "RunResult", "Supervisor"]
