"""A job's progress as people see it: rank 0's metrics.jsonl followed as it grows, each step as a line of
text, and a status line with the latest figures and the time left at the recent pace."""

from __future__ import annotations

import itertools
import json
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACE_WINDOW = 20  # consecutive steps whose median interval sets the pace the ETA assumes


def pace_s(intervals: list[float], latest: dict[str, Any]) -> float | None:
    """Seconds a step takes at the recent pace: the median of the last intervals between consecutive steps (one
    slow step, a checkpoint's say, does not swing it), else the last step's own time."""
    recent = intervals[-PACE_WINDOW:]
    if recent:
        return statistics.median(recent)
    own = latest.get("step_time_s")
    return float(own) if isinstance(own, int | float) else None


def intervals(records: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive steps' records (not across a restart, where the step goes back)."""
    return [b["ts"] - a["ts"] for a, b in itertools.pairwise(records) if b["step"] == a["step"] + 1]


# The figures a step line shows when the step reported them, in this order: (metric, label, format).
FIGURES: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("loss", "loss", lambda v: f"{v:8.4f}"),
    ("grad_norm", "grad norm", lambda v: f"{v:7.3f}"),
    ("lr", "lr", lambda v: f"{v:.2e}"),
    ("tokens_per_s", "tok/s", lambda v: f"{v:9,.0f}"),
    ("mfu", "mfu", lambda v: f"{v:6.1%}"),
    ("bubble", "bubble", lambda v: f"{v:5.1%}"),  # a pipeline's idle share in theory, which MFU pays
    ("peak_memory_bytes", "mem", lambda v: f"{v / 2**30:5.2f} GiB"),
    ("step_time_s", "step", lambda v: f"{v * 1e3:7.1f} ms"),
)
STATUS_FIGURES = ("loss", "tokens_per_s", "mfu")


def step_line(record: dict[str, Any], total_steps: int | None, figures: tuple[str, ...] | None = None) -> str:
    """``step 12/60 | loss 3.1416 | ...``: the figures ``record`` has (all of FIGURES, or those named)."""
    shown = " | ".join(
        f"{label} {fmt(record[key])}"
        for key, label, fmt in FIGURES
        if (figures is None or key in figures) and record.get(key) is not None
    )
    step = f"step {record['step'] + 1:>5}" + (f"/{total_steps}" if total_steps else "")
    return f"{step} | {shown}" if shown else step


def clock(seconds: float) -> str:
    """``1:02:03``: a duration as hours:minutes:seconds."""
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressFeed:
    """Follows a metrics.jsonl that rank 0 appends to: ``poll()`` returns what is new since the last call."""

    def __init__(self, metrics: Path, total_steps: int | None):
        self.path, self.total_steps = metrics, total_steps
        self.latest: dict[str, Any] | None = None
        self._offset = 0
        self._intervals: deque[float] = deque(maxlen=PACE_WINDOW)

    def poll(self) -> list[dict[str, Any]]:
        """The records written since the last poll; a line still being written waits for the next poll."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = [json.loads(line) for line in complete.splitlines() if line.strip()]
        for record in records:
            self.total_steps = record.get("total_steps") or self.total_steps  # a script may say its length
            previous, self.latest = self.latest, record
            if previous is not None and record["step"] == previous["step"] + 1:  # not across a restart
                self._intervals.append(record["ts"] - previous["ts"])
        return records

    def eta_s(self) -> float | None:
        """Seconds left at the median pace of the last PACE_WINDOW steps, if the job's length is known."""
        if self.latest is None or not self.total_steps:
            return None
        pace = pace_s(list(self._intervals), self.latest)
        return None if pace is None else max(0, self.total_steps - self.latest["step"] - 1) * pace

    def status(self, elapsed_s: float, restarts: int) -> str:
        """The live status line: the latest step's figures, elapsed time, ETA, restarts so far."""
        head = (
            step_line(self.latest, self.total_steps, STATUS_FIGURES)
            if self.latest is not None
            else "waiting for the first step"
        )
        eta = self.eta_s()
        tail = [f"{clock(elapsed_s)} elapsed"] + ([f"ETA {clock(eta)}"] if eta is not None else [])
        if restarts:
            tail.append(f"{restarts} restart(s)")
        return f"{head} | {' | '.join(tail)}"
