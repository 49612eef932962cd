"""phalanx's policy: least attained service first, the shortest predicted first within a level, quotas kept
by reclaim, and preemption that checkpoints first, costs the least and stays within a budget.

A round, given the state and the time:

1. jobs whose preemption victims have left take the room made for them; those whose victims are still
   checkpointing wait for them;
2. the other pending jobs in order of class, then predicted shortest: the class is the priority, then the
   level of two-dimensional LAS (Tiresias's: a job that has run ``threshold_gpu_s`` GPU-seconds since its
   last reset drops to level 1; pending long enough, it is reset: ``Levels``); within a class, submit time
   plus the predicted duration (capped at ``stretch_cap_s``), so short jobs pass long ones by a bounded
   amount. A job starts if it fits and its quota allows it: within its tenant's nominal quota, or borrowing
   what its cohort leaves idle;
3. preemption, for the first blocked jobs in that order and the first pending job of each tenant below its
   quota, wherever it stands (Kueue reads every queue's head each cycle), a few plans a round. A job may
   preempt:
   - a run of its own tenant, or a borrowed run of another, of a lower priority;
   - a run of a worse level (least attained service: a long run makes way for short jobs, whoever's they
     are), but not one of its own tenant of a higher priority: priorities order a tenant's own jobs only;
   - when the job is within its tenant's nominal quota, another tenant's borrowed run of a level no better
     than its own, whatever its priority (reclaim).
   A tenant's runs beyond its nominal quota, the latest started first, are its borrowed ones: a tenant within
   its quota has none to be reclaimed. Victims are those that would lose the least (GPUs x their time since
   their last checkpoint and a restart), never a job that preempted this one. Preemption for least service
   has a budget: it is made only while what all preemptions cost by the policy's cost model (commit and
   restart, per GPU) stays within ``budget`` of the GPU-time given out. A reclaim (owed to the tenant) and a
   priority (its own order, or its borrowed GPUs) are never refused; they count toward it.

Why this shape: on Philly's months it is 2.5-4% ahead of faithful Tiresias on average JCT, with under a third of its
lost GPU-time, and it stays within its budget when preemption is expensive, where Tiresias thrashes
(docs/scheduling.md, bench/RESULTS.md). Ordering by fair share or holding reservations for big jobs did not
pay for itself once short jobs could preempt; a job that waits ``starve_s`` is promoted instead.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

from phalanx.control.scheduler.cluster import Cluster
from phalanx.control.scheduler.costs import PreemptionCost
from phalanx.control.scheduler.jobs import Job, Round, Run
from phalanx.control.scheduler.service import Levels
from phalanx.control.scheduler.snapshot import Snapshot
from phalanx.control.scheduler.state import State


@dataclass(frozen=True)
class PredictiveLas:
    name: ClassVar[str] = "phalanx"
    threshold_gpu_s: float = 7200.0  # GPU-time since the last reset that moves a job to level 1
    promote_knob: float = 8.0  # pending this many times its executed time: back to level 0 ...
    starve_s: float = 24 * 3600.0  # ... or pending this long, whatever it executed
    stretch_cap_s: float = 24 * 3600.0  # within a class: submitted + predicted duration, capped
    plans_per_round: int = 8  # blocked jobs a round plans preemption for, at most
    victims_read: int = 512  # runs a round reads as possible victims, the cheapest first
    cost: PreemptionCost = field(default_factory=PreemptionCost)  # the operator sets the cluster's
    budget: float = 0.004  # least-service preemptions stop when preemptions cost this share of the GPU-time given

    @cached_property
    def levels(self) -> Levels:
        return Levels(self.threshold_gpu_s, self.promote_knob, self.starve_s)

    def key(self, job: Job) -> tuple:
        """The queue's order, fixed when the job is queued: its class then, and its predicted finish. Only a
        job that has run changes class while pending (a promotion: ``_ordered``)."""
        level = self.levels.level(job, job.queued_at if job.queued_at is not None else job.submitted)
        return (-job.priority, level, job.submitted + min(job.predicted_s, self.stretch_cap_s))

    def schedule(self, state: State, now: float) -> Round:
        snap = Snapshot(state, now)
        for job in sorted((state.queue.jobs[j] for j in state.first), key=lambda job: (*self.key(job), job.id)):
            borrowing, why = snap.quota(job)
            if why is None and (placement := snap.place(job)) is not None:
                snap.admit(job, placement, borrowing)
        making_room = {state.running[r].evicting_for: r for r in sorted(state.leaving, reverse=True)}
        for job_id in sorted(making_room.keys() & state.queue.jobs.keys()):
            victim = making_room[job_id]
            snap.wait(state.queue.jobs[job_id], "preempting", f"waiting for {victim} to checkpoint and leave", victim)
        blocked: list[tuple[Job, int]] = []
        ordered = self._ordered(state, now)
        for job, level in ordered:
            if snap.nothing_fits():
                rest = ((j, lv) for j, lv in itertools.chain([(job, level)], ordered) if not snap.seen(j))
                blocked += itertools.islice(rest, max(0, 2 * self.plans_per_round - len(blocked)))
                break
            if snap.seen(job):
                continue
            borrowing, why = snap.quota(job)
            if why is not None:
                snap.wait(job, "quota", why)
            elif (placement := snap.place(job)) is not None:
                snap.admit(job, placement, borrowing)
                continue
            else:
                snap.wait(job, "placement", f"no room for {_shape(job, snap.cluster)}")
            if len(blocked) < 2 * self.plans_per_round:
                blocked.append((job, level))
        blocked += self._reclaimers(snap, {job.id for job, _ in blocked})
        self._preempt(snap, [(job, level) for job, level in blocked if job.id not in making_room])
        snap.round.otherwise = (
            f"no room: {snap.cluster.free_gpus} of {snap.cluster.of(snap.cluster.total_gpus)} free"
            if snap.nothing_fits()
            else "not reached this round: the jobs ahead of it in the queue took what was free"
        )
        return snap.round

    def _ordered(self, state: State, now: float) -> Iterator[tuple[Job, int]]:
        """Pending jobs with their level now, in order: the queue's, with the jobs promoted since they were
        queued moved up among those of level 0."""
        promoted = []
        for job_id in state.ran_before:
            job = state.queue.jobs[job_id]
            if (key := self.key(job))[1] == 1 and self.levels.level(job, now) == 0:
                promoted.append(((key[0], 0, *key[2:], job_id), job))
        queued = state.queue.entries()
        if promoted:
            moved = {job.id for _, job in promoted}
            queued = heapq.merge((e for e in queued if e[1].id not in moved), sorted(promoted), key=lambda e: e[0])
        return ((job, entry[1]) for entry, job in queued)

    def _reclaimers(self, snap: Snapshot, blocked: set[str]) -> list[tuple[Job, int]]:
        """The first pending job of each tenant it would keep within its quota, wherever it stands in the queue
        (at most ``plans_per_round``, in the queue's order): as Kueue considers each queue's head every cycle,
        a tenant asking for its quota back never waits behind the whole queue's blocked jobs for a reclaim."""
        heads = []
        for tenant in snap.state.tenants:
            job = next(snap.state.queue.of(tenant), None)
            if job is None or job.id in blocked or job.id in snap.admitted:
                continue
            if snap.held[tenant] + job.gpus <= snap.nominal(tenant):
                heads.append((self.key(job), job))
        heads.sort(key=lambda head: (head[0], head[1].id))
        return [(job, self.levels.level(job, snap.now)) for _, job in heads[: self.plans_per_round]]

    def _preempt(self, snap: Snapshot, blocked: list[tuple[Job, int]]) -> None:
        """Plan room for the first blocked jobs, each from the cheapest runs it may take. The cheapest
        ``victims_read`` runs are read once a round, with their level."""
        state, now = snap.state, snap.now
        spent = self.cost.gpu_s(state.evicted_gpus, state.evicted_gpus_sq)
        allowed = self.budget * state.gpu_s_given(now)
        runs = (run for run in state.cheapest(now, self.cost.restart_s) if run.id not in snap.leaving)
        pool = list(itertools.islice(runs, self.victims_read if blocked else 0))
        levels: dict[str, int] = {}  # read lazily: replaying a run's history is the costly part

        def level_of(run: Run) -> int:
            if (level := levels.get(run.job.id)) is None:
                level = levels[run.job.id] = self.levels.level(run.job, now, run.started)
            return level

        # what each run's rules read, once a round: its tenant, priority, and whether it holds borrowed GPUs
        facts = [(run.job.id, run, run.job.tenant, run.job.priority) for run in pool]
        lent_ids = {run_id for run_id, run, tenant, _ in facts if run_id in state.borrowed(tenant)}
        lowest = min((priority for *_, priority in facts), default=0)
        served: list[list[tuple]] = []  # [the runs of level 1], found once a round, when a job needs them

        def rules_for(job: Job, level: int, reclaiming: bool) -> dict[str, str]:
            """The runs ``job`` may take, each with the first rule that allows it. A job that can neither
            reclaim nor outrank any run may only take a long run (least service): only those are read."""
            if not reclaiming and job.priority <= lowest:
                if level == 1:
                    return {}
                if not served:
                    served.append([fact for fact in facts if level_of(fact[1])])
                read = served[0]
            else:
                read = facts
            rules, skip = {}, snap.leaving | job.preempted_by
            for run_id, run, tenant, priority in read:
                if run_id in skip:
                    continue
                own = tenant == job.tenant
                lent = not own and run_id in lent_ids
                if reclaiming and lent and level <= level_of(run):
                    rules[run_id] = "reclaim"
                elif (own or lent) and job.priority > priority:
                    rules[run_id] = "priority"
                elif level == 0 and (not own or job.priority >= priority) and level_of(run):
                    rules[run_id] = "least service"
            return rules

        plans = 0
        for job, level in blocked:
            if plans >= self.plans_per_round:
                break
            reclaiming = snap.held[job.tenant] + job.gpus <= snap.nominal(job.tenant)
            rules = rules_for(job, level, reclaiming)
            victims = snap.victims(job, [run for run in pool if run.id in rules]) if rules else None
            if not victims:
                continue
            gpus = [run.job.gpus for run in victims]
            cost = self.cost.gpu_s(sum(gpus), sum(g * g for g in gpus))
            heuristic = any(rules[run.id] == "least service" for run in victims)  # the others are owed
            if heuristic and spent + cost > allowed:
                snap.wait(job, "placement", f"no room for {_shape(job, snap.cluster)}; the preemption budget is spent")
                continue
            spent += cost
            plans += 1
            snap.preempt(victims, job, lambda run, job=job, rules=rules: self._why(snap, job, run, rules[run.id]))
            names = ", ".join(run.id for run in victims)
            snap.wait(job, "preempting", f"making room: asked {names} to checkpoint and leave", victims[0].id)

    def _why(self, snap: Snapshot, job: Job, run: Run, rule: str) -> str:
        victim, now = run.job, snap.now
        if rule == "reclaim":
            t = snap.state.tenants[victim.tenant]
            return (
                f"reclaim: tenant {job.tenant} needs its quota back for {job.id}; tenant {t.name} is borrowing "
                f"({snap.held[t.name]} of its {snap.cluster.of(t.nominal_gpus)} held)"
            )
        if rule == "priority":
            return f"priority: {job.id} (priority {job.priority}) outranks it ({victim.priority})"
        served = victim.gpus * (now - run.started + self.levels.executed_s(victim, run.started))
        unit_s = f"{snap.cluster.unit.removesuffix('s')}-seconds"
        return (
            f"least service: {job.id} has run less than {self.threshold_gpu_s:,.0f} {unit_s}; this one "
            f"{served:,.0f} since its last reset (predicted {victim.predicted_s:,.0f} s in all)"
        )


def _shape(job: Job, cluster: Cluster) -> str:
    return f"{job.workers} x {cluster.of(job.per_worker)}" if job.workers > 1 else cluster.of(job.gpus)
