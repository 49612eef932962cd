"""The fleet of Alibaba's 2023 GPU-sharing trace filled the way FGD's paper measures fragmentation (Weng et al.,
ATC'23): tasks drawn from the trace's pods, with replacement, arrive one at a time and never leave; each is
placed by the packing choice under test or fails (it is not tried again). What a choice leaves unallocated
when the arrived GPU requests reach the fleet's GPUs is the measure: the GPU of the tasks it failed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from phalanx.control.scheduler.sharing import MILLI, Ask, BestFit, Fragmentation, Packing, Score, Workload

CHOICES = ("best-fit", "fgd", "phalanx")


@dataclass
class Fill:
    """One choice's fill of the fleet: the unallocated share of its GPUs at each arrived share asked for."""

    choice: str
    unallocated: dict[float, float] = field(default_factory=dict)  # arrived / capacity -> unallocated / capacity
    failed: int = 0  # tasks that found no node
    placed: int = 0


def arrivals(pods: Sequence[Ask], capacity_milli: int, until: float, seed: int) -> list[Ask]:
    """Pods drawn with replacement until their GPU requests reach ``until`` times the fleet's GPUs."""
    rng, drawn, asked = random.Random(seed), [], 0
    while asked < until * capacity_milli:
        drawn.append(pod := rng.choice(pods))
        asked += pod.gpu_total
    return drawn


def score_for(choice: str, packing: Packing, pods: Sequence[Ask]) -> tuple[Score, Workload]:
    """The choice's score, and the workload it learns from (FGD's paper gives it the trace's; phalanx learns
    it from the tasks that arrived, as a server would, and breaks FGD's ties by best fit)."""
    if choice == "best-fit":
        return BestFit.of(packing), Workload()
    if choice == "fgd":
        return Fragmentation(Workload(pods)), Workload()
    if choice == "phalanx":
        learned = Workload()
        return Fragmentation(learned, tie_break=BestFit.of(packing)), learned
    raise ValueError(f"packing choice {choice!r}; one of {', '.join(CHOICES)}")


def fill(
    nodes: Sequence[tuple[str, str, int, int]],
    pods: Sequence[Ask],
    choice: str,
    seed: int,
    marks: Sequence[float] = (0.8, 0.9, 1.0),
) -> Fill:
    """Fill the fleet with the seed's arrivals by ``choice``, noting the unallocated GPUs at each mark."""
    packing = Packing(nodes)
    score, learns = score_for(choice, packing, pods)
    capacity = packing.gpus * MILLI
    result, asked, due = Fill(choice), 0, sorted(marks)
    for ask in arrivals(pods, capacity, max(marks), seed):
        learns.observe(ask)
        where = packing.place(ask, score)
        if where is None:
            result.failed += 1
        else:
            packing.take(where[0], ask, where[1])
            result.placed += 1
        asked += ask.gpu_total
        while due and asked >= due[0] * capacity:
            result.unallocated[due.pop(0)] = packing.unallocated_milli / capacity
    return result
