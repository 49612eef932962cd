"""Reading public GPU-cluster traces in place (they are never copied into the repository)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from phalanx.control.scheduler.sharing import MILLI, Ask


@dataclass(frozen=True)
class TraceJob:
    id: str
    tenant: str
    gpus: int
    submit_s: float  # from the start of the replayed window
    duration_s: float  # on the GPU type the trace ran on (``simulator.TrueSpeeds.reference``)
    kind: str = ""  # its class, for a fleet of several GPU types
    gpu_types: tuple[str, ...] = ()  # the types it can run on; empty: any


class TraceError(ValueError):
    pass


def _rows(path: Path, columns: set[str]) -> list[dict[str, str]]:
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = columns - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path}: missing column(s) {sorted(missing)}; it has {reader.fieldnames}")
        return list(reader)


def philly(path: Path, start: str = "2017-10-01", end: str = "2017-11-01") -> tuple[list[TraceJob], dict[str, float]]:
    """Philly jobs (the Pollux authors' table) submitted in [start, end), in submit order, and every virtual
    cluster's share of the GPU-time of the jobs submitted before ``start``: quotas are set from the past only,
    as an operator would set them. A virtual cluster with no past has no share (it borrows)."""
    rows = _rows(path, {"timestamp", "duration", "num_gpus", "gpu_time", "cluster"})
    t0, t1 = datetime.fromisoformat(start), datetime.fromisoformat(end)
    past: dict[str, float] = {}
    jobs = []
    for line, row in enumerate(rows, 2):
        try:
            submitted = datetime.fromisoformat(row["timestamp"])
            gpus, duration, gpu_time = int(row["num_gpus"]), float(row["duration"]), float(row["gpu_time"])
        except ValueError as e:
            raise TraceError(f"{path}:{line}: {e}") from None
        if submitted < t0:
            past[row["cluster"]] = past.get(row["cluster"], 0.0) + gpu_time
        elif submitted < t1 and gpus > 0 and duration > 0:
            jobs.append(TraceJob(f"philly-{line}", row["cluster"], gpus, (submitted - t0).total_seconds(), duration))
    if not jobs:
        raise TraceError(f"{path}: no jobs submitted in [{start}, {end})")
    total = sum(past.values())
    if total <= 0:
        raise TraceError(f"{path}: no GPU-time before {start} to set quotas from; start the replay later")
    jobs.sort(key=lambda job: (job.submit_s, job.id))
    shares = dict.fromkeys(sorted({job.tenant for job in jobs}), 0.0) | {vc: t / total for vc, t in past.items()}
    return jobs, dict(sorted(shares.items()))


def quotas(shares: dict[str, float], gpus: int) -> dict[str, int]:
    """``gpus`` split in proportion to ``shares``, in whole GPUs (largest remainder), summing to ``gpus``."""
    exact = {name: share * gpus / sum(shares.values()) for name, share in shares.items()}
    whole = {name: int(x) for name, x in exact.items()}
    for name in sorted(exact, key=lambda n: (whole[n] - exact[n], n))[: gpus - sum(whole.values())]:
        whole[name] += 1
    return whole


def alibaba_2023(nodes_csv: Path, pods_csv: Path) -> tuple[list[tuple[str, str, int, int]], list[Ask]]:
    """Alibaba's 2023 GPU-sharing trace (FGD's, ATC'23): its nodes as (name, GPU model, CPU thousandths, GPUs),
    and what each pod asks, in file order. A pod's ``gpu_spec`` lists the models it may run on, "|"-separated
    (empty: any)."""
    nodes = []
    for line, row in enumerate(_rows(nodes_csv, {"sn", "cpu_milli", "gpu", "model"}), 2):
        try:
            nodes.append((row["sn"], row["model"], int(row["cpu_milli"]), int(row["gpu"])))
        except ValueError as e:
            raise TraceError(f"{nodes_csv}:{line}: {e}") from None
    pods = []
    for line, row in enumerate(_rows(pods_csv, {"cpu_milli", "num_gpu", "gpu_milli", "gpu_spec"}), 2):
        try:
            gpus, milli = int(row["num_gpu"]), int(row["gpu_milli"])
            types = tuple(t for t in row["gpu_spec"].split("|") if t)
            pods.append(Ask(int(row["cpu_milli"]), gpus, milli if gpus else MILLI, types))
        except ValueError as e:
            raise TraceError(f"{pods_csv}:{line}: {e}") from None
    if not nodes or not pods:
        raise TraceError(f"{nodes_csv}, {pods_csv}: {len(nodes)} nodes and {len(pods)} pods; both must have some")
    return nodes, pods
