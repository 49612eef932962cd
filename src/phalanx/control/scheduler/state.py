"""The scheduler's world between rounds: the cluster, the tenants, the running jobs and the queue. The caller
(the control plane or the simulator) applies each round's decisions through these methods, which keep the
cluster's free GPUs, each tenant's GPUs held, the indexes a round reads (victims by what they would lose,
each tenant's runs in the order they started and those it borrows, the pending jobs that have run before),
the GPU-time given out and asked back, and each tenant's spend in the budget period consistent."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import ClassVar, Protocol

from phalanx.control.scheduler.cluster import Cluster
from phalanx.control.scheduler.jobs import Job, Round, Run, Tenant, counted
from phalanx.control.scheduler.sharing import BestFit, Fragmentation, Workload
from phalanx.control.scheduler.speeds import Speeds


class Queue:
    """Pending jobs in a policy's order, a key fixed when the job is queued (so a round reads them in order
    without sorting), also per tenant."""

    def __init__(self, key: Callable[[Job], tuple]):
        self._key = key
        self.jobs: dict[str, Job] = {}
        self._order: list[tuple] = []
        self._tenant: dict[str, list[tuple]] = {}

    def add(self, job: Job) -> None:
        if job.id in self.jobs:
            raise ValueError(f"job {job.id!r} is already queued")
        entry = (*self._key(job), job.id)
        self.jobs[job.id] = job
        bisect.insort(self._order, entry)
        bisect.insort(self._tenant.setdefault(job.tenant, []), entry)

    def remove(self, job_id: str) -> Job:
        job = self.jobs.pop(job_id)
        entry = (*self._key(job), job.id)
        for entries in (self._order, self._tenant[job.tenant]):
            del entries[bisect.bisect_left(entries, entry)]
        return job

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[Job]:
        """In order. A round only reads the queue; add or remove jobs after iterating, not during."""
        return (self.jobs[entry[-1]] for entry in self._order)

    def entries(self) -> Iterator[tuple[tuple, Job]]:
        """In order, each with the key it was queued under (its id last)."""
        return ((entry, self.jobs[entry[-1]]) for entry in self._order)

    def of(self, tenant: str) -> Iterator[Job]:
        return (self.jobs[entry[-1]] for entry in self._tenant.get(tenant, ()))


class State:
    def __init__(self, cluster: Cluster, tenants: Iterable[Tenant], queue: Queue, speeds: Speeds | None = None):
        self.cluster = cluster
        self.speeds = speeds if speeds is not None else Speeds(cluster.types)  # learned as jobs run
        self.tenants: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in self.tenants:
                raise ValueError(f"tenant {tenant.name!r} is listed twice")
            self.tenants[tenant.name] = tenant
        self.queue = queue
        # where shares go: FGD's measure for the shapes of the jobs submitted so far, best fit among equals
        self.workload = Workload()
        self.share_score = Fragmentation(self.workload, tie_break=BestFit(0, cluster.largest))
        self.running: dict[str, Run] = {}
        self.runs_of: dict[str, dict[str, None]] = {t: {} for t in self.tenants}  # each tenant's, in start order
        self.runs_on: dict[str, dict[str, None]] = {}  # the runs on each GPU type ("a+b": a gang over two)
        self.ran_before: dict[str, None] = {}  # pending jobs that have run (LAS levels change only for these)
        self.held: dict[str, int] = dict.fromkeys(self.tenants, 0)  # GPUs against each quota (jobs.counted)
        self.shared: dict[str, int] = dict.fromkeys(self.tenants, 0)  # each tenant's thousandths in shares
        self.leaving: set[str] = set()  # running jobs asked to make room
        # GPUs -> [(-last checkpoint, -start, id)], sorted: the victims' index (``cheapest``)
        self._by_checkpoint: dict[int, list[tuple[float, float, str]]] = {}
        self.first: dict[str, None] = {}  # jobs whose victims have left: they take the room made for them
        self._borrowed: dict[str, set[str]] = {}  # tenant -> its borrowed runs (``borrowed``), while still true
        # GPU-seconds given out, and the GPUs (and their squares: a commit grows with its size) of the runs asked
        # to leave for another job: what a policy's preemption budget is measured against
        self._given_gpu_s, self._given_at, self._held_total = 0.0, None, 0
        self.evicted_gpus, self.evicted_gpus_sq = 0, 0
        # money: each tenant's dollars in the budget period until ``_spent_at`` and what its runs cost an hour
        # (``dollars``: the spend now, read every round), and the pending jobs of the tenants over budget, held
        # out of the queue (budgets.py), with why
        self.period_start = float("-inf")
        self.spent: dict[str, float] = dict.fromkeys(self.tenants, 0.0)
        self._spent_at: dict[str, float] = dict.fromkeys(self.tenants, float("-inf"))
        self._per_h: dict[str, float] = dict.fromkeys(self.tenants, 0.0)
        self.on_hold: dict[str, Job] = {}
        self.holding: dict[str, str] = {}
        self.cohorts: dict[str, list[str]] = {}
        for tenant in self.tenants.values():
            if tenant.cohort is not None:
                self.cohorts.setdefault(tenant.cohort, []).append(tenant.name)

    def submit(self, job: Job) -> None:
        if job.tenant not in self.tenants:
            raise ValueError(f"job {job.id!r}: tenant {job.tenant!r} is not known; tenants: {sorted(self.tenants)}")
        if job.id in self.running:
            raise ValueError(f"job {job.id!r} is running; it cannot be queued again")
        self._enqueue(job)
        self.workload.observe(job.ask)

    def _enqueue(self, job: Job) -> None:
        """Into the queue, or on hold while its tenant is over budget."""
        if job.tenant in self.holding:
            if job.id in self.on_hold:
                raise ValueError(f"job {job.id!r} is already queued")
            self.on_hold[job.id] = job
            return
        self.queue.add(job)
        if job.ran:
            self.ran_before[job.id] = None

    def start(self, job_id: str, placement: Mapping[str, int], now: float, carve: int | None = None) -> Run:
        """The job starts on ``placement``; a share, on shared GPU ``carve`` of its one node."""
        job = self.queue.jobs.get(job_id)
        if job is None:
            raise ValueError(f"job {job_id!r} is not pending; only a pending job can start")
        if sum(placement.values()) != job.gpus:
            raise ValueError(f"job {job_id!r} needs {job.gpus} GPUs; the placement has {sum(placement.values())}")
        if (carve is not None) != job.shares:
            raise ValueError(f"job {job_id!r}: a shared GPU is given to a share, and only to a share; got {carve}")
        if carve is not None:
            self.cluster.take_share(next(iter(placement)), carve, job.gpu_milli)
        else:
            self.cluster.allocate(placement)
        self.queue.remove(job_id)
        self.first.pop(job_id, None)
        self.ran_before.pop(job_id, None)
        run = self.running[job_id] = Run(job, dict(placement), now, last_checkpoint=now, carve=carve)
        self.runs_of[job.tenant][job_id] = None
        self.runs_on.setdefault(self.cluster.type_of(placement), {})[job_id] = None
        self._index(run, add=True)
        gpus, self.shared[job.tenant] = counted(job, self.shared[job.tenant])
        self._hold(job.tenant, gpus, now)
        self._pay(job.tenant, self.cluster.dollars_per_h(placement, job.gpu_milli), now)
        return run

    def ask_to_evict(self, job_id: str, for_job: str) -> None:
        """Ask a run to checkpoint and leave: for job ``for_job``, or cancelled ("")."""
        run = self.running[job_id] = replace(self.running[job_id], evicting_for=for_job)
        self.leaving.add(job_id)
        if for_job:
            self.evicted_gpus += run.job.gpus
            self.evicted_gpus_sq += run.job.gpus**2

    def gpu_s_given(self, now: float) -> float:
        """GPU-seconds held by runs, in all, until ``now``."""
        return self._given_gpu_s + self._held_total * (now - self._given_at) if self._given_at is not None else 0.0

    def checkpointed(self, job_id: str, at: float) -> None:
        self._index(self.running[job_id], add=False)
        self.running[job_id] = replace(self.running[job_id], last_checkpoint=at)
        self._index(self.running[job_id], add=True)

    def cheapest(self, now: float, restart_s: float) -> Iterator[Run]:
        """Running jobs, those that would lose the least if evicted now first: GPUs x (time since their last
        checkpoint + a restart), the most recently started among equals. Lazy: a round that needs a few
        victims reads a few, from an index kept per job size (within a size, the order does not change with
        time)."""

        def costs(gpus: int, by_size: list[tuple[float, float, str]]) -> Iterator[tuple[float, float, str]]:
            # a function of its own: a generator expression would read ``gpus`` late, every stream the last one's
            return ((gpus * (now + restart_s + neg_ckpt), neg_start, job_id) for neg_ckpt, neg_start, job_id in by_size)

        streams = [costs(gpus, by_size) for gpus, by_size in self._by_checkpoint.items()]
        return (self.running[entry[-1]] for entry in heapq.merge(*streams))

    def stop(self, job_id: str, now: float) -> Run:
        """The job left its GPUs (finished, failed or evicted)."""
        run = self.running.pop(job_id)
        self._pay(run.job.tenant, -self.cluster.dollars_per_h(run.placement, run.job.gpu_milli), now)
        self._index(run, add=False)
        self.leaving.discard(job_id)
        del self.runs_of[run.job.tenant][job_id]
        del self.runs_on[self.cluster.type_of(run.placement)][job_id]
        if run.carve is not None:
            self.cluster.give_share(next(iter(run.placement)), run.carve, run.job.gpu_milli)
        else:
            self.cluster.release(run.placement)
        gpus, self.shared[run.job.tenant] = counted(run.job, self.shared[run.job.tenant], -1)
        self._hold(run.job.tenant, gpus, now)
        return run

    def requeue(self, job_id: str, now: float, preempted: bool = True) -> Job:
        """A running job left and is queued again, keeping its submit time (its place in line). A preemption is
        counted, and by whom; a run lost or stopped from outside (``preempted`` False) is not."""
        run = self.stop(job_id, now)
        by = run.evicting_for if preempted else None
        job = replace(
            run.job,
            preemptions=run.job.preemptions + preempted,
            preempted_by=run.job.preempted_by | ({by} if by else set()),
            queued_at=now,
            ran=(*run.job.ran, (run.started, now)),
        )
        self._enqueue(job)
        if by in self.queue.jobs and not any(self.running[r].evicting_for == by for r in self.leaving):
            self.first[by] = None  # its last victim has left
        return job

    def withdraw(self, job_id: str) -> Job:
        """A pending job leaves the queue for good (cancelled)."""
        if job_id in self.on_hold:
            return self.on_hold.pop(job_id)
        self.first.pop(job_id, None)
        self.ran_before.pop(job_id, None)
        return self.queue.remove(job_id)

    def pending(self) -> Iterator[Job]:
        """Every pending job: the queue's, then those on hold."""
        yield from self.queue
        yield from self.on_hold.values()

    # money ---------------------------------------------------------------------------------------------------
    def dollars(self, tenant: str, now: float) -> float:
        """What the tenant's runs have cost in the budget period until ``now``, the running ones included."""
        per_h, spent = self._per_h[tenant], self.spent[tenant]
        return spent + per_h * max(0.0, now - self._spent_at[tenant]) / 3600 if per_h else spent

    def _pay(self, tenant: str, per_h: float, now: float) -> None:
        """The tenant's spend brought to ``now`` (never back: a run that began before the period costs from its
        start), then its runs' cost an hour changed by ``per_h``."""
        if now > self._spent_at[tenant]:
            self.spent[tenant], self._spent_at[tenant] = self.dollars(tenant, now), now
        self._per_h[tenant] += per_h

    def new_period(self, start: float, spent: Mapping[str, float] | None = None) -> None:
        """A budget period begins at ``start``: each tenant's spend starts again (from ``spent``, the dollars of
        runs that ended within it, when the caller knows of some); its running jobs cost from ``start`` on."""
        self.period_start = start
        self.spent = {t: (spent or {}).get(t, 0.0) for t in self.tenants}
        self._spent_at = dict.fromkeys(self.tenants, start)

    def hold(self, tenant: str, reason: str) -> None:
        """The tenant's pending jobs, and those it queues from now, wait out of the queue; ``reason`` says why."""
        self.holding[tenant] = reason
        for job in list(self.queue.of(tenant)):
            self.withdraw(job.id)
            self.on_hold[job.id] = job

    def release(self, tenant: str) -> None:
        """The tenant's held jobs go back to the queue, each in its place (the queue's key is fixed at submit)."""
        if self.holding.pop(tenant, None) is None:
            return
        for job in [j for j in self.on_hold.values() if j.tenant == tenant]:
            del self.on_hold[job.id]
            self._enqueue(job)

    def _index(self, run: Run, add: bool) -> None:
        """Shares are not indexed: they are never victims."""
        if run.job.shares:
            return
        runs = self._by_checkpoint.setdefault(run.job.gpus, [])
        entry = (-run.last_checkpoint, -run.started, run.id)
        if add:
            bisect.insort(runs, entry)
        else:
            del runs[bisect.bisect_left(runs, entry)]

    def borrowed(self, tenant: str) -> set[str]:
        """The tenant's runs beyond its nominal quota: the latest started hold what it borrows (so a tenant
        within its quota borrows nothing, and its runs stay its own while it does). Kept until the tenant's
        runs change: a round reads it for every victim it considers."""
        if (found := self._borrowed.get(tenant)) is None:
            over, found = self.held[tenant] - self.tenants[tenant].nominal_gpus, set()
            for run_id in reversed(self.runs_of[tenant]):
                if over <= 0:
                    break
                found.add(run_id)
                over -= self.running[run_id].job.gpus
            self._borrowed[tenant] = found
        return found

    def _hold(self, tenant: str, gpus: int, now: float) -> None:
        self._given_gpu_s = self.gpu_s_given(now)
        self._given_at, self._held_total = now, self._held_total + gpus
        self.held[tenant] += gpus
        self._borrowed.pop(tenant, None)


class Policy(Protocol):
    """A scheduling policy: the order its queue keeps (a key fixed when a job is queued) and a round."""

    name: ClassVar[str]

    def key(self, job: Job) -> tuple: ...

    def schedule(self, state: State, now: float) -> Round: ...
