"""The run directory: everything one run leaves behind, in one place, with one layout.

runs/<name>/<run id>/
    spec.yaml          the resolved spec the run was started with
    events.jsonl       events: the supervisor's (attempts, failures, signals, the outcome), rank 0's (checkpoints)
    metrics.jsonl      per-step metrics written by rank 0
    result.json        outcome, exit code and reason, written when the run ends
    goodput.json       the goodput ledger: where the run's wall time went (obs/goodput.py)
    logs/rank-<r>.log  each rank's stdout and stderr, all attempts appended
    logs/rank-<r>.error.json  the root cause a rank recorded with torch's @record, if any
    logs/rank-<r>.stacks.txt  every thread's Python stack, dumped when the rank was found hung
    logs/spare-<i>.log a warm spare's output until it takes a rank's place (then that rank's log)
    checkpoints/       checkpoints, unless checkpoint.dir points elsewhere
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def create(cls, runs_root: str | Path, job_name: str) -> RunDir:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        run = cls(Path(runs_root).absolute() / job_name / run_id)
        run.logs.mkdir(parents=True)
        return run

    @property
    def run_id(self) -> str:
        return f"{self.root.parent.name}/{self.root.name}"

    @property
    def spec(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def goodput(self) -> Path:
        return self.root / "goodput.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_location(self, configured: str | None) -> str:
        """Where the job's checkpoints go: ``checkpoint.dir`` (a path or a URL), else this run's checkpoints/."""
        return configured or str(self.checkpoints)

    def started_at(self) -> float | None:
        """When the run started: the time of its first event (None before it, or in a directory another
        launcher made)."""
        try:
            with self.events.open() as f:
                return float(json.loads(f.readline())["ts"])
        except (OSError, ValueError, KeyError):
            return None

    def log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def spare_log(self, spare: int) -> Path:
        return self.logs / f"spare-{spare}.log"

    def error_file(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.error.json"

    def stacks(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.stacks.txt"
