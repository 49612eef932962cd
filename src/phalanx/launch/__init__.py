"""Per-node supervisor: spawn workers, c10d rendezvous, watch exits, forward signals, report the outcome."""

from phalanx.launch.supervisor import LaunchError, Outcome, RunResult, Supervisor

__all__ = ["LaunchError", "Outcome", "RunResult", "Supervisor"]
