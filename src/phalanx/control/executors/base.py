"""What the control plane asks of a place that runs jobs: the local machine, a Slurm cluster, Kubernetes.

Every action is keyed by (job, attempt), so the server can repeat one after a crash without starting a job
twice: ``start`` of an execution already started returns the existing one's handle. A handle is plain JSON,
kept in the store, so a restarted server finds its jobs again (``status``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from phalanx.control.scheduler import Node

Handle = dict[str, Any]


@dataclass(frozen=True)
class Launch:
    """One execution of a job: the resolved spec it runs, the directory it runs from (relative paths in the
    spec are relative to it), and where the scheduler placed it ({node: GPUs})."""

    job_id: str
    attempt: int
    spec: str
    workdir: str
    placement: dict[str, int]
    nodes: int
    gpu_milli: int = 1000  # less: a share of one GPU, in thousandths ...
    carve: int | None = None  # ... on its node's shared GPU of this id: shares of the same id share a device


class Phase(enum.StrEnum):
    RUNNING = "running"
    EXITED = "exited"  # the job's supervisor ended and said how (``outcome``)
    LOST = "lost"  # gone without saying how: killed, or its machine lost


@dataclass(frozen=True)
class Status:
    phase: Phase
    run_dir: Path | None = None  # the run directory: logs, events, metrics, checkpoints (when it exists)
    outcome: str | None = None  # succeeded | failed | stopped, when exited
    exit_code: int | None = None
    reason: str = ""


class Executor(Protocol):
    name: str
    unit: str  # what its capacity counts: "GPUs", or "slots" (CPU slots) where it offers no GPUs
    shares: bool  # it runs shares of one GPU (``Launch.gpu_milli``) beside each other

    def capacity(self) -> list[Node]:
        """The nodes and GPUs (or CPU slots) this executor offers the scheduler."""
        ...

    def start(self, launch: Launch) -> Handle: ...

    def adopt(self, handle: Handle) -> None:
        """A running execution started before this server did: count what it holds."""
        ...

    def status(self, handle: Handle) -> Status: ...

    def signal(self, handle: Handle, signum: int) -> None:
        """Deliver ``signum`` to the job's supervisor (SIGTERM: checkpoint and stop), if it still runs."""
        ...

    def cancel(self, handle: Handle) -> None:
        """Stop the execution for good, checkpointing first where the job can."""
        ...
