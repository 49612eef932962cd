"""What the scheduler reads and what it decides: tenants, pending and running jobs, and decisions."""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.control.scheduler.sharing import MILLI, Ask, gpus_filled


@dataclass(frozen=True)
class Tenant:
    """A team's guarantee: ``nominal_gpus``, always theirs when they ask. Within a ``cohort``, a tenant may also
    borrow GPUs the other members leave idle, up to ``borrowing_limit`` above its nominal (None: no limit);
    borrowed GPUs are reclaimed, by preemption, when their owner asks for them. ``budget``: the dollars its runs
    may cost in a budget period (None: no budget); over it, its pending jobs wait (budgets.py)."""

    name: str
    nominal_gpus: int
    cohort: str | None = None
    borrowing_limit: int | None = None
    budget: float | None = None

    def __post_init__(self) -> None:
        if self.nominal_gpus < 0:
            raise ValueError(f"tenant {self.name!r}: nominal quota {self.nominal_gpus}; it must be 0 or more GPUs")
        if self.borrowing_limit is not None and self.borrowing_limit < 0:
            raise ValueError(f"tenant {self.name!r}: borrowing_limit {self.borrowing_limit}; 0 or more, or None")
        if self.budget is not None and not 0 <= self.budget < float("inf"):
            raise ValueError(f"tenant {self.name!r}: budget {self.budget}; a finite number of dollars >= 0, or None")


@dataclass(frozen=True)
class Job:
    """A job as submitted, plus what the scheduler has done to it. ``predicted_s`` comes from submit-time
    information only (the tenant's history: predict.py); ``preempted_by`` and ``preemptions`` keep
    preemption from cycling; the State keeps those and the runs when it requeues a job."""

    id: str
    tenant: str
    workers: int  # gang size: all or none
    per_worker: int  # GPUs of each worker, on one node
    submitted: float
    priority: int = 0
    predicted_s: float = 3600.0
    preemptions: int = 0
    preempted_by: frozenset[str] = frozenset()
    queued_at: float | None = None  # when it was last queued; None: at submit
    ran: tuple[tuple[float, float], ...] = ()  # its earlier runs, (started, ended) each: what LAS policies read
    kind: str = ""  # its class for the speed table (speeds.py): jobs of a kind run alike on each GPU type
    gpu_types: tuple[str, ...] = ()  # the GPU types it may run on; empty: any
    prefer: tuple[str, ...] = ()  # of those, the ones it would rather have, best first
    mix_types: bool = False  # one gang may span GPU types (it runs at the pace of the slowest)
    gpu_milli: int = MILLI  # less than 1000: one process on a share of one GPU, in thousandths (sharing.py)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.per_worker < 1:
            raise ValueError(f"job {self.id!r}: {self.workers} worker(s) x {self.per_worker} GPU(s); both >= 1")
        if stray := set(self.prefer) - set(self.gpu_types or self.prefer):
            raise ValueError(f"job {self.id!r}: prefers {sorted(stray)}, which its gpu_types {self.gpu_types} exclude")
        if not 0 < self.gpu_milli <= MILLI or (self.gpu_milli < MILLI and self.gpus != 1):
            raise ValueError(
                f"job {self.id!r}: {self.gpu_milli} thousandths of a GPU for {self.workers} x {self.per_worker}: "
                f"a share (1 to {MILLI - 1} thousandths) is of one GPU, for one worker"
            )

    @property
    def gpus(self) -> int:
        """GPUs it is placed on: a share is on one (what it counts against a quota: ``counted``)."""
        return self.workers * self.per_worker

    @property
    def gpu_use(self) -> float:
        """GPUs it uses: a share, its fraction of one."""
        return self.gpus * self.gpu_milli / MILLI

    @property
    def shares(self) -> bool:
        """It takes a share of one GPU, beside other shares: kept apart from gangs (never preempting one, never
        preempted for one)."""
        return self.gpu_milli < MILLI

    @property
    def ask(self) -> Ask:
        """What it asks of each node it runs on, as the packing measures it (sharing.py)."""
        return Ask(0, self.per_worker, self.gpu_milli, self.gpu_types)


def counted(job: Job, shared_milli: int, sign: int = 1) -> tuple[int, int]:
    """What ``job`` starting (``sign`` 1) or stopping (-1) changes in its tenant's GPUs held against its quota,
    and its tenant's thousandths in shares after (``shared_milli``: before). A gang counts its GPUs; a tenant's
    shares count together as the whole GPUs they fill, rounded up: two halves are one GPU, three are two."""
    if not job.shares:
        return sign * job.gpus, shared_milli
    after = shared_milli + sign * job.gpu_milli
    return gpus_filled(after) - gpus_filled(shared_milli), after


@dataclass(frozen=True)
class Run:
    """A running job: where, since when, and its last committed checkpoint (work after it is lost if the job
    is killed). ``evicting_for``: the job it was asked to checkpoint and make room for."""

    job: Job
    placement: dict[str, int]
    started: float
    last_checkpoint: float
    evicting_for: str | None = None
    carve: int | None = None  # a share's GPU: which of its node's shared GPUs (Cluster.carved)

    @property
    def id(self) -> str:
        return self.job.id


@dataclass(frozen=True)
class Admit:
    job: str
    placement: dict[str, int]
    borrowing: bool  # admitted on GPUs lent by its cohort: reclaimable
    carve: int | None = None  # a share's GPU on its node (Cluster.carved)


@dataclass(frozen=True)
class Preempt:
    """Make room for ``for_job``: the victim is asked to checkpoint and leave (SIGTERM), and leaves when the
    checkpoint commits or the grace period ends. Every policy preempts this way: checkpoint-on-SIGTERM is the
    runtime's, so any policy running on phalanx gets it."""

    job: str
    for_job: str
    reason: str


@dataclass(frozen=True)
class Wait:
    """Why a job is still pending, for a person: ``kind`` is one of quota, placement, preempting, behind;
    ``behind`` the job it waits for, if one."""

    job: str
    kind: str
    reason: str
    behind: str | None = None


@dataclass
class Round:
    """One round's decisions. ``why`` explains any pending job, also those the round never reached."""

    admit: list[Admit] = field(default_factory=list)
    preempt: list[Preempt] = field(default_factory=list)
    waits: dict[str, Wait] = field(default_factory=dict)
    otherwise: str = "not considered this round"

    def why(self, job: str) -> Wait:
        return self.waits.get(job) or Wait(job, "behind", self.otherwise)
