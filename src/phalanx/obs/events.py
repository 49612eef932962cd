"""Append-only JSON-lines logs (the run's events and metrics): one object per line, written as things
happen, so a crash loses nothing already written."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The events that begin a recovery from a failure: a restart of every process from the last checkpoint, or an
# in-process recovery (a warm spare in the failed rank's place). Both carry restart, failure, cause, category
# and reason.
RESTARTS = ("restart_scheduled", "recovery_started")


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
    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
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
