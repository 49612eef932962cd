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

On a fleet of several GPU types (docs/scheduling.md), each gang goes on one type: the fastest with room for
its kind by the speed table (speeds.py), a slower one only after a bounded wait for a faster one (ski
rental), and a run on a slower type moves up when faster GPUs are left free and what is left of it gains
several times the move's cost (a preemption for itself, within the budget). Shares of a GPU are placed where
they fragment the fleet least (sharing.py) and kept apart from gangs: they neither preempt nor are preempted.

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
    speed_aware: bool = True  # choose GPU types by the speed table; False: the best fit, as if types were alike
    wait_for_speed: float = 0.1  # a job waits for a faster type up to this share of what the slower costs it
    move_gain: float = 4.0  # a run moves to a faster free type when that saves it this many times the move's cost

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
            if why is None and (placement := snap.place(job, self._types(snap, job))) is not None:
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
            elif (placement := snap.place(job, types := self._types(snap, job))) is not None:
                snap.admit(job, placement, borrowing)
                continue
            else:
                snap.wait(job, "placement", self._no_room(snap, job, types))
            if len(blocked) < 2 * self.plans_per_round and not job.shares:  # a share preempts nothing
                blocked.append((job, level))
        blocked += self._reclaimers(snap, {job.id for job, _ in blocked})
        spent = self._preempt(snap, [(job, level) for job, level in blocked if job.id not in making_room])
        self._move_up(snap, spent)
        snap.round.otherwise = (
            f"no room: {snap.cluster.free_gpus} of {snap.cluster.of(snap.cluster.total_gpus)} free"
            if snap.nothing_fits()
            else "not reached this round: the jobs ahead of it in the queue took what was free"
        )
        return snap.round

    def _types(self, snap: Snapshot, job: Job) -> list[str] | None:
        """The GPU types ``job`` takes now, in order: those it prefers, then the fastest first by the speed
        table. A type slower than its fastest only once it has waited ``wait_for_speed`` of what that type
        would cost it (ski rental: its predicted duration x (the fastest's speed / that type's - 1)); a type
        too small for the gang even when all free is no type to wait for, and comes last (a gang that may mix
        types spans it). None when types are ignored: the best fit of any."""
        if not self.speed_aware:
            return None
        allowed = snap.types_of(job)
        holding = [t for t in allowed if snap.cluster.could_hold(t, job.workers, job.per_worker)]
        too_small = [t for t in allowed if t not in holding]
        if len(holding) < 2:
            return holding + too_small
        speed = snap.state.speeds.relative(job.kind, holding)
        waited = max(0.0, snap.now - (job.queued_at if job.queued_at is not None else job.submitted))
        slower_costs = job.predicted_s * self.wait_for_speed
        floor = slower_costs / (slower_costs + waited) if slower_costs > 0 else 0.0
        ranked = sorted(holding, key=lambda t: (t not in job.prefer, 0.0 if t in job.prefer else -speed[t]))
        return [t for t in ranked if t in job.prefer or speed[t] >= floor] + too_small  # preferred: types_of's order

    def _no_room(self, snap: Snapshot, job: Job, types: list[str] | None) -> str:
        shape = _shape(job, snap.cluster)
        if not snap.types_of(job):
            return f"the cluster has none of its GPU types: {', '.join(job.gpu_types)}"
        if types is None or not (slower := [t for t in snap.types_of(job) if t not in types]):
            return f"no room for {shape}"
        speed = snap.state.speeds.relative(job.kind, snap.types_of(job))
        waits = ", ".join(f"{t} ({speed[t]:.0%} of its speed)" for t in slower)
        return f"no room for {shape} on {', '.join(types)}; it waits before taking a slower type: {waits}"

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
            if job is None or job.id in blocked or job.id in snap.admitted or job.shares:
                continue
            if snap.held[tenant] + job.gpus <= snap.nominal(tenant):
                heads.append((self.key(job), job))
        heads.sort(key=lambda head: (head[0], head[1].id))
        return [(job, self.levels.level(job, snap.now)) for _, job in heads[: self.plans_per_round]]

    def _preempt(self, snap: Snapshot, blocked: list[tuple[Job, int]]) -> float:
        """Plan room for the first blocked jobs, each from the cheapest runs it may take. The cheapest
        ``victims_read`` runs are read once a round, with their level. Returns the GPU-seconds that every
        preemption so far, these included, costs by the cost model."""
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
            if not rules:
                continue
            types = self._types(snap, job)  # read once: the victims and the reason use the same
            victims = snap.victims(job, [run for run in pool if run.id in rules], types)
            if not victims:
                continue
            gpus = [run.job.gpus for run in victims]
            cost = self.cost.gpu_s(sum(gpus), sum(g * g for g in gpus))
            heuristic = any(rules[run.id] == "least service" for run in victims)  # the others are owed
            if heuristic and spent + cost > allowed:
                snap.wait(job, "placement", f"{self._no_room(snap, job, types)}; the preemption budget is spent")
                continue
            spent += cost
            plans += 1
            snap.preempt(victims, job, lambda run, job=job, rules=rules: self._why(snap, job, run, rules[run.id]))
            names = ", ".join(run.id for run in victims)
            snap.wait(job, "preempting", f"making room: asked {names} to checkpoint and leave", victims[0].id)
        return spent

    def _move_up(self, snap: Snapshot, spent: float) -> None:
        """GPUs of a faster type left free once the queue has had its turn: runs on a slower type that may use
        them move there (checkpoint, leave, and take them first: ``State.requeue``), those that gain the most
        first, when the time saved on what is left of them (expected: what the tenant's history predicts, or
        as long again as they have run, whichever is more) is ``move_gain`` times the move's commit and restart.
        A move is a preemption: the budget bounds it."""
        cluster, state, now, speeds = snap.cluster, snap.state, snap.now, snap.state.speeds
        if not self.speed_aware or len(cluster.typed) < 2:
            return
        free = {t: sum(k * len(names) for k, names in index.items()) for t, index in cluster.by_free.items()}
        up = {t for t in free if free[t]}  # types with room: the runs read are those on a type slower than one
        slower = [
            h
            for h, runs in state.runs_on.items()
            if runs and "+" not in h and any(speeds.log_ratio(t, h) > 0 for t in up)
        ]
        allowed = self.budget * state.gpu_s_given(now)
        moves = []
        for here, run in ((h, state.running[r]) for h in slower for r in state.runs_on[h]):
            job = run.job
            if run.id in snap.leaving or job.mix_types or job.shares:
                continue
            faster = [t for t in snap.types_of(job) if free[t] >= job.gpus and t != here]
            if not faster:
                continue
            speed = speeds.relative(job.kind, [here, *faster])
            best = max(faster, key=lambda t: speed[t])
            if speed[best] <= speed[here]:
                continue
            ran = sum(b - a for a, b in job.ran) + now - run.started
            saved = max(job.predicted_s - ran, ran) * (1 - speed[here] / speed[best])
            cost_s = self.cost.commit(job.gpus) + self.cost.restart_s
            if saved >= self.move_gain * cost_s:
                moves.append((-saved * job.gpus, run.id, run, here, best, speed[best] / speed[here]))
        for *_, run, here, best, gain in sorted(moves, key=lambda m: m[:2]):
            job = run.job
            cost = self.cost.gpu_s(job.gpus, job.gpus**2)
            if spent + cost > allowed:
                break
            where = snap.place(job, [best])
            if where is None:
                continue
            cluster.allocate(where.gpus)  # held for it this round; it takes them first once it has left
            spent += cost
            why = f"faster GPUs: {best} is free and runs it {gain:.1f}x as fast as {here}; it moves there"
            snap.preempt([run], job, lambda _run, why=why: why)

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
    if job.shares:
        return f"{job.gpu_milli / 1000:g} of a shared {cluster.unit.removesuffix('s')}"
    return f"{job.workers} x {cluster.of(job.per_worker)}" if job.workers > 1 else cluster.of(job.gpus)


@dataclass(frozen=True)
class TypesIgnored(PredictiveLas):
    """phalanx's policy with GPU types ignored (each gang still on one type): the baseline that shows what
    the speed table is worth."""

    name: ClassVar[str] = "phalanx-types-ignored"
    speed_aware: bool = False
