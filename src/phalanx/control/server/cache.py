"""The scheduler's State, kept current between rounds (Kueue's cache): the control loop feeds it what happens
(submissions and cancellations from the API, starts, ends, preemptions and committed checkpoints from the
executor) through the same State methods the simulator calls, so a round sees what the simulator's round
would. It is built from the store when the server starts, and again whenever it cannot be trusted: the
cluster's capacity or the tenants changed, a budget month began, or a round failed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from phalanx.control import scheduler as core
from phalanx.control.server import cluster_config, speeds
from phalanx.control.store import ACTIVE, Execution, Job, JobState, Tenant, month_start
from phalanx.control.store.access import spend
from phalanx.obs.events import Event, read_jsonl_from
from phalanx.obs.rundir import RunDir

# What the cache reads of each queued job: plain rows, not ORM objects (a queue can hold many thousands).
_QUEUED = (
    Job.seq, Job.id, Job.tenant, Job.workers, Job.gpus, Job.priority, Job.submitted_at, Job.queued_at,
    Job.preemptions, Job.preempted_by, Job.reason, Job.gpu_types, Job.prefer_gpu_types, Job.mix_gpu_types, Job.kind,
    Job.gpu_milli,
)  # fmt: skip
PREDICTOR_HISTORY = 1000  # finished jobs the predictor is rebuilt from


class Stale(Exception):
    """What the cache was built from has changed in a way it does not follow: rebuild it."""


class Cache:
    def __init__(self, policy: core.Policy):
        self.policy = policy
        self.state: core.State | None = None
        self.nodes: list[core.Node] = []
        self.predictor = core.DurationPredictor()
        self.reasons: dict[str, str] = {}  # pending job -> the reason the store shows for it
        self.read_to: dict[str, int] = {}  # run directory -> bytes of its events already read

    # --- built from the store
    def load(
        self, s: Session, nodes: list[core.Node], now: float, unit: str = "GPUs", types: Sequence[core.GpuType] = ()
    ) -> core.State:
        """The state from the store: the tenants and what they spent this month, the speed table its runs
        taught, the running jobs where they run (their last committed checkpoints read from their run
        directories), the queue, and the jobs that take the room made for them first. ``types``: the GPU types
        as the operator priced them."""
        self.nodes, self.reasons, self.read_to = list(nodes), {}, {}
        cluster = cluster_config.fleet(nodes, unit, types)
        state = core.State(cluster, self._tenants(s), core.Queue(self.policy.key), speeds.learned(s, cluster.types))
        month = month_start(now)
        state.new_period(month, {t: d for t, (d, _) in spend(s, month, now, ended_only=True).items()})
        self.predictor = self._history(s)
        ran = self._ran(s)
        active = s.scalars(select(Job).where(Job.state.in_(ACTIVE)).order_by(Job.seq)).all()
        for job in active:
            state.submit(self._core_job(job, ran))
            execution = s.scalar(select(Execution).where(Execution.job == job.seq, Execution.attempt == job.attempt))
            running = job.state == JobState.RUNNING and execution is not None
            state.start(job.id, job.placement, execution.started_at if running else now, job.gpu_carve)
            if running and execution.run_dir is not None:
                committed = self.checkpoints(execution.run_dir)
                if committed and committed[-1] > execution.started_at:
                    state.checkpointed(job.id, committed[-1])
            if job.evicting_for is not None or job.cancel_requested:
                state.ask_to_evict(job.id, job.evicting_for or "")
        pending = s.execute(select(*_QUEUED).where(Job.state == JobState.PENDING).order_by(Job.seq)).all()
        for job in pending:
            state.submit(self._core_job(job, ran))
            self.reasons[job.id] = job.reason
        state.first.update(dict.fromkeys(_room_made(active, pending)))
        self.state = state
        return state

    def _tenants(self, s: Session) -> list[core.Tenant]:
        rows = s.scalars(select(Tenant).order_by(Tenant.name))
        return [core.Tenant(t.name, t.nominal_gpus, t.cohort, t.borrowing_limit, t.monthly_budget) for t in rows]

    def _history(self, s: Session) -> core.DurationPredictor:
        """The predictor fed as the loop feeds it: each finished job's GPU-holding time over its executions,
        in the order the jobs ended."""
        predictor = core.DurationPredictor()
        rows = s.execute(
            select(Job.tenant, Job.gpus, func.sum(Execution.ended_at - Execution.started_at))
            .join(Execution, Execution.job == Job.seq)
            .where(Job.state == JobState.SUCCEEDED)
            .group_by(Job.seq, Job.tenant, Job.gpus, Job.ended_at)
            .order_by(Job.ended_at.desc(), Job.seq.desc())
            .limit(PREDICTOR_HISTORY)
        ).all()
        for tenant, gpus, seconds in reversed(rows):
            predictor.record(tenant, gpus, float(seconds or 0.0))
        return predictor

    def _ran(self, s: Session) -> dict[int, tuple[tuple[float, float], ...]]:
        """Each unfinished job's ended executions, (started, ended) each, in order."""
        ran: dict[int, tuple[tuple[float, float], ...]] = {}
        rows = s.execute(
            select(Execution.job, Execution.started_at, Execution.ended_at)
            .join(Job, Job.seq == Execution.job)
            .where(Job.state.in_((JobState.PENDING, *ACTIVE)), Execution.ended_at.is_not(None))
            .order_by(Execution.job, Execution.attempt)
        )
        for seq, started, ended in rows:
            ran[seq] = (*ran.get(seq, ()), (started, ended))
        return ran

    def _core_job(self, job, ran: dict[int, tuple[tuple[float, float], ...]] | None = None) -> core.Job:
        """A job row as the scheduler sees it, its duration predicted from the history the cache has now."""
        return core.Job(
            id=job.id,
            tenant=job.tenant,
            workers=job.workers,
            per_worker=job.gpus // job.workers,
            submitted=job.submitted_at,
            priority=job.priority,
            predicted_s=self.predictor.predict(job.tenant, job.gpus),
            preemptions=job.preemptions,
            preempted_by=frozenset(job.preempted_by),
            queued_at=job.queued_at,
            ran=(ran or {}).get(job.seq, ()),
            gpu_types=tuple(job.gpu_types),
            prefer=tuple(job.prefer_gpu_types),
            mix_types=job.mix_gpu_types,
            kind=job.kind,
            gpu_milli=job.gpu_milli,
        )

    # --- kept current
    def sync(self, s: Session, now: float) -> None:
        """What the API changed since the last round: jobs submitted or cancelled while queued, cancellations
        asked of running jobs. Raises Stale when the tenants changed or a budget month began."""
        state = self.state
        assert state is not None
        if self._tenants(s) != list(state.tenants.values()):
            raise Stale("the tenants changed")
        if month_start(now) != state.period_start:
            raise Stale("a budget month began")
        pending = dict(s.execute(select(Job.id, Job.seq).where(Job.state == JobState.PENDING)).all())
        for job_id in [j for j in (*state.queue.jobs, *state.on_hold) if j not in pending]:
            state.withdraw(job_id)
            self.reasons.pop(job_id, None)
        new = [seq for job_id, seq in pending.items() if job_id not in state.queue.jobs and job_id not in state.on_hold]
        if new:
            wanted = set(new)
            rows = s.execute(
                select(*_QUEUED).where(Job.state == JobState.PENDING, Job.seq >= min(new)).order_by(Job.seq)
            )
            for job in rows:
                if job.seq in wanted:
                    state.submit(self._core_job(job))  # a job running here and pending there: ValueError, rebuilt
                    self.reasons[job.id] = job.reason
        cancelling = s.scalars(select(Job.id).where(Job.state.in_(ACTIVE), Job.cancel_requested.is_(True)))
        for job_id in cancelling:
            if job_id in state.running and job_id not in state.leaving:
                state.ask_to_evict(job_id, "")

    def checkpoints(self, run_dir: str) -> list[float]:
        """When the run's checkpoints committed that the cache has not read yet (its events, read on from where
        the last call stopped)."""
        events = RunDir(Path(run_dir)).events
        records, self.read_to[run_dir] = read_jsonl_from(events, self.read_to.get(run_dir, 0))
        return [float(e["ts"]) for e in records if e.get("kind") == Event.CHECKPOINT_COMMITTED]

    def ended(self, ends: Sequence[tuple[str, str, float, str]], now: float) -> None:
        """Runs that left their GPUs, as (job, how, held seconds, cause): ``finished`` (succeeded: its
        GPU-holding time feeds the predictor), ``gone`` (failed or cancelled), ``preempted`` or ``requeued``
        (lost, or stopped from outside). Applied finishes first, each kind in the order the runs started, as
        the simulator orders the events of one moment."""
        state = self.state
        assert state is not None
        order = {job_id: i for i, job_id in enumerate(state.running)}
        for job_id, how, held_s, cause in sorted(ends, key=lambda e: (e[1] != "finished", order.get(e[0], -1))):
            if job_id not in state.running:
                raise Stale(f"job {job_id} ended, but the cache did not have it running")
            if how in ("finished", "gone"):
                run = state.stop(job_id, now)
                if how == "finished":
                    self.predictor.record(run.job.tenant, run.job.gpus, held_s)
            else:
                state.requeue(job_id, now, preempted=how == "preempted")
                self.reasons[job_id] = cause


def _room_made(active: Sequence[Job], pending: Sequence) -> list[str]:
    """Pending jobs whose victims have all left since they were queued: they take the room made for them
    (``State.first``), before jobs ahead of them in the queue take it back."""
    leaving_for = {job.evicting_for for job in active}
    requeued_for: dict[str, float] = {}
    for job in pending:
        for by in job.preempted_by:
            requeued_for[by] = max(requeued_for.get(by, 0.0), job.queued_at)
    return [job.id for job in pending if job.id not in leaving_for and requeued_for.get(job.id, -1.0) >= job.queued_at]
