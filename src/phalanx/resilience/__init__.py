"""Failure detection and recovery policy, used by the supervisor: what failed, whether to retry, hangs."""

from phalanx.resilience.hang import HangDetector, Stall
from phalanx.resilience.policy import Failure, Kind, backoff_s, classify_exit, hang

__all__ = ["Failure", "HangDetector", "Kind", "Stall", "backoff_s", "classify_exit", "hang"]
