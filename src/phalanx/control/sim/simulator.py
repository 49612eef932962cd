"""An event-driven replay of a trace through a policy. The policy is the scheduling core, untouched: the
simulator plays the caller (the control plane's part), applying each round's decisions to the State and
modelling what the decisions cost:

- a job's work is its trace duration on its GPUs; on a fleet of several GPU types, on the type the trace ran
  on, and elsewhere it runs at its kind's true rate there (``TrueSpeeds``: the replay knows it, the policy
  learns it from the runs); it checkpoints every ``checkpoint_every_s`` of progress;
- a victim (every policy's: the runtime checkpoints on SIGTERM) snapshots at once and leaves when the save
  commits (``ReplayCosts.commit``: longer for a bigger job's checkpoint); it loses that time, and every restart
  costs ``restart_s`` before work resumes.
The decisions reach the State through ``apply``, as the server's do: the replay is the actuator.
GPU-time lost to preemption is every GPU-second held that saved no work: so the GPU-time used is exactly the
jobs' work plus what was lost.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.control.scheduler.actuate import apply
from phalanx.control.scheduler.budgets import enforce as enforce_budgets
from phalanx.control.scheduler.cluster import Cluster, Node
from phalanx.control.scheduler.costs import PreemptionCost
from phalanx.control.scheduler.jobs import Admit, Job, Preempt, Tenant
from phalanx.control.scheduler.predict import DurationPredictor
from phalanx.control.scheduler.state import Policy, Queue, State
from phalanx.control.sim.trace import TraceJob


@dataclass(frozen=True)
class ReplayCosts(PreemptionCost):
    """What the replayed jobs pay: the scheduler's own cost model of a preemption, and a checkpoint every
    ``checkpoint_every_s`` of progress (the work a victim keeps)."""

    checkpoint_every_s: float = 1800.0

    @property
    def preemption(self) -> PreemptionCost:
        """The cost model alone: what a policy that budgets its preemptions is told."""
        return PreemptionCost(self.restart_s, self.commit_s, self.commit_s_per_gpu)


@dataclass
class JobRecord:
    id: str
    tenant: str
    gpus: int
    submit: float
    duration: float
    finish: float | None = None
    waited_s: float = 0.0  # every wait: before its first start, and after each preemption until it runs again
    preemptions: int = 0
    lost_gpu_s: float = 0.0
    gpu_s_by_type: dict[str, float] = field(default_factory=dict)  # GPU-seconds held on each GPU type
    dollars: float = 0.0  # what its runs cost, at each type's on-demand price
    held: bool = False  # never finished: its tenant's budget was spent (``finish`` stays None)

    @property
    def jct(self) -> float:
        assert self.finish is not None
        return self.finish - self.submit


@dataclass
class Replayed:
    """What one replay of a trace under one policy did: each job's record, the cluster's use, every decision."""

    policy: str
    gpus: int
    records: dict[str, JobRecord]
    used_gpu_s: float = 0.0  # GPU-seconds allocated, in all
    busy_gpu_s: float = 0.0  # ... while the queue was not empty
    busy_capacity_gpu_s: float = 0.0  # the cluster's GPU-seconds while the queue was not empty
    wall_s: float = 0.0  # how long the replay took
    # every decision carried out, in order: (time, "admit", job, placement) or (time, "preempt", victim, for job)
    decisions: list[tuple[float, str, str, Any]] = field(default_factory=list)

    @property
    def lost_gpu_s(self) -> float:
        return sum(r.lost_gpu_s for r in self.records.values())


_ARRIVE, _FINISH, _EVICT, _CHECKPOINT = 0, 1, 2, 3


@dataclass(frozen=True)
class TrueSpeeds:
    """How fast each kind of job really runs on each GPU type (a rate per (kind, type), any unit per kind: 0
    where it cannot run), and the type the trace's durations were measured on."""

    rates: Mapping[tuple[str, str], float]
    reference: str

    def speed(self, kind: str, gpu_type: str) -> float:
        """Its pace on ``gpu_type`` (a mixed gang: "a+b", the slowest) over its pace on the reference."""
        return min(self.rates[kind, t] for t in gpu_type.split("+")) / self.rates[kind, self.reference]


