"""Gang placement with topology: a job of ``workers`` workers, each needing ``per_worker`` GPUs on one node, is
placed whole or not at all (never admitted-but-unplaceable), on the fewest nodes, in one rack where possible.

A gang that fits on one node goes to the tightest such node, found from the cluster's index. Otherwise:
workers are identical, so the fewest nodes come from taking the nodes that hold the most workers first; the
last node taken is then the tightest one that still holds the rest (best fit: the big holes stay open for
big jobs). The one rack that fits with the fewest nodes and the least left over is taken; if no rack can hold
the job, the fewest nodes of any racks, those of the racks with the most room first.

``types`` limits the pool to nodes of those GPU types. A gang runs at the pace of its slowest GPU, so the
policies place a gang on one type at a time, and pass several only for a job whose spec lets it mix them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from phalanx.control.scheduler.cluster import Cluster


@dataclass(frozen=True)
class Placement:
    gpus: dict[str, int]  # node -> GPUs of this job there
    carve: int | None = None  # a share's: which shared GPU of its one node (Cluster.carved)

    @property
    def nodes(self) -> int:
        return len(self.gpus)


def place(cluster: Cluster, workers: int, per_worker: int, types: Collection[str] | None = None) -> Placement | None:
    """Where ``workers`` x ``per_worker`` GPUs fit right now on nodes of ``types`` (None: of any type), or None
    if they do not."""
    if workers <= 0 or per_worker <= 0:
        raise ValueError(f"a gang of {workers} worker(s) x {per_worker} GPU(s): both must be at least 1")
    types = cluster.typed.keys() if types is None else [t for t in types if t in cluster.typed]
    one = _tightest_node(cluster, workers * per_worker, types)
    if one is not None:
        return Placement({one: workers * per_worker})
    free = cluster.free
    slots = {n: free[n] // per_worker for t in types for n in cluster.typed[t] if free[n] >= per_worker}
    best = None  # ((nodes, GPUs left over, rack), its nodes) of the best single rack
    for rack, names in cluster.racks.items():
        chosen = _fewest([n for n in names if n in slots], slots, free, workers)
        if chosen is not None:
            score = (len(chosen), sum(free[n] for n in chosen) - workers * per_worker, rack)
            if best is None or score < best[0]:
                best = (score, chosen)
    if best is not None:
        return _placement(best[1], slots, workers, per_worker)
    # Across racks: the fewest nodes, and among nodes that hold as many, those of the racks that hold the most
    rack_slots = {rack: sum(slots.get(n, 0) for n in names) for rack, names in cluster.racks.items()}
    room = {n: rack_slots[cluster.nodes[n].rack] for n in slots}
    chosen = _fewest(list(slots), slots, free, workers, room)
    return _placement(chosen, slots, workers, per_worker) if chosen is not None else None


def _tightest_node(cluster: Cluster, gpus: int, types: Collection[str]) -> str | None:
    """The node of ``types`` with the fewest free GPUs that still holds ``gpus`` (one node is the fewest), from
    the index; among types with as few, the first."""
    best: tuple[int, str] | None = None
    for gpu_type in types:
        index = cluster.by_free[gpu_type]
        free = min((k for k, names in index.items() if k >= gpus and names), default=None)
        if free is not None and (best is None or free < best[0]):
            best = (free, next(iter(index[free])))
    return best[1] if best is not None else None


def _fewest(
    names: Sequence[str],
    slots: dict[str, int],
    free: dict[str, int],
    workers: int,
    rack_room: dict[str, int] | None = None,
) -> list[str] | None:
    """The fewest of ``names`` that hold ``workers``, the last one the tightest fit; None if they cannot.
    ``rack_room``: node -> workers its rack holds; among nodes that hold as many, those of roomier racks first."""
    ranked = sorted(names, key=lambda n: (-slots[n], -(rack_room or {}).get(n, 0), free[n], n))
    chosen, held = [], 0
    for name in ranked:
        if held >= workers:
            break
        chosen.append(name)
        held += slots[name]
    if held < workers:
        return None
    rest = workers - (held - slots[chosen[-1]])  # what the last node must hold
    spare = [n for n in ranked if n not in chosen[:-1] and slots[n] >= rest]
    chosen[-1] = min(spare, key=lambda n: (free[n], n))
    return chosen


def _placement(chosen: list[str], slots: dict[str, int], workers: int, per_worker: int) -> Placement:
    gpus, left = {}, workers
    for name in chosen:
        take = min(slots[name], left)
        gpus[name] = take * per_worker
        left -= take
    return Placement(gpus)
