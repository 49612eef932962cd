"""GPU sharing: tasks that take a fraction of one GPU (thousandths, ``gpu_milli`` < 1000) beside tasks of whole
GPUs, packed onto nodes by their CPUs and each GPU's thousandths left. A share never crosses GPUs, a whole-GPU
task takes only untouched GPUs, and nothing is given more of a GPU or a node's CPUs than is left (``take``
refuses it): no GPU is ever overcommitted.

Where a task goes decides how much of a busy fleet stays unallocated: halves of GPUs that no waiting task fits,
nodes whose CPUs are gone with GPUs left. Two packing choices, both a score per candidate (lower is better):

- ``BestFit``: the node left with the least room, CPU and GPU weighed half and half against the fleet's largest
  node, and on it the fullest GPU that holds a share. The baseline of FGD's paper.
- ``Fragmentation`` (FGD: Weng et al., "Beware of Fragmentation", ATC'23): a node's fragmentation, for the
  workload expected (each task shape's share of arrivals), is the GPU capacity a task drawn from it could not
  use there: all of the node's GPUs left for a task it cannot hold (too few CPUs, GPUs or the wrong type), and
  for one it can, the GPUs left with less than the task's share. A task goes where it raises the node's
  fragmentation least. ``tie_break`` (phalanx's choice: best fit) orders candidates FGD finds equal, which
  are many: every empty node of a type is the same to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MILLI = 1000  # a whole GPU, in thousandths
MEMO_ROOMS = 100_000  # kinds of room whose fragmentation is kept


def gpus_filled(milli: int) -> int:
    """The whole GPUs that ``milli`` thousandths of shares fill, rounded up: what a tenant's shares count as
    against its quota (jobs.counted), wherever they lie."""
    return -(-milli // MILLI)


@dataclass(frozen=True)
class Ask:
    """What one task asks of one node: CPUs in thousandths, ``gpus`` GPUs of ``gpu_milli`` thousandths each
    (1000: whole GPUs; less: a share of one GPU), on a node of one of ``gpu_types`` (empty: any)."""

    cpu_milli: int = 0
    gpus: int = 0
    gpu_milli: int = MILLI
    gpu_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.gpus < 0:
            raise ValueError(f"a task of {self.cpu_milli} CPU thousandths and {self.gpus} GPUs: both must be >= 0")
        if not 0 < self.gpu_milli <= MILLI:
            raise ValueError(f"gpu_milli {self.gpu_milli}: a GPU's thousandths, 1 to {MILLI}")
        if self.gpu_milli < MILLI and self.gpus != 1:
            raise ValueError(f"{self.gpus} GPUs of {self.gpu_milli} thousandths each: a share is of one GPU only")

    @property
    def gpu_total(self) -> int:
        """Its GPU, in thousandths."""
        return self.gpus * self.gpu_milli


@dataclass(frozen=True)
class Room:
    """What a node has left: CPUs and each GPU's thousandths, in the GPUs' index order."""

    gpu_type: str
    cpu_milli: int
    gpus: tuple[int, ...]

    def holds(self, ask: Ask) -> bool:
        if ask.gpus and ask.gpu_types and self.gpu_type not in ask.gpu_types:
            return False
        return self.cpu_milli >= ask.cpu_milli and sum(g >= ask.gpu_milli for g in self.gpus) >= ask.gpus

    def choices(self, ask: Ask) -> list[tuple[int, ...]]:
        """The GPUs the task could take here, one option per kind: a share, the first GPU of each distinct
        amount left that holds it; whole GPUs, the first untouched ones (any others are the same)."""
        if not self.holds(ask):
            return []
        if ask.gpu_milli == MILLI:
            return [tuple([i for i, g in enumerate(self.gpus) if g == MILLI][: ask.gpus])]
        firsts: dict[int, int] = {}
        for i, g in enumerate(self.gpus):
            if g >= ask.gpu_milli:
                firsts.setdefault(g, i)
        return [(i,) for i in firsts.values()]

    def minus(self, ask: Ask, gpus: tuple[int, ...]) -> Room:
        left = list(self.gpus)
        for i in gpus:
            left[i] -= ask.gpu_milli
        return Room(self.gpu_type, self.cpu_milli - ask.cpu_milli, tuple(left))


Score = Callable[[Room, Ask, tuple[int, ...]], tuple[float, ...]]  # a candidate's score: lower is better


class Packing:
    """The fleet's nodes and what each has left. ``place`` finds where a task goes by a score; ``take`` and
    ``give_back`` book it, refusing anything that would overcommit. Nodes with the same room are grouped, so a
    placement scores each kind of node once, not each node."""

    def __init__(self, nodes: Iterable[tuple[str, str, int, int]]):
        """``nodes``: (name, GPU type, CPU thousandths, GPUs) each."""
        self.capacity: dict[str, Room] = {}
        for name, gpu_type, cpu_milli, gpus in nodes:
            if name in self.capacity:
                raise ValueError(f"node {name!r} is listed twice")
            if cpu_milli < 0 or gpus < 0:
                raise ValueError(f"node {name!r}: {cpu_milli} CPU thousandths, {gpus} GPUs; both must be >= 0")
            self.capacity[name] = Room(gpu_type, cpu_milli, (MILLI,) * gpus)
        self.rooms: dict[str, Room] = {}
        self._alike: dict[Room, dict[str, None]] = {}  # room -> its nodes, in the order they came to it
        for name, room in self.capacity.items():
            self._set(name, room)
        self.largest_cpu = max((r.cpu_milli for r in self.capacity.values()), default=0)
        self.largest_gpus = max((len(r.gpus) for r in self.capacity.values()), default=0)

    @property
    def gpus(self) -> int:
        return sum(len(r.gpus) for r in self.capacity.values())

    @property
    def unallocated_milli(self) -> int:
        """GPU thousandths no task holds."""
        return sum(sum(r.gpus) for r in self.rooms.values())

    def place(self, ask: Ask, score: Score) -> tuple[str, tuple[int, ...]] | None:
        """The node and GPUs of the best-scoring candidate (ties: the first node found), or None: no node holds
        the task."""
        best: tuple[tuple[float, ...], str, tuple[int, ...]] | None = None
        for room, names in self._alike.items():
            for gpus in room.choices(ask):
                value = score(room, ask, gpus)
                if best is None or value < best[0]:
                    best = (value, next(iter(names)), gpus)
        return None if best is None else (best[1], best[2])

    def take(self, name: str, ask: Ask, gpus: tuple[int, ...]) -> None:
        room = self._room(name, ask, gpus)
        if not room.holds(ask) or any(room.gpus[i] < ask.gpu_milli for i in gpus):
            raise ValueError(f"node {name!r} has {room} left: it cannot take {ask} on GPUs {gpus}")
        self._set(name, room.minus(ask, gpus))

    def give_back(self, name: str, ask: Ask, gpus: tuple[int, ...]) -> None:
        room, whole = self._room(name, ask, gpus), self.capacity[name]
        left = list(room.gpus)
        for i in gpus:
            left[i] += ask.gpu_milli
        cpu = room.cpu_milli + ask.cpu_milli
        if cpu > whole.cpu_milli or any(g > MILLI for g in left):
            raise ValueError(f"node {name!r}: {ask} on GPUs {gpus} was not taken there")
        self._set(name, Room(room.gpu_type, cpu, tuple(left)))

    def _room(self, name: str, ask: Ask, gpus: tuple[int, ...]) -> Room:
        """The node's room, once ``gpus`` are the task's count of distinct GPUs it has."""
        if (room := self.rooms.get(name)) is None:
            raise ValueError(f"no node {name!r}")
        if len(gpus) != ask.gpus or len(set(gpus)) != len(gpus) or not all(0 <= i < len(room.gpus) for i in gpus):
            raise ValueError(f"node {name!r}: GPUs {gpus} for a task of {ask.gpus}; it has {len(room.gpus)}")
        return room

    def _set(self, name: str, room: Room) -> None:
        if (old := self.rooms.get(name)) is not None:
            del (alike := self._alike[old])[name]
            if not alike:
                del self._alike[old]
        self.rooms[name] = room
        self._alike.setdefault(room, {})[name] = None


class BestFit:
    """Least room left, CPU and GPU weighed half and half over the fleet's largest node (FGD's simulator's
    best fit), then the fullest GPU that holds a share."""

    def __init__(self, largest_cpu_milli: int, largest_gpus: int):
        self.cpu, self.gpus = max(largest_cpu_milli, 1), max(largest_gpus, 1) * MILLI

    @classmethod
    def of(cls, packing: Packing) -> BestFit:
        return cls(packing.largest_cpu, packing.largest_gpus)

    def __call__(self, room: Room, ask: Ask, gpus: tuple[int, ...]) -> tuple[float, ...]:
        left = 0.5 * (room.cpu_milli - ask.cpu_milli) / self.cpu + 0.5 * (sum(room.gpus) - ask.gpu_total) / self.gpus
        return (left, sum(room.gpus[i] for i in gpus))


class Workload:
    """The task shapes expected, each with its share of arrivals: given (FGD's paper takes them from the trace)
    or learned by ``observe`` from the tasks as they come."""

    def __init__(self, asks: Iterable[Ask] = ()):
        self.counts: Counter[Ask] = Counter()
        self.total = 0
        for ask in asks:
            self.observe(ask)

    def observe(self, ask: Ask) -> None:
        """Count a task's shape. Tasks without GPUs are left out: to them every GPU is unusable, wherever a task
        goes, so they would add the same to every candidate."""
        if ask.gpus:
            self.counts[ask] += 1
            self.total += 1


class Fragmentation:
    """FGD's score: how much a candidate raises its node's fragmentation for ``workload``. ``tie_break`` orders
    equal raises (None: the first node found, as FGD's own)."""

    def __init__(self, workload: Workload, tie_break: Score | None = None):
        self.workload, self.tie_break = workload, tie_break
        self._memo: dict[tuple[str, int, tuple[int, ...]], dict[Ask, int]] = {}  # room -> each shape's part

    def of(self, room: Room) -> float:
        """The room's expected fragmentation, in GPU thousandths. Each shape's part is kept per room (rooms
        recur: a fleet has few kinds of node), and weighed by the workload as it is now."""
        if not self.workload.total:
            return 0.0
        if len(self._memo) > MEMO_ROOMS:  # a long-lived server's fleet passes through ever more kinds of room
            self._memo.clear()
        # Not the GPUs' order: which GPU is which does not change what its tasks could use.
        parts = self._memo.setdefault((room.gpu_type, room.cpu_milli, tuple(sorted(room.gpus))), {})
        left, total = sum(room.gpus), 0
        for ask, n in self.workload.counts.items():
            if (part := parts.get(ask)) is None:
                part = parts[ask] = sum(g for g in room.gpus if g < ask.gpu_milli) if room.holds(ask) else left
            total += n * part
        return total / self.workload.total

    def __call__(self, room: Room, ask: Ask, gpus: tuple[int, ...]) -> tuple[float, ...]:
        raised = self.of(room.minus(ask, gpus)) - self.of(room)
        # Rounded, so that raises equal but for float sums compare equal and go to the tie-break.
        return (round(raised, 6), *(self.tie_break(room, ask, gpus) if self.tie_break else ()))
