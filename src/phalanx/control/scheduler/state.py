"""The scheduler's world between rounds: the cluster, the tenants, the running jobs and the queue. The caller
(the control plane or the simulator) applies each round's decisions through these methods, which keep the
cluster's free GPUs, each tenant's GPUs held and its fair-share usage consistent."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import ClassVar, Protocol

from phalanx.control.scheduler.cluster import Cluster
from phalanx.control.scheduler.jobs import Job, Round, Run, Tenant


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

    def of_tenants(self, tenants: Iterable[str]) -> Iterator[Job]:
        """The jobs of these tenants only, in the queue's order."""
        merged = heapq.merge(*(self._tenant.get(t, ()) for t in tenants))
        return (self.jobs[entry[-1]] for entry in merged)

    def of(self, tenant: str) -> Iterator[Job]:
        return (self.jobs[entry[-1]] for entry in self._tenant.get(tenant, ()))


class Usage:
    """Each tenant's fair-share usage: GPU-seconds, decayed with a half-life, so that what a team used
    yesterday counts half as much as what it uses now. Kept in O(1) per change: value at ``at`` plus the
    GPUs held since then."""

    def __init__(self, half_life_s: float):
        self.half_life_s = half_life_s
        self._tau = half_life_s / math.log(2)
        self._at: dict[str, tuple[float, float, int]] = {}  # tenant -> (value, at, GPUs held since)

    def value(self, tenant: str, now: float) -> float:
        value, at, held = self._at.get(tenant, (0.0, now, 0))
        decay = math.exp(-(now - at) / self._tau)
        return value * decay + held * self._tau * (1 - decay)

    def change(self, tenant: str, now: float, held: int) -> None:
        self._at[tenant] = (self.value(tenant, now), now, held)

    def share(self, tenant: str, nominal_gpus: int, now: float) -> float:
        """Usage in units of the tenant's quota: 1.0 is a tenant that has held exactly its quota forever."""
        return self.value(tenant, now) / (self._tau * max(nominal_gpus, 1))


class State:
    def __init__(self, cluster: Cluster, tenants: Iterable[Tenant], queue: Queue, half_life_s: float = 6 * 3600):
        self.cluster = cluster
        self.tenants: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in self.tenants:
                raise ValueError(f"tenant {tenant.name!r} is listed twice")
            self.tenants[tenant.name] = tenant
        self.queue = queue
        self.usage = Usage(half_life_s)
        self.running: dict[str, Run] = {}
        self.held: dict[str, int] = dict.fromkeys(self.tenants, 0)
        self.leaving: set[str] = set()  # running jobs asked to make room
        # GPUs -> [(-last checkpoint, -start, id)], sorted: the victims' index (``cheapest``)
        self._by_checkpoint: dict[int, list[tuple[float, float, str]]] = {}
        self.first: dict[str, None] = {}  # jobs whose victims have left: they take the room made for them
        self.cohorts: dict[str, list[str]] = {}
        for tenant in self.tenants.values():
            if tenant.cohort is not None:
                self.cohorts.setdefault(tenant.cohort, []).append(tenant.name)

    def submit(self, job: Job) -> None:
        if job.tenant not in self.tenants:
            raise ValueError(f"job {job.id!r}: tenant {job.tenant!r} is not known; tenants: {sorted(self.tenants)}")
        if job.id in self.running:
            raise ValueError(f"job {job.id!r} is running; it cannot be queued again")
        self.queue.add(job)

    def start(self, job_id: str, placement: Mapping[str, int], now: float) -> Run:
        job = self.queue.jobs.get(job_id)
        if job is None:
            raise ValueError(f"job {job_id!r} is not pending; only a pending job can start")
        if sum(placement.values()) != job.gpus:
            raise ValueError(f"job {job_id!r} needs {job.gpus} GPUs; the placement has {sum(placement.values())}")
        self.cluster.allocate(placement)
        self.queue.remove(job_id)
        self.first.pop(job_id, None)
        run = self.running[job_id] = Run(job, dict(placement), now, last_checkpoint=now)
        self._index(run, add=True)
        self._hold(job.tenant, job.gpus, now)
        return run

    def ask_to_evict(self, job_id: str, for_job: str) -> None:
        self.running[job_id] = replace(self.running[job_id], evicting_for=for_job)
        self.leaving.add(job_id)

    def checkpointed(self, job_id: str, at: float) -> None:
        self._index(self.running[job_id], add=False)
        self.running[job_id] = replace(self.running[job_id], last_checkpoint=at)
        self._index(self.running[job_id], add=True)

    def cheapest(self, now: float, restart_s: float) -> Iterator[Run]:
        """Running jobs, those that would lose the least if evicted now first: GPUs x (time since their last
        checkpoint + a restart), the most recently started among equals. Lazy: a round that needs a few
        victims reads a few, from an index kept per job size (within a size, the order does not change with
        time)."""
        streams = [
            ((gpus * (now + restart_s + neg_ckpt), neg_start, job_id) for neg_ckpt, neg_start, job_id in by_size)
            for gpus, by_size in self._by_checkpoint.items()
        ]
        return (self.running[entry[-1]] for entry in heapq.merge(*streams))

    def stop(self, job_id: str, now: float) -> Run:
        """The job left its GPUs (finished, failed or evicted)."""
        run = self.running.pop(job_id)
        self._index(run, add=False)
        self.leaving.discard(job_id)
        self.cluster.release(run.placement)
        self._hold(run.job.tenant, -run.job.gpus, now)
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
        self.queue.add(job)
        if by in self.queue.jobs and not any(self.running[r].evicting_for == by for r in self.leaving):
            self.first[by] = None  # its last victim has left
        return job

    def withdraw(self, job_id: str) -> Job:
        """A pending job leaves the queue for good (cancelled)."""
        self.first.pop(job_id, None)
        return self.queue.remove(job_id)

    def _index(self, run: Run, add: bool) -> None:
        runs = self._by_checkpoint.setdefault(run.job.gpus, [])
        entry = (-run.last_checkpoint, -run.started, run.id)
        if add:
            bisect.insort(runs, entry)
        else:
            del runs[bisect.bisect_left(runs, entry)]

    def _hold(self, tenant: str, gpus: int, now: float) -> None:
        self.held[tenant] += gpus
        self.usage.change(tenant, now, self.held[tenant])


class Policy(Protocol):
    """A scheduling policy: the order its queue keeps (a key fixed when a job is queued) and a round."""

    name: ClassVar[str]

    def key(self, job: Job) -> tuple: ...

    def schedule(self, state: State, now: float) -> Round: ...
