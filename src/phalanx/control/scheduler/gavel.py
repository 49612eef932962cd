"""Gavel-like: the heterogeneity-aware baseline for a fleet of several GPU types (Narayanan et al., OSDI'20,
its policy MaxMinFairness_Perf and its round-based mechanism, as stanford-futuredata/gavel runs them).

Every ``round_s`` (Gavel's six minutes) it solves Gavel's linear program over the active jobs (running and
pending): the time shares ``x[j, t]`` of each job on each type that maximise the least normalised throughput,
sum over t of x[j, t] rate[j, t] / sum over t of rate[j, t] (a job's rate with an equal share of every type:
the normalisation of Gavel's code for its packing variant, and one that has a single value, where a solver's
vertex of the heterogeneity-agnostic allocation would not), weighted by the job's GPUs as Gavel weights it;
each job's shares sum to at most 1, and each type's GPUs are not overcommitted.
Then the mechanism: each (job, type) has the priority x[j, t] / the share of its time since submit it has run
on t; in priority order, a job takes the next round on a type while that type has GPUs left. A pending job
chosen starts when its gang fits; a running job given another type moves there (it checkpoints, leaves and
takes the room first); a running job not chosen, or given another type, is preempted when a chosen job needs
its GPUs (checkpoint on SIGTERM, as every policy here preempts). The rates are the speed
table's (learned from runs: what phalanx's policy knows too); Gavel's policy has no quotas, so none here.
Needs scipy (HiGHS), the ``sim`` extra."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from phalanx.control.scheduler.jobs import Job, Round, Run
from phalanx.control.scheduler.snapshot import Snapshot
from phalanx.control.scheduler.state import State


@dataclass
class GavelLike:
    name: ClassVar[str] = "gavel-like"
    round_s: float = 360.0
    chosen: dict[str, str] = field(default_factory=dict)  # job -> the type it has this round
    priority: dict[str, float] = field(default_factory=dict)  # job -> its priority on that type this round
    received: dict[tuple[str, str], float] = field(default_factory=dict)  # (job, type) -> seconds run there
    next_round: float = -math.inf
    accounted_to: float = -math.inf

    def key(self, job: Job) -> tuple:
        return (job.submitted,)

    def schedule(self, state: State, now: float) -> Round:
        self._account(state, now)
        snap = Snapshot(state, now)
        if now >= self.next_round:
            self.next_round = now + self.round_s
            self._choose(snap)
        moving = [run.job for run in state.running.values() if run.id not in state.leaving and self._moves(snap, run)]
        wanted = sorted([*state.queue, *moving], key=lambda job: (-self.priority.get(job.id, -1.0), job.submitted))
        unchosen = [run for run in state.running.values() if self.chosen.get(run.id) != _type(snap, run)]
        unchosen.sort(key=lambda run: (self.priority.get(run.id, -1.0), -run.started, run.id))  # the victims' order
        for job in wanted:
            gpu_type, run = self.chosen.get(job.id), state.running.get(job.id)
            if gpu_type is None:
                snap.wait(job, "behind", "not given a share of the next round by the max-min allocation")
                continue
            if run is None and (placement := snap.place(job, [gpu_type])) is not None:
                snap.admit(job, placement, borrowing=False)
                continue
            if run is None:
                snap.wait(job, "placement", f"given {gpu_type} this round: waiting for its GPUs")
            if run is not None and run.id in snap.leaving:
                continue  # made to leave for another job this round
            ours = [r for r in unchosen if r.id != job.id and _type(snap, r) == gpu_type and r.id not in snap.leaving]
            fits = run is not None and snap.place(job, [gpu_type]) is not None
            victims = [] if fits else snap.victims(job, ours, [gpu_type])
            why = f"round-based max-min: {job.id} has {gpu_type} this round"
            if victims:
                snap.preempt(victims, job, lambda _, why=why: why)
            if run is not None and (fits or victims):
                snap.preempt([run], job, lambda _, why=why: why)  # it moves: it takes the room first (State.first)
        return snap.round

    def _moves(self, snap: Snapshot, run: Run) -> bool:
        """A running job given another type this round."""
        gpu_type = self.chosen.get(run.id)
        return gpu_type is not None and gpu_type != _type(snap, run)

    def _account(self, state: State, now: float) -> None:
        """Each running job's time on its type since the last call."""
        for run in state.running.values():
            key = (run.id, state.cluster.type_of(run.placement))
            self.received[key] = self.received.get(key, 0.0) + now - max(run.started, self.accounted_to)
        self.accounted_to = now

    def _choose(self, snap: Snapshot) -> None:
        """The next round's jobs and their types: Gavel's allocation, then its priorities, greedily."""
        state, cluster = snap.state, snap.cluster
        types = list(cluster.types)
        capacity = {t: sum(cluster.nodes[n].gpus for n in cluster.typed[t]) for t in types}
        jobs = [run.job for run in state.running.values() if run.id not in state.leaving] + list(state.queue)
        rates = [
            [
                state.speeds.rate(job.kind, t)
                if t in snap.types_of(job) and cluster.could_hold(t, job.workers, job.per_worker)
                else 0.0
                for t in types
            ]
            for job in jobs
        ]
        keep = [i for i, row in enumerate(rates) if any(row)]
        jobs, rates = [jobs[i] for i in keep], [rates[i] for i in keep]
        self.chosen, self.priority = {}, {}
        if not jobs:
            return
        normalised = [[r / sum(row) for r in row] for row in rates]
        shares = _max_min(normalised, [job.gpu_use for job in jobs], [capacity[t] for t in types])
        ranked = []
        for job, row in zip(jobs, shares, strict=True):
            elapsed = max(snap.now - job.submitted, 1e-9)
            for t, x in zip(types, row, strict=True):
                if x > 1e-6:
                    had = self.received.get((job.id, t), 0.0) / elapsed
                    ranked.append((x / had if had > 0 else math.inf, x, job, t))
        ranked.sort(key=lambda item: (-item[0], -item[1], item[2].submitted, item[2].id))
        left = dict(capacity)
        for priority, _, job, t in ranked:
            if job.id not in self.chosen and left[t] >= job.gpu_use:
                left[t] -= job.gpu_use
                self.chosen[job.id], self.priority[job.id] = t, priority


