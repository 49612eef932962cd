"""The run directory: everything one run leaves behind, in one place, with one layout.

runs/<name>/<run id>/
    spec.yaml          the resolved spec the run was started with
    events.jsonl       events: the supervisor's (attempts, failures, signals, the outcome), rank 0's (checkpoints)
    metrics.jsonl      per-step metrics written by rank 0
    ranks.json         each rank's latest step, peak memory and GPU utilisation, from its heartbeats (obs/ranks.py)
    result.json        outcome, exit code and reason, written when the run ends
    goodput.json       the goodput ledger: where the run's wall time went (obs/goodput.py)
    logs/supervisor.log  what the supervisor showed: its lines, the workers' it passed on, the progress, the summary
    logs/rank-<r>.log  each rank's stdout and stderr, all attempts appended
    logs/rank-<r>.error.json  the root cause a rank recorded with torch's @record, if any
    logs/rank-<r>.stacks.txt  every thread's Python stack, dumped when the rank was found hung
    logs/spare-<i>.log a warm spare's output until it takes a rank's place (then that rank's log)
    checkpoints/       checkpoints, unless checkpoint.dir points elsewhere
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RunResult:
    """How a run ended: result.json, written by the supervisor (or by the first agent to find node 0 lost) and
    read by the control plane's executors."""

    outcome: Outcome
    exit_code: int  # 0 succeeded, 1 a worker failed, 128 + signal when stopped by a signal
    reason: str
    run_dir: str
    failed_rank: int | None = None
    failed_node: int | None = None  # the node of the failed rank, or the node lost
    node_lost: bool = False
    restarts: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> RunResult:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in fields.items() if k in known}, "outcome": Outcome(fields["outcome"])})


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
    def ranks(self) -> Path:
        return self.root / "ranks.json"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def write_result(self, result: RunResult, first: bool = False) -> bool:
        """Write result.json whole (a reader never sees half of it); ``first``: only if no result is there yet
        (several survivors of a lost node 0 may each try). Whether this call wrote it."""
        part = self.root / f".result.json.{os.getpid()}"
        part.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        try:
            if not first:
                part.replace(self.result)
                return True
            try:
                os.link(part, self.result)  # fails if there is one: atomic and exclusive
                return True
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()

    def read_result(self) -> RunResult | None:
        """How the run ended, or None while it has not (or its launcher died before saying)."""
        try:
            return RunResult.from_json(json.loads(self.result.read_text()))
        except FileNotFoundError:
            return None

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

    @property
    def supervisor_log(self) -> Path:
        return self.logs / "supervisor.log"

    def spare_log(self, spare: int) -> Path:
        return self.logs / f"spare-{spare}.log"

    def error_file(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.error.json"

    def stacks(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.stacks.txt"


def newest_run(runs_root: str | Path) -> RunDir | None:
    """The newest run directory under ``runs_root`` (<name>/<run id>/, as ``RunDir.create`` makes them): an
    execution has one per start of its launcher (Slurm requeues one). Folders whose names begin with a dot (a
    launcher's own files, such as .slurm/) are not runs."""
    found = [p for p in Path(runs_root).glob("*/*") if p.is_dir() and not p.parent.name.startswith(".")]
    return RunDir(max(found, key=lambda p: p.stat().st_mtime_ns)) if found else None
