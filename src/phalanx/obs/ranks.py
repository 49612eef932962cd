"""Each rank's latest figures as its heartbeats tell them: its step, its peak memory and its GPU's utilisation.
Rank 0's metrics speak for rank 0 alone, and the rank that runs out of memory or leaves its GPU idle is
usually another one. The supervisor, which reads every rank's heartbeat for hangs anyway, keeps them in the
run directory's ranks.json (written whole, every few seconds) for the dashboard's job page."""

from __future__ import annotations

import json
import os
from typing import Any

from phalanx.obs.rundir import RunDir

WRITE_EVERY_S = 5.0  # ranks.json is rewritten at most this often
FIGURES = ("step", "ts", "peak_memory_bytes", "gpu_util")  # what a heartbeat says that ranks.json keeps


class RankFigures:
    """The latest heartbeat of each rank, with its node, for ranks.json."""

    def __init__(self, run: RunDir):
        self.path = run.ranks
        self.latest: dict[int, dict[str, Any]] = {}
        self.written_at: float | None = None

    def observe(self, rank: int, node: int, beat: dict[str, Any]) -> None:
        self.latest[rank] = {"rank": rank, "node": node, **{k: beat.get(k) for k in FIGURES}}

    def flush(self, now: float, due: bool = False) -> None:
        """Write ranks.json if it is ``due`` (the run ends) or was last written WRITE_EVERY_S ago; a reader sees
        the old file or the new one, never half of one."""
        if not self.latest or (not due and self.written_at is not None and now - self.written_at < WRITE_EVERY_S):
            return
        part = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        part.write_text(json.dumps([self.latest[r] for r in sorted(self.latest)]) + "\n")
        part.replace(self.path)
        self.written_at = now


def read_ranks(run: RunDir) -> list[dict[str, Any]]:
    """What ranks.json says, one entry per rank; [] before the first write (or in a run from before it)."""
    try:
        found = json.loads(run.ranks.read_text())
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []
