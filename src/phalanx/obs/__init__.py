"""Observability shared by every layer: the run directory's layout, events, metrics (step time, tokens/s, MFU,
memory). The supervisor and the workers both write into the run directory, so its layout lives here."""

from phalanx.obs.events import RESTARTS, EventLog, JsonlLog, read_jsonl
from phalanx.obs.rundir import RunDir

__all__ = ["RESTARTS", "EventLog", "JsonlLog", "RunDir", "read_jsonl"]
