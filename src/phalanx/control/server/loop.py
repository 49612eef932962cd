"""The control loop: read the store, ask the scheduling core for a round, commit its decisions in one
transaction, then act on the executor. No transaction or lock is held while the executor acts or while a
run directory is read (on Slurm, an action is a subprocess that may take a minute): each step reads what it
needs in a short transaction, acts with none open, then records what happened in another, checking that the
job is still where it was. Executor actions are keyed by (job, attempt), so whatever a crash interrupts is
repaired by the next loop: an admitted job is started (or found started), a running job's end is noticed
from what its run directory says, a stop that was asked for is delivered once."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from phalanx.checkpoint import CheckpointDir
from phalanx.control import scheduler as core
from phalanx.control.executors import Executor, Launch, Phase, Status
from phalanx.control.server.lifecycle import ACTIVE, S, move
from phalanx.control.store import Execution, Job, Store, Tenant
from phalanx.obs.events import read_jsonl
from phalanx.obs.goodput import ledger
from phalanx.obs.rundir import RunDir
from phalanx.spec import parse_spec

log = logging.getLogger("phalanx.server")
MAX_LOST = 3  # executions lost (their process gone without a result) before the job is failed
MIN_ROUND_GAP_S = 0.2  # a burst of submissions makes one round, not one each
# What a round reads of each queued job: plain rows, not ORM objects (a queue can hold many thousands).
_QUEUED = (
    Job.seq, Job.id, Job.tenant, Job.workers, Job.gpus, Job.priority, Job.submitted_at, Job.queued_at,
    Job.preemptions, Job.preempted_by, Job.reason,
)  # fmt: skip


class Controller:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        policy: core.Policy | None = None,
        tick_s: float = 0.5,
        half_life_s: float = 6 * 3600,
        clock: Callable[[], float] = time.time,
    ):
        self.store, self.executor = store, executor
        self.policy = policy or core.Phalanx()
        self.tick_s, self.half_life_s, self.clock = tick_s, half_life_s, clock
        self.wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._signalled: set[tuple[str, int]] = set()  # (job, attempt) asked to stop by this process

    # --- lifetime
    def start(self) -> None:
        """Adopt what runs from before (a restarted server), then loop in a thread."""
        with self.store.read() as s:
            for job in s.scalars(select(Job).where(Job.state == S.RUNNING)):
                self.executor.adopt(job.handle)
        self._thread = threading.Thread(target=self._loop, name="phalanx-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            began = time.monotonic()
            self.wake.clear()
            try:
                self.tick()
            except Exception:  # one bad round must not stop scheduling; the next one retries
                log.exception("scheduling round failed")
            took = time.monotonic() - began
            self.wake.wait(self.tick_s)
            # A burst of submissions makes one round, not one each; and rounds over a long queue take at most a
            # quarter of the process's time, the rest is the API's.
            self._stopping.wait(max(0.0, began + max(MIN_ROUND_GAP_S, 4 * took) - time.monotonic()))

    def tick(self) -> None:
        now = self.clock()
        self._reconcile(now)
        self._schedule(now)
        self._start_admitted()
        self._deliver_stops()

    # --- 1: what the executor says about running jobs
    def _reconcile(self, now: float) -> None:
        """Ask the executor about each running job, and read what an ended one left, with no transaction open;
        then record it all in one short one."""
        with self.store.read() as s:
            running = s.scalars(select(Job).where(Job.state == S.RUNNING)).all()
        seen = []
        for job in running:
            try:
                seen.append((job, self._observe(job)))
            except Exception:  # one job's executor trouble must not stop the others being seen
                log.exception("could not ask the %s executor about job %s", self.executor.name, job.id)
        if not seen:
            return
        with self.store.write() as s:
            for before, seen_now in seen:
                job = s.scalar(
                    select(Job).where(Job.id == before.id, Job.state == S.RUNNING, Job.attempt == before.attempt)
                )
                if job is None:
                    continue
                status = seen_now.status
                execution = _execution(s, job)
                if status.run_dir is not None:
                    execution.run_dir = str(status.run_dir)
                if status.phase is not Phase.RUNNING:
                    self._ended(s, job, execution, seen_now, now)
                elif status.reason and not (job.cancel_requested or job.evicting_for) and job.reason != status.reason:
                    # what the cluster says of it: pending in its queue, running where, requeued
                    job.reason = status.reason

    def _observe(self, job: Job) -> Observed:
        status = self.executor.status(job.handle)
        if status.phase is Phase.RUNNING:
            return Observed(status)
        productive_s = None
        if status.run_dir is not None and (status.run_dir / "events.jsonl").is_file():
            productive_s = ledger(RunDir(status.run_dir)).seconds["productive"]
        return Observed(status, productive_s, _newest_checkpoint(job))

    def _ended(self, s: Session, job: Job, execution: Execution, seen: Observed, now: float) -> None:
        status = seen.status
        execution.ended_at, execution.outcome = now, status.outcome or "lost"
        execution.productive_s = seen.productive_s
        job.handle, job.placement = None, None
        if status.phase is Phase.EXITED and status.outcome == "succeeded":
            move(s, job, S.SUCCEEDED, status.reason, now)
        elif status.phase is Phase.EXITED and status.outcome == "failed":
            move(s, job, S.FAILED, status.reason, now)
        elif job.cancel_requested:
            move(s, job, S.CANCELLED, f"cancelled: {status.reason or 'its process is gone'}", now)
        elif status.phase is Phase.EXITED:  # stopped by a signal: asked to make room, or from outside
            step = seen.checkpoint_step
            resume = f"it resumes from the checkpoint of step {step}" if step is not None else "no checkpoint yet"
            if job.evicting_for is not None:
                move(s, job, S.PREEMPTED, f"{job.reason}; stopped with its checkpoint committed ({resume})", now)
                job.preemptions += 1
                job.preempted_by = sorted({*job.preempted_by, job.evicting_for})
                self._requeue(s, job, f"requeued after preemption; {resume}", now)
            else:
                self._requeue(s, job, f"{status.reason} outside the server; requeued, {resume}", now)
        else:  # lost
            lost = s.scalar(select(func.count()).where(Execution.job == job.seq, Execution.outcome == "lost"))
            if lost >= MAX_LOST:
                move(s, job, S.FAILED, f"lost {lost} times; the last: {status.reason}", now)
            else:
                self._requeue(s, job, f"execution lost ({status.reason}); requeued", now)

    def _requeue(self, s: Session, job: Job, cause: str, now: float) -> None:
        move(s, job, S.PENDING, cause, now)
        job.evicting_for, job.queued_at = None, now

    # --- 2: one scheduling round
    def _schedule(self, now: float) -> None:
        """Decide on a snapshot, outside the write lock (a round over a long queue takes a while and submissions
        go on meanwhile), then apply what still holds: only this loop admits and preempts, so the capacity
        it counted can only have grown; a job cancelled since the snapshot is left alone."""
        cluster = core.Cluster(self.executor.capacity())  # on Slurm, sinfo (cached): asked with no transaction open
        with self.store.read() as s:
            active = s.scalars(select(Job).where(Job.state.in_(ACTIVE)).order_by(Job.seq)).all()
            pending = s.execute(select(*_QUEUED).where(Job.state == S.PENDING).order_by(Job.seq)).all()
            state = self._state(s, cluster, active, pending, now)
        decided = self.policy.schedule(state, now)
        admitted = {a.job for a in decided.admit}
        reasons = {}
        for job in pending:
            if job.id not in admitted:
                why = decided.why(job.id)
                text = f"{why.kind}: {why.reason}"  # stable across rounds: rewritten only when it changes
                if why.estimated_start is not None:
                    text += f" (estimated start in {max(0.0, why.estimated_start - now):.0f} s)"
                if job.reason != text:
                    reasons[job.seq] = text
        if not (decided.admit or decided.preempt or reasons):
            return
        with self.store.write() as s:
            for admit in decided.admit:
                job = s.scalar(select(Job).where(Job.id == admit.job, Job.state == S.PENDING))
                if job is not None:
                    job.placement, job.attempt = admit.placement, job.attempt + 1
                    where = ", ".join(f"{node}: {gpus}" for node, gpus in admit.placement.items())
                    cause = f"admitted on {where}" + (" (borrowed GPUs)" if admit.borrowing else "")
                    move(s, job, S.ADMITTED, cause, now)
            for preempt in decided.preempt:
                victim = s.scalar(select(Job).where(Job.id == preempt.job, Job.state == S.RUNNING))
                if victim is not None and victim.evicting_for is None:
                    victim.evicting_for = preempt.for_job
                    victim.reason = f"preempted for {preempt.for_job}: {preempt.reason}"
            if reasons:  # one statement for many rows (executemany), by primary key
                jobs = Job.__table__
                s.connection().execute(
                    update(jobs).where(jobs.c.seq == bindparam("key"), jobs.c.state == S.PENDING),
                    [{"key": seq, "reason": text} for seq, text in reasons.items()],
                )

    def _state(self, s: Session, cluster: core.Cluster, active, pending, now: float) -> core.State:
        """The scheduler's view of the store: the cluster, the tenants, the running jobs where they run, the
        queue, fair-share usage, and the jobs that take the room made for them first."""
        tenants = [core.Tenant(t.name, t.quota_gpus, t.cohort, t.borrowing_limit) for t in s.scalars(select(Tenant))]
        state = core.State(cluster, tenants, core.Queue(self.policy.key), self.half_life_s)
        predictor = self._predictor(s)
        for job in active:
            state.submit(_core_job(job, predictor))
            started = _execution(s, job).started_at if job.state == S.RUNNING else now
            state.start(job.id, job.placement, started)
            if job.evicting_for is not None or job.cancel_requested:
                state.ask_to_evict(job.id, job.evicting_for or "")
        state.usage = self._usage(s, now)
        for job in pending:
            state.submit(_core_job(job, predictor))
        state.first.update(dict.fromkeys(_room_made(active, pending)))
        return state

    def _predictor(self, s: Session) -> core.DurationPredictor:
        """Durations of each tenant's finished jobs, from their executions (oldest first)."""
        predictor = core.DurationPredictor()
        rows = s.execute(
            select(Job.tenant, Job.gpus, func.sum(Execution.ended_at - Execution.started_at))
            .join(Execution, Execution.job == Job.seq)
            .where(Job.state == S.SUCCEEDED)
            .group_by(Job.seq, Job.tenant, Job.gpus)
            .order_by(Job.seq.desc())
            .limit(1000)
        ).all()
        for tenant, gpus, seconds in reversed(rows):
            predictor.record(tenant, gpus, float(seconds or 0.0))
        return predictor

    def _usage(self, s: Session, now: float) -> core.Usage:
        """Fair-share usage replayed from the executions of the last few half-lives."""
        changes: list[tuple[float, str, int]] = []
        horizon = now - 5 * self.half_life_s
        for e in s.scalars(select(Execution).where(Execution.ended_at.is_(None) | (Execution.ended_at > horizon))):
            changes.append((e.started_at, e.tenant, e.gpus))
            if e.ended_at is not None:
                changes.append((e.ended_at, e.tenant, -e.gpus))
        usage, held = core.Usage(self.half_life_s), defaultdict(int)
        for at, tenant, gpus in sorted(changes):
            held[tenant] += gpus
            usage.change(tenant, at, held[tenant])
        return usage

    # --- 3: acting on the executor
    def _start_admitted(self) -> None:
        """Start each admitted job on the executor with no transaction open (sbatch may take a minute), then
        record its handle. A crash in between is repaired by the next start of the server: the job is still
        admitted, and starting its (job, attempt) again finds the execution already started."""
        with self.store.read() as s:
            admitted = s.scalars(select(Job).where(Job.state == S.ADMITTED).order_by(Job.seq)).all()
        for job in admitted:
            spec = parse_spec(job.spec, source=f"job {job.id}")
            launch = Launch(job.id, job.attempt, job.spec, job.workdir, job.placement, spec.resources.nodes)
            try:
                handle, error = self.executor.start(launch), None
            except Exception as e:
                handle, error = None, e
            now = self.clock()
            with self.store.write() as s:
                row = s.scalar(select(Job).where(Job.id == job.id, Job.state == S.ADMITTED, Job.attempt == job.attempt))
                if row is None:  # only this loop moves an admitted job on
                    continue
                if error is not None:
                    move(s, row, S.FAILED, f"the {self.executor.name} executor could not start it: {error}", now)
                    continue
                row.handle = handle
                s.add(Execution(job=row.seq, tenant=row.tenant, attempt=row.attempt, gpus=row.gpus, started_at=now))
                move(s, row, S.RUNNING, f"started on {self.executor.name} (execution {row.attempt})", now)

    def _deliver_stops(self) -> None:
        """SIGTERM (checkpoint, then stop) to each running job asked to make room or to be cancelled, once:
        a second SIGTERM would make its supervisor kill the workers before the checkpoint commits."""
        with self.store.read() as s:
            stopping = [
                (job, _execution(s, job).run_dir)
                for job in s.scalars(
                    select(Job).where(
                        Job.state == S.RUNNING, Job.evicting_for.is_not(None) | Job.cancel_requested.is_(True)
                    )
                )
                if (job.id, job.attempt) not in self._signalled
            ]
        for job, run_dir in stopping:
            self._signalled.add((job.id, job.attempt))
            if _signal_received(run_dir):  # delivered before a restart of the server
                continue
            if job.cancel_requested:
                self.executor.cancel(job.handle)  # on Slurm, scancel: the job ends CANCELLED there too
            else:
                self.executor.signal(job.handle, signal.SIGTERM)


