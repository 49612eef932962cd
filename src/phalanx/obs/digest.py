"""What one run directory says, in the figures every reader wants: its goodput ledger, its restarts by cause,
the time it blocked on checkpoints, whether it was signalled to stop and whether it has finished. The server's
views, its /metrics, its control loop and `phalanx chaos` all read a run through ``digest``, which parses
the run's events and metrics again only when those files changed: the dashboard asks for every job every
second, and most runs ended long ago."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from phalanx.obs.events import RESTARTS, Event
from phalanx.obs.goodput import Ledger, ledger, read_run
from phalanx.obs.progress import PACE_WINDOW, intervals, pace_s
from phalanx.obs.rundir import RunDir

KEPT = 10_000  # run directories remembered; past that the memory starts again


@dataclass(frozen=True)
class Resumption:
    """A restart (or an in-process recovery) of the run, and the steps done when training went on after it."""

    at: float
    in_process: bool
    category: str  # crash, hang, node_lost, ...
    cause: str
    resumed_from: int | None  # None: no step came after it


@dataclass(frozen=True)
class DataFetched:
    """Rank 0's fetching of a dataset in object storage, over the run."""

    fetched_bytes: float
    wait_s: float  # the loader's time waiting for chunks to arrive
    hit_rate: float  # the last step's: of the chunks its look-ahead needed, the share the node already held


@dataclass(frozen=True)
class RunDigest:
    ledger: Ledger
    restarts: dict[str, int]  # by category of the failure (crash, hang, node_lost, ...)
    checkpoint_blocked_s: float  # training time rank 0 spent blocked on checkpoint saves
    signalled: bool  # a SIGINT or SIGTERM reached the supervisor (a stop asked from outside)
    finished: bool  # the supervisor wrote its last event
    steps_done: int | None  # rank 0's last step record, counted from 1 (None: no step yet)
    last_loss: float | None  # that step's loss
    steps_run: int  # step records written, steps run again after a restart included: only ever grows
    pace_s: float | None  # seconds a step takes at the recent pace (progress.pace_s): what an ETA assumes
    tokens_run: float  # their tokens (tokens/s x step time, where the run reports both)
    resumptions: tuple[Resumption, ...]  # each restart, in order
    emergency_saves: tuple[tuple[float, int], ...]  # (when, step) of each checkpoint a stop from outside saved
    first_step: int | None  # the first step record's: the steps done before the run began training
    data: DataFetched | None  # what rank 0 fetched from object storage; None where it read none

    @property
    def restart_count(self) -> int:
        return sum(self.restarts.values())


def digest(run: RunDir) -> RunDigest | None:
    """The run's digest, or None while it has written no event."""
    try:
        key = tuple((s.st_size, s.st_mtime_ns) for s in _stats(run))
    except FileNotFoundError:
        return None
    with _lock:
        cached = _kept.get(run.root)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = _read(run)
    with _lock:
        if len(_kept) >= KEPT:
            _kept.clear()
        _kept[run.root] = (key, found)
    return found


def _stats(run: RunDir) -> list:
    stats = [run.events.stat()]
    if run.metrics.exists():
        stats.append(run.metrics.stat())
    return stats


def _read(run: RunDir) -> RunDigest | None:
    events, metrics = read_run(run)
    if not events:
        return None
    restarts = Counter(e.get("category", "crash") for e in events if e["kind"] in RESTARTS)
    stepped = [m for m in metrics if isinstance(m.get("step"), int)]  # a script's records are its own
    stepped_at = [_number(m, "ts") or 0.0 for m in stepped]
    return RunDigest(
        ledger=ledger(events, metrics),
        restarts=dict(sorted(restarts.items())),
        checkpoint_blocked_s=sum(e.get("blocked_s", 0.0) for e in events if e["kind"] == Event.CHECKPOINT_COMMITTED),
        signalled=any(e["kind"] == Event.SIGNAL_RECEIVED for e in events),
        finished=any(e["kind"] == Event.RUN_FINISHED for e in events),
        steps_done=stepped[-1]["step"] + 1 if stepped else None,
        last_loss=_number(stepped[-1], "loss") if stepped else None,
        steps_run=len(metrics),
        pace_s=pace_s(intervals(stepped[-PACE_WINDOW - 1 :]), stepped[-1]) if stepped else None,
        tokens_run=sum((_number(m, "tokens_per_s") or 0.0) * (_number(m, "step_time_s") or 0.0) for m in metrics),
        resumptions=tuple(_resumption(e, stepped, stepped_at) for e in events if e["kind"] in RESTARTS),
        emergency_saves=tuple(
            (e["ts"], e["step"]) for e in events if e["kind"] == Event.PREEMPTED and isinstance(e.get("step"), int)
        ),
        first_step=stepped[0]["step"] if stepped else None,
        data=_fetched(stepped),
    )


def _fetched(stepped: list[dict]) -> DataFetched | None:
    fetching = [m for m in stepped if _number(m, "data_cache_hit_rate") is not None]
    if not fetching:
        return None
    return DataFetched(
        fetched_bytes=sum(_number(m, "data_fetched_bytes") or 0.0 for m in fetching),
        wait_s=sum(_number(m, "data_fetch_wait_s") or 0.0 for m in fetching),
        hit_rate=_number(fetching[-1], "data_cache_hit_rate") or 0.0,
    )


def _resumption(event: dict, stepped: list[dict], stepped_at: list[float]) -> Resumption:
    """A restart event, and the first step recorded after it (a record's step counts from 0: it is the steps
    done before it)."""
    after = bisect.bisect_right(stepped_at, event["ts"])
    return Resumption(
        at=event["ts"],
        in_process=event["kind"] == Event.RECOVERY_STARTED,
        category=event.get("category", "crash"),
        cause=event.get("cause") or event.get("reason", ""),
        resumed_from=stepped[after]["step"] if after < len(stepped) else None,
    )


def _number(record: dict, field: str) -> float | None:
    """A step record's figure, None where a script left it out or wrote something else (its records are its
    own)."""
    value = record.get(field)
    return float(value) if isinstance(value, int | float) else None


_lock = threading.Lock()
_kept: dict[Path, tuple[tuple, RunDigest | None]] = {}
