"""The server's speed table (scheduler/speeds.py): how fast each kind of job runs on each GPU type, in tokens/s
per GPU of productive time, learned from the executions the store kept. Being in the store, it outlives the
server: a restarted one learns it again from the same runs, in the order they ended."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.orm import Session

from phalanx.control import scheduler as core
from phalanx.control.store.access import speed_runs


def observe(speeds: core.Speeds, kind: str, gpu_type: str | None, gpus: float, tokens: float | None,
            productive_s: float | None) -> None:  # fmt: skip
    """An ended execution's lesson: its tokens over its productive seconds and its GPUs. One that reported no
    tokens (a script that says nothing), ran no productive second, or has no type or kind teaches nothing, nor
    does a share of a GPU (``gpus`` < 1): how fast it ran says as much of its neighbours as of the GPU."""
    if kind and gpu_type and gpus >= 1 and tokens and productive_s and tokens > 0 and productive_s > 0:
        speeds.observe(kind, gpu_type, tokens / productive_s / gpus)


def learned(s: Session, types: Mapping[str, core.GpuType]) -> core.Speeds:
    """The table from the store's ended executions, seeded by ``types``' peak FLOP/s."""
    speeds = core.Speeds(types)
    for row in speed_runs(s):
        observe(speeds, *row)
    return speeds