@dataclass(frozen=True)
class Observed:
    """What the loop found of a running job with no transaction open: its status and, once it ended, what its
    run left (productive seconds, from its goodput ledger; the newest committed checkpoint)."""

    status: Status
    productive_s: float | None = None
    checkpoint_step: int | None = None


def _execution(s: Session, job: Job) -> Execution:
    found = s.scalar(select(Execution).where(Execution.job == job.seq, Execution.attempt == job.attempt))
    assert found is not None, f"job {job.id} runs with no execution {job.attempt}"
    return found


def _core_job(job: Job, predictor: core.DurationPredictor) -> core.Job:
    return core.Job(
        id=job.id,
        tenant=job.tenant,
        workers=job.workers,
        per_worker=job.gpus // job.workers,
        submitted=job.submitted_at,
        priority=job.priority,
        predicted_s=predictor.predict(job.tenant, job.gpus),
        preemptions=job.preemptions,
        preempted_by=frozenset(job.preempted_by),
        queued_at=job.queued_at,
    )


def _room_made(active: list[Job], pending: list[Job]) -> list[str]:
    """Pending jobs whose victims have all left since they were queued: they take the room made for them
    (``State.first``), before jobs ahead of them in the queue take it back."""
    leaving_for = {job.evicting_for for job in active}
    requeued_for: dict[str, float] = {}
    for job in pending:
        for by in job.preempted_by:
            requeued_for[by] = max(requeued_for.get(by, 0.0), job.queued_at)
    return [job.id for job in pending if job.id not in leaving_for and requeued_for.get(job.id, -1.0) >= job.queued_at]


def _newest_checkpoint(job: Job) -> int | None:
    """The newest committed checkpoint's step, to say where the job resumes (the job verifies it on load)."""
    where = parse_spec(job.spec, source=f"job {job.id}").checkpoint.dir
    if not where:
        return None
    checkpoints = CheckpointDir(where)
    return next((step for step in reversed(checkpoints.steps()) if checkpoints.committed(step)), None)


def _signal_received(run_dir: str | None) -> bool:
    if run_dir is None:
        return False
    events = Path(run_dir) / "events.jsonl"
    return events.is_file() and any(e["kind"] == "signal_received" for e in read_jsonl(events))
