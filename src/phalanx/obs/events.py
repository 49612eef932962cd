"""The run's event log: one JSON object per line, appended as things happen, so a crash loses nothing written."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"ts": time.time(), "kind": kind, **fields}
        line = json.dumps(event, default=str) + "\n"
        with self._lock, self.path.open("a") as f:
            f.write(line)
        return event


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
