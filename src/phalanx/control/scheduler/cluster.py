"""The fleet as the scheduler sees it: nodes with GPUs, grouped in racks, and how many GPUs each has free."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    name: str
    rack: str
    gpus: int


class Cluster:
    """Nodes and their free GPUs. ``allocate`` and ``release`` take a placement ({node: GPUs}); an allocation
    that does not fit is an error, never a silent overcommit. Nodes are also indexed by how many GPUs they
    have free (``by_free``, insertion-ordered for determinism), so a job that fits on one node finds its
    tightest node without a scan of the fleet."""

    def __init__(self, nodes: Iterable[Node], unit: str = "GPUs"):
        self.unit = unit  # what a node's count counts, in the scheduler's words: GPUs, or CPU slots ("slots")
        self.nodes: dict[str, Node] = {}
        for node in nodes:
            if node.name in self.nodes:
                raise ValueError(f"node {node.name!r} is listed twice")
            if node.gpus < 0:
                raise ValueError(f"node {node.name!r}: {node.gpus} GPUs; a node has 0 or more")
            self.nodes[node.name] = node
        self.free: dict[str, int] = {}
        self.by_free: dict[int, dict[str, None]] = {}
        self.racks: dict[str, list[str]] = {}
        for name, node in self.nodes.items():
            self._set(name, node.gpus)
            self.racks.setdefault(node.rack, []).append(name)
        self.largest = max((node.gpus for node in self.nodes.values()), default=0)  # GPUs of the biggest node

    @classmethod
    def uniform(cls, racks: int, nodes_per_rack: int, gpus_per_node: int) -> Cluster:
        return cls(
            Node(f"r{r:02d}n{n:03d}", f"r{r:02d}", gpus_per_node) for r in range(racks) for n in range(nodes_per_rack)
        )

    def copy(self) -> Cluster:
        """The same nodes with their free GPUs now: a view that work can be tried on (a round's admissions, a
        preemption's what-if) without touching this one."""
        view = object.__new__(Cluster)
        view.nodes, view.racks, view.largest, view.unit = self.nodes, self.racks, self.largest, self.unit
        view.free, view.by_free = dict(self.free), {k: dict(names) for k, names in self.by_free.items()}
        return view

    def of(self, count: int) -> str:
        """``count`` in the cluster's unit: "1 GPU", "4 slots"."""
        return f"{count} {self.unit if count != 1 else self.unit.removesuffix('s')}"

    @property
    def total_gpus(self) -> int:
        return sum(node.gpus for node in self.nodes.values())

    @property
    def free_gpus(self) -> int:
        return sum(self.free.values())

    def allocate(self, placement: Mapping[str, int]) -> None:
        for name, gpus in placement.items():
            if name not in self.free or gpus <= 0 or gpus > self.free[name]:
                have = self.free.get(name)
                raise ValueError(f"cannot allocate {gpus} GPU(s) on node {name!r}: {have} free")
        for name, gpus in placement.items():
            self._set(name, self.free[name] - gpus)

    def release(self, placement: Mapping[str, int]) -> None:
        for name, gpus in placement.items():
            if name not in self.free or gpus <= 0 or self.free[name] + gpus > self.nodes[name].gpus:
                raise ValueError(f"cannot release {gpus} GPU(s) on node {name!r}: not allocated there")
        for name, gpus in placement.items():
            self._set(name, self.free[name] + gpus)

    def _set(self, name: str, free: int) -> None:
        if name in self.free:
            del self.by_free[self.free[name]][name]
        self.free[name] = free
        self.by_free.setdefault(free, {})[name] = None
