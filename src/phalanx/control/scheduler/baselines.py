"""The baselines the simulator measures phalanx against, on the same cluster, placement and cost model:

- ``Fifo``: one queue in submit order; the head waits for room and everything waits behind it.
- ``KueueLike``: Kueue's BestEffortFIFO ClusterQueues (a job that cannot start is passed over), its
  ResourceFlavors (GPU types) tried in the order listed, cohort borrowing (jobs within their quota first),
  classic preemption (reclaim from borrowers and lower priority; victims the lowest priority, then the most
  recently admitted), no cycle guard.
- ``Fifo`` and ``TiresiasLike`` know nothing of GPU types: a gang takes the best fit of any one type.
- ``TiresiasLike``: discretised two-dimensional LAS (Tiresias, NSDI'19) as its authors' simulator runs it: two
  queues by GPU-time executed since the last reset (service.py), first come first served within a queue; a
  waiting job of a better queue preempts running jobs of worse ones, the latest comer first. No quotas.

Each preempts the way the runtime lets any policy: its victims checkpoint on SIGTERM, then leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phalanx.control.scheduler.jobs import Job, Round
from phalanx.control.scheduler.service import Levels
from phalanx.control.scheduler.snapshot import Snapshot
from phalanx.control.scheduler.state import State


@dataclass(frozen=True)
class Fifo:
    name: ClassVar[str] = "fifo"

    def key(self, job: Job) -> tuple:
        return (job.submitted,)

    def schedule(self, state: State, now: float) -> Round:
        snap = Snapshot(state, now)
        for job in state.queue:
            placement = snap.place(job)
            if placement is None:
                snap.wait(job, "placement", "strict FIFO: the first job waits for room")
                snap.round.otherwise = f"strict FIFO: behind {job.id}"
                break
            snap.admit(job, placement, borrowing=False)
        return snap.round


@dataclass(frozen=True)
class KueueLike:
    name: ClassVar[str] = "kueue-like"
    plans_per_round: int = 8

    def key(self, job: Job) -> tuple:
        return (-job.priority, job.submitted)

    def schedule(self, state: State, now: float) -> Round:
        snap, blocked = Snapshot(state, now), []
        for borrowing_pass in (False, True):
            for job in state.queue:
                if snap.nothing_fits():
                    break
                borrowing, why = snap.quota(job)
                if snap.seen(job) or borrowing != borrowing_pass:
                    continue
                if why is None and (placement := snap.place(job, snap.types_of(job))) is not None:
                    snap.admit(job, placement, borrowing)  # its flavors (GPU types) tried in order
                    continue
                snap.wait(job, "quota" if why else "placement", why or "no room")
                if not borrowing:
                    blocked.append(job)  # within its quota: reclaim
        if not blocked:  # the cluster filled up before the quota-guaranteed jobs were reached
            blocked = [job for job in state.queue if not snap.seen(job) and not snap.quota(job)[0]]
        order = sorted(state.running.values(), key=lambda run: (run.job.priority, -run.started, run.id))
        for job in blocked[: self.plans_per_round]:
            victims = snap.victims(job, snap.preemptible(job, order))
            if victims:
                snap.preempt(victims, job, lambda run: "classic preemption")
        return snap.round


@dataclass(frozen=True)
class TiresiasLike:
    name: ClassVar[str] = "tiresias-like"
    threshold_gpu_s: float = 3600.0  # GPU-time executed since its last reset that moves a job to the second queue
    promote_knob: float = 8.0  # pending this many times its executed time: reset, back to the first queue
    plans_per_round: int = 8

    def key(self, job: Job) -> tuple:
        return (job.submitted,)

    @property
    def levels(self) -> Levels:
        return Levels(self.threshold_gpu_s, self.promote_knob)

    def schedule(self, state: State, now: float) -> Round:
        snap, las = Snapshot(state, now), self.levels
        levels = {job.id: las.level(job, now) for job in state.queue}
        pending = sorted(state.queue, key=lambda job: (levels[job.id], job.submitted, job.id))
        worse = [run for run in state.running.values() if las.level(run.job, now, run.started) == 1]
        plans = 0
        for job in pending:
            level = levels[job.id]
            if snap.nothing_fits() and (level == 1 or not worse or plans >= self.plans_per_round):
                break
            if (placement := snap.place(job)) is not None:
                snap.admit(job, placement, borrowing=False)
                continue
            snap.wait(job, "placement", f"queue {level}: no room")
            if level == 0 and worse and plans < self.plans_per_round:
                order = sorted(worse, key=lambda run: (-run.job.submitted, run.id))  # the latest comer first
                if victims := snap.victims(job, order):
                    plans += 1
                    snap.preempt(victims, job, lambda run: "2D-LAS: a job of the first queue")
                    worse = [run for run in worse if run.id not in snap.leaving]
        return snap.round