def split_gpus(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """A trace's job of ``gpus`` GPUs as a gang of workers x GPUs each: one worker if it fits on a node, else the fewest
    equal workers that each fit on one."""
    per_worker = max(d for d in range(1, min(gpus, gpus_per_node) + 1) if gpus % d == 0)
    return gpus // per_worker, per_worker


@dataclass(frozen=True)
class Arrival:
    """A trace job as replayed: its submit time with the seed's jitter, and where in its checkpoint interval
    its first checkpoint falls."""

    job: TraceJob
    submit: float
    phase_s: float


def arrivals(jobs: Sequence[TraceJob], costs: ReplayCosts, seed: int, jitter_s: float) -> list[Arrival]:
    rng = random.Random(seed)
    out = []
    for job in jobs:
        submit = max(0.0, job.submit_s + rng.uniform(-jitter_s, jitter_s))
        out.append(Arrival(job, submit, rng.uniform(0, costs.checkpoint_every_s)))
    return out


@dataclass(frozen=True)
class ModelledRun:
    """One run of a trace job as the replay models it (the simulator, and the executor that plays a trace
    against the server): allocated at ``started``, its work resumes a restart later if it ran before, it
    checkpoints every ``checkpoint_every_s`` from its phase, and it ends when its work is done."""

    started: float
    starts: float  # when work begins
    left_s: float  # work to do then, in seconds on the reference GPU type
    speed: float = 1.0  # work done per second here

    @classmethod
    def begin(cls, now: float, left_s: float, ran_before: bool, costs: ReplayCosts, speed: float = 1.0) -> ModelledRun:
        return cls(now, now + (costs.restart_s if ran_before else 0.0), left_s, speed)

    @property
    def finish(self) -> float:
        return self.starts + self.left_s / self.speed

    def left_at(self, t: float) -> float:
        return self.left_s - min(self.left_s, max(0.0, t - self.starts) * self.speed)

    def first_checkpoint(self, phase_s: float, costs: ReplayCosts) -> float:
        return self.starts + phase_s % costs.checkpoint_every_s


class _Replay:
    """The simulator's side of the scheduling core: events in time order, and the actuator that models what
    each decision costs."""

    def __init__(self, policy: Policy, arrived: Sequence[Arrival], cluster: Cluster, tenants: Sequence[Tenant],
                 costs: ReplayCosts, truth: TrueSpeeds | None):  # fmt: skip
        self.policy, self.costs, self.cluster, self.truth = policy, costs, cluster, truth
        self.state = State(cluster, tenants, Queue(policy.key))
        self.predictor = DurationPredictor()
        self.outcome = Replayed(policy.name, cluster.total_gpus, {})
        self.events: list[tuple[float, int, int, str, int]] = []  # (time, kind, seq, job, epoch)
        self.seq = 0
        self.arrivals = {a.job.id: a for a in arrived}
        self.work = {a.job.id: a.job.duration_s for a in arrived}  # work (s) still to do after its last checkpoint
        self.epochs = dict.fromkeys(self.work, 0)
        self.runs: dict[str, ModelledRun] = {}
        self.on_type: dict[str, str] = {}  # running job -> the GPU type of its placement
        self.dollars_per_h: dict[str, float] = {}  # running job -> what its placement costs an hour
        self.held_s = dict.fromkeys(self.work, 0.0)  # GPU-holding time over the job's runs
        self.started_seq: dict[str, int] = {}  # running job -> its place in the order the runs started
        self.snapshot: dict[str, float] = {}  # victim -> its work left at the checkpoint it was asked for
        for a in arrived:
            self.outcome.records[a.job.id] = JobRecord(a.job.id, a.job.tenant, a.job.gpus, a.submit, a.job.duration_s)
            self.push(a.submit, _ARRIVE, a.job.id)

    def push(self, t: float, kind: int, job_id: str, epoch: int = 0, seq: int | None = None) -> int:
        """Events of one moment: arrivals, finishes, evictions, then checkpoints, each kind in the order it was
        pushed, or for evictions in the order the runs started (``seq``), as the server applies them."""
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq if seq is None else seq, job_id, epoch))
        return self.seq

    # the actuator
    def admit(self, admit: Admit, now: float) -> bool:
        self.outcome.decisions.append((now, "admit", admit.job, admit.placement))
        record = self.outcome.records[admit.job]
        record.waited_s += now - self.state.queue.jobs[admit.job].queued_at  # still queued: apply starts it next
        gpu_type = self.on_type[admit.job] = self.cluster.type_of(admit.placement)
        self.dollars_per_h[admit.job] = self.cluster.dollars_per_h(admit.placement)
        kind = self.arrivals[admit.job].job.kind
        speed = self.truth.speed(kind, gpu_type) if self.truth is not None else 1.0
        ran_before = record.preemptions > 0
        run = self.runs[admit.job] = ModelledRun.begin(now, self.work[admit.job], ran_before, self.costs, speed)
        epoch = self.epochs[admit.job]
        self.started_seq[admit.job] = self.push(run.finish, _FINISH, admit.job, epoch)
        self.push(run.first_checkpoint(self.arrivals[admit.job].phase_s, self.costs), _CHECKPOINT, admit.job, epoch)
        return True

    def preempt(self, preempt: Preempt, now: float) -> bool:
        """The victim snapshots at once and leaves when the save commits."""
        self.outcome.decisions.append((now, "preempt", preempt.job, preempt.for_job))
        self.snapshot[preempt.job] = self.runs[preempt.job].left_at(now)
        commits = now + self.costs.commit(self.outcome.records[preempt.job].gpus)
        self.push(commits, _EVICT, preempt.job, self.epochs[preempt.job], self.started_seq[preempt.job])
        return True

    def _leave(self, job_id: str, t: float) -> ModelledRun:
        run = self.runs.pop(job_id)
        self.epochs[job_id] += 1
        self.held_s[job_id] += t - run.started
        record, gpu_type = self.outcome.records[job_id], self.on_type.pop(job_id)
        record.gpu_s_by_type[gpu_type] = record.gpu_s_by_type.get(gpu_type, 0.0) + record.gpus * (t - run.started)
        record.dollars += self.dollars_per_h.pop(job_id) * (t - run.started) / 3600
        self._observe(job_id, gpu_type)
        return run

    def _observe(self, job_id: str, gpu_type: str) -> None:
        """What a run's step metrics teach the speed table: its kind's rate on its type (a gang over several
        types says nothing of each)."""
        if self.truth is not None and "+" not in gpu_type:
            kind = self.arrivals[job_id].job.kind
            self.state.speeds.observe(kind, gpu_type, self.truth.rates[kind, gpu_type])

    def _evict(self, job_id: str, t: float) -> None:
        """The job leaves with its snapshot's work to do: the GPU time of this run that saved no work is lost."""
        record, left = self.outcome.records[job_id], self.snapshot.pop(job_id)
        record.preemptions += 1
        run = self._leave(job_id, t)
        record.lost_gpu_s += record.gpus * ((t - run.started) - (run.left_s - left) / run.speed)
        self.work[job_id] = left
        self.state.requeue(job_id, t)

    def _finish(self, job_id: str, t: float) -> None:
        self.state.stop(job_id, t)
        self._leave(job_id, t)
        record = self.outcome.records[job_id]
        record.finish = t
        record.lost_gpu_s += record.gpus * (self.costs.restart_s if record.preemptions else 0.0)
        self.predictor.record(record.tenant, record.gpus, self.held_s[job_id])

    def run(self) -> Replayed:
        began, state, outcome = time.perf_counter(), self.state, self.outcome
        remaining, last_t = len(self.work), 0.0
        budgeted = any(tenant.budget is not None for tenant in state.tenants.values())
        while remaining:
            if not self.events and remaining == len(state.on_hold):  # the rest wait for budgets: they never run
                for job_id in state.on_hold:
                    outcome.records[job_id].held = True
                break
            if not self.events:
                stuck = sorted(state.queue.jobs)
                example = f"{stuck[0]} ({state.queue.jobs[stuck[0]].gpus} GPUs)"
                raise ValueError(f"{len(stuck)} job(s) can never start on this cluster, such as {example}")
            t = self.events[0][0]
            held = sum(state.held.values())
            outcome.used_gpu_s += held * (t - last_t)
            if len(state.queue):
                outcome.busy_gpu_s += held * (t - last_t)
                outcome.busy_capacity_gpu_s += outcome.gpus * (t - last_t)
            last_t, changed = t, False
            while self.events and self.events[0][0] == t:
                _, kind, _, job_id, epoch = heapq.heappop(self.events)
                if kind == _ARRIVE:
                    tj = self.arrivals[job_id].job
                    workers, per_worker = split_gpus(tj.gpus, self.cluster.largest)
                    predicted = self.predictor.predict(tj.tenant, tj.gpus)
                    submitted = outcome.records[job_id].submit
                    job = Job(job_id, tj.tenant, workers, per_worker, submitted, predicted_s=predicted,
                              queued_at=submitted, kind=tj.kind, gpu_types=tj.gpu_types)  # fmt: skip
                    state.submit(job)
                elif epoch != self.epochs[job_id]:
                    continue  # the run this event was for has ended
                elif kind == _FINISH:
                    self._finish(job_id, t)
                    remaining -= 1
                elif kind == _CHECKPOINT:
                    self.work[job_id] = self.runs[job_id].left_at(t)
                    state.checkpointed(job_id, t)
                    self._observe(job_id, self.on_type[job_id])
                    self.push(t + self.costs.checkpoint_every_s, _CHECKPOINT, job_id, epoch)
                    continue
                elif kind == _EVICT:
                    self._evict(job_id, t)
                changed = True
            if changed:
                if budgeted:
                    enforce_budgets(state, t)
                apply(self.policy.schedule(state, t), state, self, t)
        outcome.wall_s = time.perf_counter() - began
        return outcome


def simulate(
    policy: Policy,
    jobs: Sequence[TraceJob],
    cluster: Cluster,
    tenants: Sequence[Tenant],
    costs: ReplayCosts = ReplayCosts(),
    seed: int = 0,
    jitter_s: float = 60.0,
    truth: TrueSpeeds | None = None,
) -> Replayed:
    """Replay ``jobs`` until the last one finishes. ``seed`` draws each job's checkpoint phase and a jitter
    of up to ``jitter_s`` on its submit time; ``truth``: how fast each kind runs on each GPU type (None: all
    types alike)."""
    return _Replay(policy, arrivals(jobs, costs, seed, jitter_s), cluster, tenants, costs, truth).run()


def alone_cluster(gpus: int, gpus_per_node: int, nodes_per_rack: int) -> Cluster:
    """A tenant's quota as a cluster of its own: whole nodes, and one partial node for the remainder."""
    sizes = [gpus_per_node] * (gpus // gpus_per_node) + ([gpus % gpus_per_node] if gpus % gpus_per_node else [])
    return Cluster(Node(f"n{i:03d}", f"r{i // nodes_per_rack:02d}", g) for i, g in enumerate(sizes))
