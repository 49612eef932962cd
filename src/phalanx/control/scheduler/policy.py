"""phalanx's policy. A round, given the state and the time:

1. jobs whose preemption victims have left take the room made for them; those whose victims are still
   checkpointing wait for them;
2. jobs within their tenant's nominal quota, in queue order: priority class, then submit time plus their
   predicted duration (capped), so short jobs pass long ones by a bounded amount and nobody starves. The
   first one that does not fit gets a reservation: where and when it will fit as running jobs end (their
   predicted ends); later jobs backfill only onto GPUs that do not delay it, or if they end before it starts;
3. jobs that must borrow their cohort's idle quota, the tenant with the least fair-share usage first (usage
   with a half-life: see ``Usage``); if no job within its quota holds the reservation, the first borrowing
   job in queue order that finds no room gets it (big jobs of busy tenants were otherwise passed for days);
4. preemption for jobs still blocked that are within their quota (reclaim from tenants that borrow) or that
   outrank running jobs: victims that lose the least work since their last checkpoint, asked to checkpoint
   first; never a job already preempted ``max_preemptions`` times, never one that preempted this job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from phalanx.control.scheduler.cluster import Cluster
from phalanx.control.scheduler.jobs import Job, Round, Run
from phalanx.control.scheduler.placement import place
from phalanx.control.scheduler.snapshot import Snapshot
from phalanx.control.scheduler.state import State


@dataclass(frozen=True)
class PredictiveBackfill:
    """phalanx's own policy ("phalanx" to the simulator and the server): predicted durations order the queue
    and place reservations, later jobs backfill around them, preemption is checkpoint-aware."""

    name: ClassVar[str] = "phalanx"
    stretch: float = 1.0  # queue key: submitted + stretch x predicted duration ...
    stretch_cap_s: float = 4 * 3600  # ... capped: no job is passed by more than this
    restart_s: float = 60.0  # what a restart costs a victim, besides its work since its last checkpoint
    max_preemptions: int = 3
    plans_per_round: int = 8  # blocked jobs a round plans preemption for, at most
    short_factor: float = 8.0  # a job predicted this many times shorter than a run's rest may preempt it ...
    min_run_s: float = 600.0  # ... once that has run this long

    def key(self, job: Job) -> tuple:
        return (-job.priority, job.submitted + min(self.stretch * job.predicted_s, self.stretch_cap_s))

    def schedule(self, state: State, now: float) -> Round:
        snap = Snapshot(state, now)
        for job in sorted((state.queue.jobs[j] for j in state.first), key=lambda job: (*self.key(job), job.id)):
            self._try(snap, job, snap.cluster)  # in queue order, whatever order their victims left in
        for victim in sorted(state.leaving):
            job_id = state.running[victim].evicting_for
            if job_id in state.queue.jobs and not snap.seen(state.queue.jobs[job_id]):
                snap.wait(
                    state.queue.jobs[job_id], "preempting", f"waiting for {victim} to checkpoint and leave", victim
                )
        long_view, reserved_at, holder, blocked = None, None, None, []
        for job in state.queue.of_tenants(t for t in state.tenants if snap.held[t] < state.tenants[t].nominal_gpus):
            if snap.nothing_fits():
                break
            if snap.seen(job):
                continue
            if snap.quota(job)[0]:
                continue  # borrowing: step 3
            if self._try(snap, job, _view(snap, job, long_view, reserved_at)):
                continue
            if long_view is None:
                reservation = self._reserve(snap, job)
                if reservation is None:
                    snap.wait(job, "placement", f"needs {_shape(job)}; the cluster cannot hold it even empty")
                    continue
                (long_view, reserved_at), holder = _hold(snap, job, reservation), job
                blocked.append(job)
            elif snap.place(job) is None:
                snap.wait(job, "placement", f"no room for {_shape(job)}; behind {holder.id}", behind=holder.id)
                blocked.append(job)
            else:
                snap.wait(job, "reservation", f"would delay {holder.id}, reserved at t={reserved_at:.0f}", holder.id)
        if long_view is None and (reservation := self._reserve_for_borrower(snap)) is not None:
            long_view, reserved_at = reservation
        self._borrow(snap, long_view, reserved_at)
        self._preempt(snap, blocked)
        snap.round.otherwise = (
            f"no room: {snap.cluster.free_gpus} of {snap.cluster.total_gpus} GPUs free"
            if snap.nothing_fits()
            else "not reached this round: the jobs ahead of it in the queue took what was free"
        )
        return snap.round

    def _try(self, snap: Snapshot, job: Job, view: Cluster) -> bool:
        borrowing, why = snap.quota(job)
        if why is not None:
            snap.wait(job, "quota", why)
            return False
        placement = snap.place(job, view)
        if placement is None:
            return False
        snap.admit(job, placement, borrowing, on=view)
        return True

    def _reserve(self, snap: Snapshot, job: Job) -> tuple[float, dict[str, int]] | None:
        """When and where ``job`` fits as running jobs end at their predicted ends (a job past its prediction:
        after as long again), and each node's GPUs that later jobs may take without delaying it."""
        now, ends = snap.now, []
        for run in snap.state.running.values():
            end = now if run.id in snap.leaving else run.started + run.job.predicted_s
            ends.append((end if end >= now else 2 * now - run.started, run.placement))
        ends += [(now + started.predicted_s, placement) for started, placement in snap.started]
        ends.sort(key=lambda end: end[0])
        future, pw = snap.cluster.copy(), job.per_worker
        slots = sum(free // pw for free in future.free.values())
        for end, placement in ends:
            before = sum(future.free[n] // pw for n in placement)
            future.release(placement)
            slots += sum(future.free[n] // pw for n in placement) - before
            if slots >= job.workers:
                where = place(future, job.workers, pw)
                assert where is not None
                return end, {n: future.free[n] - g for n, g in where.gpus.items()}
        return None

    def _reserve_for_borrower(self, snap: Snapshot) -> tuple[Cluster, float] | None:
        """No job within its quota holds the reservation: the first job in queue order that may borrow, if no
        room is what stops it, gets it, so that the jobs of busier tenants backfill around it instead of
        passing a big job forever."""
        for job in snap.state.queue.of_tenants(t for t in snap.state.tenants if snap.may_borrow(t)):
            if snap.nothing_fits():
                return None
            if snap.seen(job):
                continue
            borrowing, why = snap.quota(job)
            if not borrowing or why is not None:
                continue
            if snap.place(job) is not None or (reservation := self._reserve(snap, job)) is None:
                return None  # it fits now (the borrowing pass decides), or it never will
            return _hold(snap, job, reservation)
        return None

    def _borrow(self, snap: Snapshot, long_view: Cluster | None, reserved_at: float | None) -> None:
        state = snap.state
        heap = [(snap.share(t), t) for t in state.tenants]
        heapq.heapify(heap)
        jobs = {t: state.queue.of(t) for t in state.tenants}
        while heap and not snap.nothing_fits():
            share, tenant = heapq.heappop(heap)
            for job in jobs[tenant]:
                if snap.seen(job) or not snap.quota(job)[0]:
                    continue
                if self._try(snap, job, _view(snap, job, long_view, reserved_at)):
                    heapq.heappush(heap, (share + job.gpus / max(state.tenants[tenant].nominal_gpus, 1), tenant))
                    break
                if not snap.may_borrow(tenant):
                    break

    def _preempt(self, snap: Snapshot, blocked: list[Job]) -> None:
        """Reclaim and priority preemption for blocked jobs, in queue order, a few plans a round."""
        state = snap.state
        ids = {job.id for job in blocked}
        for tenant in state.tenants.values():  # each tenant's first job the round left waiting
            for job in state.queue.of(tenant.name):
                if job.id not in snap.admitted and job.id not in ids:
                    blocked.append(job)
                    break
        making_room = {state.running[r].evicting_for for r in state.leaving}  # their victims are leaving
        blocked = sorted((job for job in blocked if job.id not in making_room), key=lambda j: (*self.key(j), j.id))
        for job in blocked[: self.plans_per_round]:
            runs = snap.state.cheapest(snap.now, self.restart_s)
            candidates = snap.preemptible(job, runs, self.max_preemptions, lambda j, r: self._shorter(snap, j, r))
            victims = snap.victims(job, candidates) if candidates else None
            if not victims:
                continue
            snap.preempt(victims, job, lambda run, job=job: self._why(snap, job, run))
            names = ", ".join(run.id for run in victims)
            snap.wait(job, "preempting", f"making room: asked {names} to checkpoint and leave", victims[0].id)

    def _shorter(self, snap: Snapshot, job: Job, run: Run) -> bool:
        """``run`` is predicted to need ``short_factor`` times longer than ``job`` still, its tenant has used
        no less of its share, and it has run long enough not to thrash."""
        ran = snap.now - run.started
        left = max(run.job.predicted_s - ran, ran)
        if ran < self.min_run_s or left < self.short_factor * job.predicted_s:
            return False
        return snap.share(job.tenant) <= snap.share(run.job.tenant)

    def _why(self, snap: Snapshot, job: Job, run: Run) -> str:
        victim, tenant = run.job, snap.state.tenants[job.tenant]
        if victim.priority < job.priority:
            return f"priority: {job.id} (priority {job.priority}) outranks it ({victim.priority})"
        t = snap.state.tenants[victim.tenant]
        if victim.tenant != job.tenant and snap.held[job.tenant] + job.gpus <= tenant.nominal_gpus:
            return (
                f"reclaim: tenant {job.tenant} needs its quota back for {job.id}; tenant {t.name} is borrowing "
                f"({snap.held[t.name]} of its {t.nominal_gpus} GPUs held)"
            )
        ran = snap.now - run.started
        return (
            f"shorter job: {job.id} is predicted to take {job.predicted_s:.0f} s; this one has run {ran:.0f} s "
            f"and is predicted to need {max(victim.predicted_s - ran, ran):.0f} s more"
        )


def _hold(snap: Snapshot, job: Job, reservation: tuple[float, dict[str, int]]) -> tuple[Cluster, float]:
    """``job`` holds the reservation: it waits for it, and later jobs get the view of its slack."""
    reserved_at, caps = reservation
    where = ", ".join(sorted(caps))
    snap.wait(job, "reservation", f"reserved: {_shape(job)} on {where} at about t={reserved_at:.0f}", at=reserved_at)
    return snap.view(caps), reserved_at


def _view(snap: Snapshot, job: Job, long_view: Cluster | None, reserved_at: float | None) -> Cluster:
    """Where ``job`` may go: anywhere free if it ends before the reservation starts, else its slack only."""
    if long_view is None or (reserved_at is not None and snap.now + job.predicted_s <= reserved_at):
        return snap.cluster
    return long_view


def _shape(job: Job) -> str:
    return f"{job.workers} x {job.per_worker} GPU(s)" if job.workers > 1 else f"{job.gpus} GPU(s)"
