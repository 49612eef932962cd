"""The fleet as the scheduler sees it: nodes with GPUs of one type each, grouped in racks, how many GPUs each
has free, and the GPUs carved for shares (fractions of one GPU: sharing.py) with the thousandths each has left."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from phalanx.control.scheduler.sharing import MILLI, Room

ANY_TYPE = "gpu"  # the type of a node whose GPUs nobody named: a fleet of one kind

# Peak dense 16-bit tensor TFLOP/s per GPU from the vendors' data sheets (SXM/OAM parts; the K80 has no faster
# 16-bit path: its FP32 per die): the speed table's seed for a type the operator did not describe
PEAK_TFLOPS = {
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "V100": 125.0, "T4": 65.0, "P100": 21.2,
    "K80": 4.37, "MI300X": 1307.0, "MI250X": 383.0,
}  # fmt: skip


@dataclass(frozen=True)
class GpuType:
    """An accelerator model as the operator describes it. ``tflops`` (dense 16-bit peak per GPU) seeds how fast
    a job runs on it before any job has run there (speeds.py); the prices are per GPU-hour."""

    name: str
    tflops: float = 0.0
    memory_gib: float = 0.0
    vendor: str = "nvidia"
    price_per_gpu_h: float = 0.0
    spot_price_per_gpu_h: float | None = None

    @classmethod
    def named(cls, name: str) -> GpuType:
        """A type known only by its name: its peak from the data sheets, when it is a model listed there."""
        return cls(name, PEAK_TFLOPS.get(name.upper(), 0.0))


@dataclass(frozen=True)
class Node:
    name: str
    rack: str
    gpus: int
    gpu_type: str = ANY_TYPE


class Cluster:
    """Nodes and their free GPUs. ``allocate`` and ``release`` take a placement ({node: GPUs}); an allocation
    that does not fit is an error, never a silent overcommit. Nodes are also indexed, per GPU type, by how many
    GPUs they have free (``by_free``, insertion-ordered for determinism), so a job that fits on one node finds
    its tightest node of a type without a scan of the fleet.

    Shares: ``take_share`` carves a free GPU for shares when a share is the first on it (a carved GPU is no
    longer free: no gang lands on it), and ``give_share`` makes it free again when its last share leaves."""

    def __init__(self, nodes: Iterable[Node], unit: str = "GPUs", types: Iterable[GpuType] = ()):
        self.unit = unit  # what a node's count counts, in the scheduler's words: GPUs, or CPU slots ("slots")
        self.nodes: dict[str, Node] = {}
        for node in nodes:
            if node.name in self.nodes:
                raise ValueError(f"node {node.name!r} is listed twice")
            if node.gpus < 0:
                raise ValueError(f"node {node.name!r}: {node.gpus} GPUs; a node has 0 or more")
            self.nodes[node.name] = node
        self.types: dict[str, GpuType] = {}  # the fleet's types, in the order given, then in the nodes' order
        for gpu_type in types:
            if gpu_type.name in self.types:
                raise ValueError(f"GPU type {gpu_type.name!r} is listed twice")
            self.types[gpu_type.name] = gpu_type
        self.typed: dict[str, list[str]] = {name: [] for name in self.types}  # type -> its nodes
        for name, node in self.nodes.items():
            self.types.setdefault(node.gpu_type, GpuType.named(node.gpu_type))
            self.typed.setdefault(node.gpu_type, []).append(name)
        self.free: dict[str, int] = {}
        self.by_free: dict[str, dict[int, dict[str, None]]] = {t: {} for t in self.types}
        self.racks: dict[str, list[str]] = {}
        for name, node in self.nodes.items():
            self._set(name, node.gpus)
            self.racks.setdefault(node.rack, []).append(name)
        self.largest = max((node.gpus for node in self.nodes.values()), default=0)  # GPUs of the biggest node
        self.carved: dict[str, dict[int, int]] = {}  # node -> its shared GPUs: id -> thousandths left
        self.carved_left = 0  # thousandths left on shared GPUs, in all
        self._workers: dict[tuple[str, int], int] = {}  # (type, GPUs per worker) -> workers its nodes hold empty

    @classmethod
    def uniform(cls, racks: int, nodes_per_rack: int, gpus_per_node: int) -> Cluster:
        return cls(
            Node(f"r{r:02d}n{n:03d}", f"r{r:02d}", gpus_per_node) for r in range(racks) for n in range(nodes_per_rack)
        )

    def copy(self) -> Cluster:
        """The same nodes with their free GPUs now: a view that work can be tried on (a round's admissions, a
        preemption's what-if) without touching this one."""
        view = object.__new__(Cluster)
        view.__dict__.update(self.__dict__)  # what never changes is shared
        view.free = dict(self.free)
        view.carved = {name: dict(gpus) for name, gpus in self.carved.items()}
        view.by_free = {t: {k: dict(names) for k, names in index.items()} for t, index in self.by_free.items()}
        return view

    def of(self, count: int) -> str:
        """``count`` in the cluster's unit: "1 GPU", "4 slots"."""
        return f"{count} {self.unit if count != 1 else self.unit.removesuffix('s')}"

    def type_of(self, placement: Mapping[str, int]) -> str:
        """The GPU type of a placement's nodes; a gang over several types runs at the pace of its slowest
        (``speeds.Speeds.slowest``), so a mixed placement is named by its types joined with "+"."""
        types = sorted({self.nodes[name].gpu_type for name in placement})
        return "+".join(types)

    def could_hold(self, gpu_type: str, workers: int, per_worker: int) -> bool:
        """Whether the type's nodes, all free, hold a gang of ``workers`` x ``per_worker`` GPUs: a type that
        never could is no type to wait for."""
        key = (gpu_type, per_worker)
        if (room := self._workers.get(key)) is None:
            room = self._workers[key] = sum(self.nodes[n].gpus // per_worker for n in self.typed.get(gpu_type, ()))
        return workers <= room

    def dollars_per_h(self, placement: Mapping[str, int], milli: int = MILLI) -> float:
        """What a placement costs an hour, at each node's type's on-demand price (a node no longer in the
        cluster costs nothing: it is gone); a share (``milli`` < 1000) pays its share of its GPU."""
        nodes, types = self.nodes, self.types
        whole = sum(gpus * types[nodes[n].gpu_type].price_per_gpu_h for n, gpus in placement.items() if n in nodes)
        return whole * milli / MILLI

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

    # shares ----------------------------------------------------------------------------------------------------
    def room(self, name: str) -> Room:
        """What the node has left for a share: each shared GPU's thousandths (by id), then its free GPUs."""
        carved = self.carved.get(name, {})
        left = (*(carved[c] for c in sorted(carved)), *(MILLI,) * self.free[name])
        return Room(self.nodes[name].gpu_type, 0, left)

    def carve_of(self, name: str, index: int) -> int:
        """The shared GPU that GPU ``index`` of ``room(name)`` is: a carved one, or the next one to carve."""
        ids = sorted(self.carved.get(name, {}))
        return ids[index] if index < len(ids) else min(set(range(len(ids) + 1)) - set(ids))

    def take_share(self, name: str, carve: int, milli: int) -> None:
        """``milli`` thousandths of shared GPU ``carve`` of node ``name``, carving it from a free GPU first if
        no share holds it yet."""
        if name not in self.free or not 0 < milli < MILLI or carve < 0:
            raise ValueError(f"cannot take {milli} thousandths of shared GPU {carve} on node {name!r}")
        carved = self.carved.get(name, {})
        if carve not in carved and self.free[name] < 1:
            raise ValueError(f"cannot carve a GPU for shares on node {name!r}: none free")
        if carved.get(carve, MILLI) < milli:
            raise ValueError(f"shared GPU {carve} on node {name!r} has {carved[carve]} thousandths left, not {milli}")
        if carve not in carved:
            self._set(name, self.free[name] - 1)
            carved = self.carved.setdefault(name, {})
            carved[carve], self.carved_left = MILLI, self.carved_left + MILLI
        carved[carve] -= milli
        self.carved_left -= milli

    def give_share(self, name: str, carve: int, milli: int) -> None:
        carved = self.carved.get(name, {})
        if carve not in carved or not 0 < milli <= MILLI - carved[carve]:
            raise ValueError(f"cannot give back {milli} thousandths of shared GPU {carve} on node {name!r}: not taken")
        carved[carve] += milli
        self.carved_left += milli
        if carved[carve] == MILLI:  # its last share left: a whole free GPU again
            del carved[carve]
            self.carved_left -= MILLI
            if not carved:
                del self.carved[name]
            self._set(name, self.free[name] + 1)

    def _set(self, name: str, free: int) -> None:
        index = self.by_free[self.nodes[name].gpu_type]
        if name in self.free:
            del index[self.free[name]][name]
        self.free[name] = free
        index.setdefault(free, {})[name] = None
