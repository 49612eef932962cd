"""What one run directory says, in the figures every reader wants: its goodput ledger, its restarts by cause,
the time it blocked on checkpoints, whether it was signalled to stop and whether it has finished. The server's
views, its /metrics, its control loop and `phalanx chaos` all read a run through ``digest``, which parses
the run's events and metrics again only when those files changed: the dashboard asks for every job every
second, and most runs ended long ago."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from phalanx.obs.events import RESTARTS, Event
from phalanx.obs.goodput import Ledger, ledger, read_run
from phalanx.obs.rundir import RunDir

KEPT = 10_000  # run directories remembered; past that the memory starts again


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
    tokens_run: float  # their tokens (tokens/s x step time, where the run reports both)

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
    return RunDigest(
        ledger=ledger(events, metrics),
        restarts=dict(sorted(restarts.items())),
        checkpoint_blocked_s=sum(e.get("blocked_s", 0.0) for e in events if e["kind"] == Event.CHECKPOINT_COMMITTED),
        signalled=any(e["kind"] == Event.SIGNAL_RECEIVED for e in events),
        finished=any(e["kind"] == Event.RUN_FINISHED for e in events),
        steps_done=int(metrics[-1]["step"]) + 1 if metrics else None,
        last_loss=metrics[-1].get("loss") if metrics else None,
        steps_run=len(metrics),
        tokens_run=sum(m.get("tokens_per_s", 0.0) * m.get("step_time_s", 0.0) for m in metrics),
    )


_lock = threading.Lock()
_kept: dict[Path, tuple[tuple, RunDigest | None]] = {}
