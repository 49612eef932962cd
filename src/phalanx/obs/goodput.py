"""The goodput ledger: where every second of a run's wall time went, from its events and metrics.

The run's timeline is cut into pieces that do not overlap and leave nothing out, so the categories add up to
the wall time:

    productive     steps whose result was kept (of each step, the last execution: earlier ones were redone)
    lost           executions of steps that were redone later (after a restart or a rollback)
    checkpoint     training blocked by checkpoint saves (what the recipe reports per step), and the extra
                   time of the steps that ran beside a background write (see ``write_overhead``)
    data           training waiting for its next batch
    detection      from a failed attempt's last step to the failure being seen and its workers stopped
    recovery       from then to the next attempt's first step: backoff, start-up, checkpoint load; or, in
                   process, to the first step after the spare joined and the state came back from memory
    idle           the first attempt's start-up, the end of the run (final save, shutdown), and runs
                   that report no steps

A step's time is the interval since the previous step ended (its first in an attempt: its own step time),
so the time between steps (a checkpoint save, the metrics) is inside it.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.obs.events import FAILURES, SEGMENTS, Event, read_jsonl
from phalanx.obs.rundir import RunDir

CATEGORIES = ("productive", "lost", "checkpoint", "data", "detection", "recovery", "idle")


@dataclass(frozen=True)
class Ledger:
    wall_s: float
    seconds: dict[str, float]

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        parts = ", ".join(f"{name} {self.seconds[name]:.1f} s" for name in CATEGORIES if self.seconds[name] > 0.05)
        return f"goodput {self.goodput:.1%} of {self.wall_s:.1f} s: {parts}"

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "goodput": self.goodput, "seconds": self.seconds}


def steps_by_attempt(
    events: list[dict[str, Any]], metrics: list[dict[str, Any]], starts: tuple[str, ...] = (Event.ATTEMPT_STARTED,)
) -> dict[int, list[dict[str, Any]]]:
    """Rank 0's step records grouped by the attempt that wrote them (the last attempt started before each).
    ``starts``: the events that begin a group (with ``SEGMENTS``, an in-process recovery begins one too)."""
    attempts = [e["ts"] for e in events if e["kind"] in starts]
    grouped: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for m in metrics:
        grouped[sum(1 for ts in attempts if ts <= m["ts"]) - 1].append(m)
    return grouped


def write_overhead(work: Sequence[float], writing: Sequence[bool]) -> list[float]:
    """What a background checkpoint write cost each step: a step that ran beside one (``writing``) took its
    excess over the median step that did not (the write competes for cores, memory bandwidth, the GIL);
    other steps, or steps with no such peer to compare with, 0. ``work``: each step's time less its
    checkpoint blocking and data wait. A checkpoint's whole cost is its blocking plus this over its steps."""
    quiet = [w for w, busy in zip(work, writing, strict=True) if not busy]
    if not quiet:
        return [0.0] * len(work)
    usual = statistics.median(quiet)
    return [max(0.0, w - usual) if busy else 0.0 for w, busy in zip(work, writing, strict=True)]


def read_run(run: RunDir) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's events and rank 0's step records, as written so far."""
    events = list(read_jsonl(run.events)) if run.events.is_file() else []
    return events, list(read_jsonl(run.metrics)) if run.metrics.is_file() else []


def ledger(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> Ledger:
    """The ledger of a run's events and step records (``read_run``); it has at least its first event."""
    start = events[0]["ts"]
    # A run still going ends, so far, at what it last wrote: its last event or its last step.
    so_far = max(events[-1]["ts"], metrics[-1]["ts"] if metrics else 0.0)
    end = next((e["ts"] for e in events if e["kind"] == Event.RUN_FINISHED), so_far)
    attempts = [e["ts"] for e in events if e["kind"] in SEGMENTS]
    failures = [e["ts"] for e in events if e["kind"] in FAILURES]
    seconds = dict.fromkeys(CATEGORIES, 0.0)

    # Each step execution's interval, by attempt, split into checkpoint blocking, data wait and the rest; the
    # last execution of a step index is the one kept.
    executions: list[tuple[int, float, dict[str, Any], float, float, float]] = []
    last_of: dict[int, int] = {}
    by_attempt = steps_by_attempt(events, metrics, SEGMENTS)
    for attempt in sorted(by_attempt):
        previous_end, parts = None, []
        for m in by_attempt[attempt]:
            begin = previous_end if previous_end is not None else m["ts"] - m.get("step_time_s", 0.0)
            interval = m["ts"] - begin
            blocked = min(interval, m.get("checkpoint_s", 0.0))
            waiting = min(interval - blocked, m.get("data_wait_s", 0.0))
            parts.append((begin, m, blocked, waiting, interval - blocked - waiting))
            previous_end = m["ts"]
        # Steps beside a background write are compared with the others of their attempt (same world, layout).
        writing = [bool(m.get("checkpoint_writing")) for _, m, *_ in parts]
        extra = write_overhead([rest for *_, rest in parts], writing)
        for (begin, m, blocked, waiting, rest), over in zip(parts, extra, strict=True):
            last_of[m["step"]] = len(executions)
            executions.append((attempt, begin, m, blocked + over, waiting, rest - over))

    covered: dict[int, tuple[float, float]] = {}  # attempt -> (first step start, last step end)
    for i, (attempt, begin, m, checkpoint, waiting, rest) in enumerate(executions):
        seconds["checkpoint"] += checkpoint
        seconds["data"] += waiting
        seconds["productive" if last_of[m["step"]] == i else "lost"] += rest
        first, _ = covered.get(attempt, (begin, m["ts"]))
        covered[attempt] = (first, m["ts"])

    # Around the steps: each attempt's start-up, and after a failure its detection and the recovery.
    for a, attempt_start in enumerate(attempts):
        attempt_end = attempts[a + 1] if a + 1 < len(attempts) else end
        failed_at = next((ts for ts in failures if attempt_start <= ts <= attempt_end), None)
        opening = "idle" if a == 0 else "recovery"  # start-up: the first attempt's, or a restart's
        if a in covered:
            first, tail_from = covered[a]
            seconds[opening] += first - attempt_start
            before_failure = "detection"
        else:  # no step reported: all of the attempt is start-up
            tail_from, before_failure = attempt_start, opening
        if failed_at is None:
            seconds["idle" if a in covered else opening] += attempt_end - tail_from
        else:
            seconds[before_failure] += max(0.0, failed_at - tail_from)
            seconds["recovery"] += attempt_end - max(failed_at, tail_from)
    seconds["idle"] += max(0.0, (attempts[0] if attempts else end) - start)
    return Ledger(end - start, seconds)


def write_ledger(run: RunDir) -> Ledger:
    result = ledger(*read_run(run))
    run.goodput.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result
