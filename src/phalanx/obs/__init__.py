"""Observability shared by every layer: events (and later metrics and the goodput ledger)."""

from phalanx.obs.events import EventLog, read_events

__all__ = ["EventLog", "read_events"]
