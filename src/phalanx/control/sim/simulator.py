"""An event-driven replay of a trace through a policy. The policy is the scheduling core, untouched: the
simulator plays the caller (the control plane's part), applying each round's decisions to the State and
modelling what the decisions cost:

- a job's work is its trace duration on its GPUs; it checkpoints every ``checkpoint_every_s`` of progress;
- a job killed (a baseline's preemption) loses its work since its last checkpoint, and every restart costs
  ``restart_s`` before work resumes;
- a victim asked to checkpoint first (phalanx) snapshots at once and leaves when the save commits,
  ``commit_s`` later; it loses those ``commit_s`` and the restart.
GPU-time lost to preemption is every GPU-second held that saved no work: so the GPU-time used is exactly the
jobs' work plus what was lost.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.control.scheduler.cluster import Cluster, Node
from phalanx.control.scheduler.jobs import Job, Tenant
from phalanx.control.scheduler.predict import DurationPredictor
from phalanx.control.scheduler.state import Policy, Queue, State
from phalanx.control.sim.trace import TraceJob


@dataclass(frozen=True)
class Costs:
    checkpoint_every_s: float = 1800.0
    restart_s: float = 60.0
    commit_s: float = 30.0


@dataclass
class JobRecord:
    id: str
    tenant: str
    gpus: int
    submit: float
    duration: float
    first_start: float | None = None
    finish: float | None = None
    preemptions: int = 0
    lost_gpu_s: float = 0.0

    @property
    def jct(self) -> float:
        assert self.finish is not None
        return self.finish - self.submit


@dataclass
class Outcome:
    policy: str
    gpus: int
    records: dict[str, JobRecord]
    used_gpu_s: float = 0.0  # GPU-seconds allocated, in all
    busy_gpu_s: float = 0.0  # ... while the queue was not empty
    busy_capacity_gpu_s: float = 0.0  # the cluster's GPU-seconds while the queue was not empty
    wall_s: float = 0.0  # how long the replay took

    @property
    def lost_gpu_s(self) -> float:
        return sum(r.lost_gpu_s for r in self.records.values())


_ARRIVE, _FINISH, _EVICT, _CHECKPOINT = 0, 1, 2, 3


def gang(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """A job of ``gpus`` GPUs as workers x GPUs each: one worker if it fits on a node, else the fewest
    equal workers that each fit on one."""
    per_worker = max(d for d in range(1, min(gpus, gpus_per_node) + 1) if gpus % d == 0)
    return gpus // per_worker, per_worker


def simulate(
    policy: Policy,
    jobs: Sequence[TraceJob],
    cluster: Cluster,
    tenants: Sequence[Tenant],
    costs: Costs = Costs(),
    seed: int = 0,
    jitter_s: float = 60.0,
) -> Outcome:
    """Replay ``jobs`` until the last one finishes. ``seed`` draws each job's checkpoint phase and a jitter
    of up to ``jitter_s`` on its submit time."""
    began_replay = time.perf_counter()
    rng = random.Random(seed)
    state = State(cluster, tenants, Queue(policy.key))
    predictor = DurationPredictor()
    outcome = Outcome(policy.name, cluster.total_gpus, {})
    events: list[tuple[float, int, int, str, int]] = []  # (time, kind, seq, job, epoch)
    seq = 0

    def push(t: float, kind: int, job_id: str, epoch: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, kind, seq, job_id, epoch))

    work: dict[str, float] = {}  # job -> work (s) still to do after its last checkpoint
    phase: dict[str, float] = {}
    run: dict[str, tuple[float, float, int]] = {}  # running job -> (work starts, work left then, epoch)
    for trace_job in jobs:
        submit = max(0.0, trace_job.submit_s + rng.uniform(-jitter_s, jitter_s))
        outcome.records[trace_job.id] = JobRecord(trace_job.id, trace_job.tenant, trace_job.gpus, submit,
                                                  trace_job.duration_s)  # fmt: skip
        work[trace_job.id] = trace_job.duration_s
        phase[trace_job.id] = rng.uniform(0, costs.checkpoint_every_s)
        push(submit, _ARRIVE, trace_job.id)
    epochs = dict.fromkeys(work, 0)
    snapshot: dict[str, float] = {}  # victim -> its work left at the checkpoint it was asked for
    trace_jobs = {job.id: job for job in jobs}
    remaining, last_t = len(jobs), 0.0

    def done_since_start(job_id: str, t: float) -> float:
        starts, left, _ = run[job_id]
        return min(left, max(0.0, t - starts))

    def evict(job_id: str, t: float, left: float) -> None:
        """The job leaves with ``left`` work to do: the GPU time of this run that saved no work is lost."""
        record = outcome.records[job_id]
        record.preemptions += 1
        starts, left_at_start, _ = run[job_id]
        allocated = starts - (costs.restart_s if record.preemptions > 1 else 0.0)
        record.lost_gpu_s += record.gpus * ((t - allocated) - (left_at_start - left))
        work[job_id] = left
        del run[job_id]
        epochs[job_id] += 1
        state.requeue(job_id, t)

    while remaining:
        t = events[0][0]
        held = sum(state.held.values())
        outcome.used_gpu_s += held * (t - last_t)
        if len(state.queue):
            outcome.busy_gpu_s += held * (t - last_t)
            outcome.busy_capacity_gpu_s += outcome.gpus * (t - last_t)
        last_t, changed = t, False
        while events and events[0][0] == t:
            _, kind, _, job_id, epoch = heapq.heappop(events)
            if kind == _ARRIVE:
                tj = trace_jobs[job_id]
                workers, per_worker = gang(tj.gpus, cluster.largest)
                predicted = predictor.predict(tj.tenant, tj.gpus)
                submitted = outcome.records[job_id].submit
                state.submit(Job(job_id, tj.tenant, workers, per_worker, submitted, predicted_s=predicted))
                changed = True
            elif epoch != epochs[job_id]:
                continue  # the run this event was for has ended
            elif kind == _FINISH:
                state.stop(job_id, t)
                del run[job_id]
                epochs[job_id] += 1
                record = outcome.records[job_id]
                record.finish, remaining, changed = t, remaining - 1, True
                record.lost_gpu_s += record.gpus * (costs.restart_s if record.preemptions else 0.0)
                predictor.record(record.tenant, record.gpus, record.duration)
            elif kind == _CHECKPOINT:
                work[job_id] = run[job_id][1] - done_since_start(job_id, t)
                state.checkpointed(job_id, t)
                push(t + costs.checkpoint_every_s, _CHECKPOINT, job_id, epoch)
            elif kind == _EVICT:
                evict(job_id, t, snapshot.pop(job_id))
                changed = True
        for _ in range(100) if changed else ():  # until a round changes nothing that frees GPUs at once
            decided = policy.schedule(state, t)
            for admit in decided.admit:
                state.start(admit.job, admit.placement, t)
                record = outcome.records[admit.job]
                record.first_start = t if record.first_start is None else record.first_start
                starts = t + (costs.restart_s if record.preemptions else 0.0)
                epoch = epochs[admit.job]
                run[admit.job] = (starts, work[admit.job], epoch)
                push(starts + work[admit.job], _FINISH, admit.job, epoch)
                first = starts + phase[admit.job] % costs.checkpoint_every_s
                push(first, _CHECKPOINT, admit.job, epoch)
            killed = False
            for preempt in decided.preempt:
                state.ask_to_evict(preempt.job, preempt.for_job)
                left = run[preempt.job][1] - done_since_start(preempt.job, t)
                if preempt.checkpoint_first:
                    snapshot[preempt.job] = left
                    push(t + costs.commit_s, _EVICT, preempt.job, epochs[preempt.job])
                else:
                    evict(preempt.job, t, work[preempt.job])
                    killed = True
            if not killed:
                break
    outcome.wall_s = time.perf_counter() - began_replay
    return outcome


def alone_cluster(gpus: int, gpus_per_node: int, nodes_per_rack: int) -> Cluster:
    """A tenant's quota as a cluster of its own: whole nodes, and one partial node for the remainder."""
    sizes = [gpus_per_node] * (gpus // gpus_per_node) + ([gpus % gpus_per_node] if gpus % gpus_per_node else [])
    return Cluster(Node(f"n{i:03d}", f"r{i // nodes_per_rack:02d}", g) for i, g in enumerate(sizes))
