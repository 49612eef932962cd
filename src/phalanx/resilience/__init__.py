"""Failure detection and recovery policy, used by the supervisor: what failed, whether to retry, hangs,
stragglers, shrinking and growing back. Fault injection to test them is a command (cli/chaos.py)."""

from phalanx.resilience.hang import HangDetector, Stall
from phalanx.resilience.policy import Failure, Kind, backoff_s, classify_exit, hang
from phalanx.resilience.straggler import Straggler, StragglerDetector

__all__ = [
    "Failure",
    "HangDetector",
    "Kind",
    "Stall",
    "Straggler",
    "StragglerDetector",
    "backoff_s",
    "classify_exit",
    "hang",
]
