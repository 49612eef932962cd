"""A fleet of several GPU types for the replay, after Gavel (OSDI'20): each trace job is given a workload from
Gavel's job table, drawn per seed among those that run at its size, and it runs at Gavel's measured rate for
that workload on each type (gavel_throughputs.json: the small table derived from Gavel's, with its source and
licence). The trace's durations are taken as measured on the reference type, Philly's generation (P100)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from phalanx.control.scheduler.cluster import PEAK_TFLOPS, Cluster, GpuType, Node
from phalanx.control.sim.simulator import TrueSpeeds
from phalanx.control.sim.trace import TraceJob

GAVEL_TABLE = Path(__file__).with_name("gavel_throughputs.json")

# Gavel's three types, fastest first, as an operator would list them, with Google Cloud's 2020 list prices
GAVEL_TYPES = (
    GpuType("V100", PEAK_TFLOPS["V100"], 16, price_per_gpu_h=2.48, spot_price_per_gpu_h=0.74),
    GpuType("P100", PEAK_TFLOPS["P100"], 16, price_per_gpu_h=1.46, spot_price_per_gpu_h=0.43),
    GpuType("K80", PEAK_TFLOPS["K80"], 12, price_per_gpu_h=0.45, spot_price_per_gpu_h=0.135),
)


@dataclass(frozen=True)
class Fleet:
    """``nodes`` of each of ``types`` (in the operator's order), ``gpus_per_node`` each, in racks of one type;
    ``truth`` how fast each workload runs on each type; ``kinds`` the workloads a job of N GPUs may be, by
    the largest measured size within N."""

    types: tuple[GpuType, ...]
    nodes: tuple[int, ...]
    gpus_per_node: int
    truth: TrueSpeeds
    kinds: dict[int, tuple[str, ...]]

    def cluster(self, nodes_per_rack: int) -> Cluster:
        nodes = [
            Node(
                f"{t.name.lower()}-n{i:03d}", f"{t.name.lower()}-r{i // nodes_per_rack:02d}", self.gpus_per_node, t.name
            )
            for t, count in zip(self.types, self.nodes, strict=True)
            for i in range(count)
        ]
        return Cluster(nodes, types=self.types)

    def assign(self, jobs: Sequence[TraceJob], seed: int) -> list[TraceJob]:
        """Each job with a workload of its size, drawn with ``seed``, and the types it fits on."""
        rng, sizes = random.Random(seed), sorted(self.kinds)
        out = []
        for job in jobs:
            size = max(s for s in sizes if s <= job.gpus)
            kind = rng.choice(self.kinds[size])
            fits = tuple(t.name for t in self.types if self.truth.rates[kind, t.name] > 0)
            out.append(replace(job, kind=kind, gpu_types=fits))
        return out


@cache
def _gavel() -> dict:
    return json.loads(GAVEL_TABLE.read_text())


def gavel_fleet(gpus: int, gpus_per_node: int = 8) -> Fleet:
    """``gpus`` as nearly equal numbers of V100, P100 and K80 nodes (Gavel's simulated clusters are equal
    thirds), with Gavel's measured rates; the reference type, the trace's, is the P100."""
    nodes = gpus // gpus_per_node
    counts = tuple(nodes // 3 + (i < nodes % 3) for i in range(3))
    rates, kinds = {}, {}
    for size, models in _gavel()["rates"].items():
        names = []
        for model, on in models.items():
            kind = f"{model} x{size}"
            names.append(kind)
            rates.update({(kind, t): rate for t, rate in on.items()})
        kinds[int(size)] = tuple(names)
    return Fleet(GAVEL_TYPES, counts, gpus_per_node, TrueSpeeds(rates, "P100"), kinds)