def _type(snap: Snapshot, run: Run) -> str:
    return snap.cluster.type_of(run.placement)


def _max_min(coef: list[list[float]], scale: list[float], capacity: list[float]) -> list[list[float]]:
    """Gavel's LP: the time shares x[j][t] >= 0 that maximise min over j of scale[j] sum_t coef[j][t] x[j][t],
    with each job's shares summing to at most 1 and each type's GPUs, sum_j scale[j] x[j][t], at most its
    capacity; x[j][t] is 0 where coef[j][t] is 0 (the job cannot run there)."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    m, n = len(coef), len(capacity)
    c = np.asarray(coef, dtype=float) * np.asarray(scale, dtype=float)[:, None]
    rows, cols, vals = [], [], []
    for j in range(m):
        for t in range(n):
            if c[j, t] > 0:
                var = j * n + t
                rows += [j, m + j, 2 * m + t]  # the job's throughput, its shares' sum, the type's GPUs
                cols += [var, var, var]
                vals += [-c[j, t], 1.0, scale[j]]
        rows.append(j)
        cols.append(m * n)  # z <= the job's throughput
        vals.append(1.0)
    a_ub = coo_matrix((vals, (rows, cols)), shape=(2 * m + n, m * n + 1)).tocsr()
    b_ub = np.concatenate([np.zeros(m), np.ones(m), np.asarray(capacity, dtype=float)])
    bounds = [(0.0, 1.0 if c[j, t] > 0 else 0.0) for j in range(m) for t in range(n)] + [(0.0, None)]
    objective = np.zeros(m * n + 1)
    objective[-1] = -1.0
    solved = linprog(objective, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if solved.status != 0:
        raise RuntimeError(f"the max-min allocation found no solution: {solved.message}")
    return np.clip(solved.x[:-1], 0.0, 1.0).reshape(m, n).tolist()
