"""Append-only JSON-lines logs (the run's events and metrics): one object per line, written as things
happen, so a crash loses nothing already written."""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Event(enum.StrEnum):
    """The kinds of event phalanx writes to a run's events.jsonl: the names every reader matches on. A user's
    script may add kinds of its own (``ctx.event``); these are phalanx's."""

    # the supervisor's: the run and its attempts
    RUN_STARTED = "run_started"
    NODES_JOINED = "nodes_joined"
    ATTEMPT_STARTED = "attempt_started"
    RESTART_SCHEDULED = "restart_scheduled"
    SIGNAL_RECEIVED = "signal_received"
    RUN_FINISHED = "run_finished"
    # the supervisor's: what went wrong
    WORKER_FAILED = "worker_failed"
    HANG_DETECTED = "hang_detected"
    STRAGGLER = "straggler"
    NODE_LOST = "node_lost"
    # the supervisor's: in-process recovery
    RECOVERY_STARTED = "recovery_started"
    RECOVERY_STALLED = "recovery_stalled"
    IN_PROCESS_REFUSED = "in_process_refused"
    # the supervisor's membership: spares, shrinking and growing back
    SPARE_LOST = "spare_lost"
    SPARES_READY = "spares_ready"  # a spare node's warm spares all wait: a lost node can be recovered in process
    NODES_CHANGED = "nodes_changed"
    SHRUNK = "shrunk"
    REGROW_STOP = "regrow_stop"
    GROWN = "grown"
    # another node's agent
    RENDEZVOUS_LOST = "rendezvous_lost"
    # rank 0's: training and checkpoints
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    CHECKPOINT_WAITED = "checkpoint_waited"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    RECOVERED_IN_PROCESS = "recovered_in_process"
    BAD_STEP_SKIPPED = "bad_step_skipped"
    BAD_STEP_ROLLBACK = "bad_step_rollback"
    PREEMPTED = "preempted"


# The events that begin a recovery from a failure: a restart of every process from the last checkpoint, or an
# in-process recovery (a warm spare in the failed rank's place). Both carry restart, failure, cause, category
# and reason.
RESTARTS = (Event.RESTART_SCHEDULED, Event.RECOVERY_STARTED)
FAILURES = (Event.WORKER_FAILED, Event.HANG_DETECTED, Event.NODE_LOST)  # each written when the failure was seen
# What starts a stretch of steps: an attempt, or an in-process recovery within one (its survivors go back to
# their snapshot's step, so steps after it may redo steps before it).
SEGMENTS = (Event.ATTEMPT_STARTED, Event.RECOVERY_STARTED)
BAD_STEPS = (Event.BAD_STEP_SKIPPED, Event.BAD_STEP_ROLLBACK)  # the recipe's events for NaN/Inf or spiked losses


class JsonlLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), **fields}
        line = json.dumps(record, default=str) + "\n"
        with self._lock, self.path.open("a") as f:
            f.write(line)
        return record


class EventLog(JsonlLog):
    def emit(self, kind: Event | str, **fields: Any) -> dict[str, Any]:
        return self.write(kind=kind, **fields)


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file that another process may be appending to (events, metrics): a last
    line without its newline is not written yet, and is left out rather than failing the reader."""
    with Path(path).open() as f:
        for line in f:
            if not line.endswith("\n"):
                return  # the last line, still being written by its process: not there yet
            if line.strip():
                yield json.loads(line)


def read_jsonl_from(path: str | Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete records after byte ``offset`` of a JSON-lines file, and the offset after them: a reader that
    follows a growing file reads each record once. A file not there yet has none; one shorter than ``offset``
    was replaced, and is read from its start."""
    records = []
    try:
        size = os.stat(path).st_size
        if size == offset:
            return records, offset  # nothing new: the common case, without opening the file
        with Path(path).open("rb") as f:
            if size < offset:
                offset = 0
            f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # still being written
                offset += len(line)
                if line.strip():
                    records.append(json.loads(line))
    except FileNotFoundError:
        pass
    return records, offset
