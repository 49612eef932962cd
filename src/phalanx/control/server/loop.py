"""The control loop: keep the scheduler's cache current (cache.py: the API's changes from the store, the
executor's news and each run's committed checkpoints), run a round on it, record its decisions through
``apply`` in one transaction, as the simulator applies its own, then act on the executor. No transaction or
lock is held while the executor acts or while a run directory is read (on Slurm, an action is a subprocess
that may take a minute): each step reads what it needs in a short transaction, acts with none open, then
records what happened in another, checking that the job is still where it was. Executor actions are keyed by
(job, attempt), so whatever a crash interrupts is repaired by the next loop: an admitted job is started (or
found started), a running job's end is noticed from what its run directory says, a stop that was asked for
is delivered once.

Several server processes may share one database: the one holding the loop's lease runs the loop (its writes
fenced by it: store/lease.py), and the others take it over when it lapses."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from phalanx.checkpoint import CheckpointDir
from phalanx.control import scheduler as core
from phalanx.control.executors import Executor, Launch, Phase, Status
from phalanx.control.server import speeds
from phalanx.control.server.cache import Cache, Stale
from phalanx.control.server.lifecycle import move
from phalanx.control.server.metrics import ROUND_SECONDS
from phalanx.control.store import Execution, Job, JobState, Store
from phalanx.control.store.lease import LEASE_S, Fenced, LoopLease
from phalanx.obs.digest import digest
from phalanx.obs.rundir import RunDir

log = logging.getLogger("phalanx.server")
MAX_LOST = 3  # executions lost (their process gone without a result) before the job is failed
MIN_ROUND_GAP_S = 0.2  # a burst of submissions makes one round, not one each


class Controller:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        policy: core.Policy | None = None,
        tick_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        types: Sequence[core.GpuType] = (),
        lease: LoopLease | None = None,
    ):
        self.store, self.executor = store, executor
        self.lease = lease or LoopLease(store, LEASE_S)
        self.types = tuple(types)  # the GPU types as the operator priced them
        self.policy = policy or core.PredictiveLas()
        self.tick_s, self.clock = tick_s, clock
        self.cache = Cache(self.policy)
        self.wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._signalled: set[tuple[str, int]] = set()  # (job, attempt) asked to stop by this process

    # --- lifetime
    def start(self) -> None:
        """Loop in a thread: this process runs the loop while it holds the lease."""
        self._thread = threading.Thread(target=self._loop, name="phalanx-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop looping, and give the lease up for another process (or this server started again) to take."""
        self._stopping.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join()
        self.lease.release()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            began, cpu = time.monotonic(), time.thread_time()
            self.wake.clear()
            try:
                self.tick()
            except Fenced as e:  # another process took the loop over: what this one was about to write is void
                self._follow(str(e))
            except Exception:  # one bad round must not stop scheduling; the next one retries
                log.exception("scheduling round failed")
            took = time.thread_time() - cpu  # the loop's CPU: not its waits on the store or the executor, nor a freeze
            self.wake.wait(self.tick_s)
            # A burst of submissions makes one round, not one each; and rounds over a long queue take at most a
            # quarter of the process's CPU time, the rest is the API's.
            self._stopping.wait(max(0.0, began + max(MIN_ROUND_GAP_S, 4 * took) - time.monotonic()))

    def _lead(self) -> bool:
        """Hold the lease, or take it over if it lapsed. On taking it: adopt what runs (started by this process
        before a restart, or by the process that held the loop before), and build the cache from the store."""
        was = self.lease.epoch
        if not self.lease.hold():
            if was is not None:
                self._follow(f"this one held epoch {was}")
            return False
        if self.lease.epoch != was:
            log.info("runs the control loop (lease epoch %s, %s)", self.lease.epoch, self.lease.holder)
            with self.store.read() as s:
                for job in s.scalars(select(Job).where(Job.state == JobState.RUNNING)):
                    self.executor.adopt(job.handle)
            self.cache.state = None
        return True

    def _follow(self, why: str) -> None:
        """Step down: another process runs the loop; this one's cache is no longer the truth."""
        log.warning("another process took the control loop over (%s): following", why)
        self.cache.state = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        """A transaction of the loop's, fenced by its lease."""
        with self.store.write() as s:
            self.lease.fence(s)
            yield s

    def tick(self) -> None:
        """One round, in the simulator's order for one moment: what the API changed (submissions first), what
        ended and what checkpointed, then the scheduling round and its actions; nothing while another process
        holds the lease. Whatever fails, the cache is rebuilt from the store on the next tick."""
        if not self._lead():
            return
        now = self.clock()
        try:
            self._refresh(now)
            self._reconcile(now)
            self._schedule(now)
            self._start_admitted()
        except Exception:
            self.cache.state = None
            raise
        self._deliver_stops()

    def _refresh(self, now: float) -> None:
        nodes = self.executor.capacity()  # on Slurm, sinfo (cached): asked with no transaction open
        with self.store.read() as s:
            if self.cache.state is not None and nodes == self.cache.nodes:
                try:
                    self.cache.sync(s, now)
                    return
                except Stale as e:
                    log.info("rebuilding the scheduler's cache: %s", e)
            self.cache.load(s, nodes, now, self.executor.unit, self.types)

    # --- 1: what the executor says about running jobs
    def _reconcile(self, now: float) -> None:
        """Ask the executor about each running job, and read what its run directory says (checkpoints
        committed, and what an ended run left), with no transaction open; then record it all in one short
        one, and in the cache."""
        with self.store.read() as s:
            running = s.execute(
                select(Job, Execution)
                .join(Execution, (Execution.job == Job.seq) & (Execution.attempt == Job.attempt))
                .where(Job.state == JobState.RUNNING)
            ).all()
        news, checkpointed = [], {}
        for job, execution in running:
            try:
                seen = self._observe(job, execution.run_dir)
            except Exception:  # one job's executor trouble must not stop the others being seen
                log.exception("could not ask the %s executor about job %s", self.executor.name, job.id)
                continue
            if seen.checkpoints:
                checkpointed[job.id] = seen.checkpoints[-1]
            if seen.news(job, execution):
                news.append((job, seen))
        ends = []
        if news:
            with self._write() as s:
                for before, seen in news:
                    job = s.scalar(
                        select(Job).where(
                            Job.id == before.id, Job.state == JobState.RUNNING, Job.attempt == before.attempt
                        )
                    )
                    if job is None:
                        continue
                    status, execution = seen.status, _execution(s, job)
                    if status.run_dir is not None:
                        execution.run_dir = str(status.run_dir)
                    if status.phase is not Phase.RUNNING:
                        ends.append(self._ended(s, job, execution, seen, now))
                        self.cache.read_to.pop(execution.run_dir, None)
                    elif seen.says_more(job):
                        job.reason = status.reason
        self.cache.ended(ends, now)
        state = self.cache.state
        for job_id, at in checkpointed.items():
            if job_id in state.running and at > state.running[job_id].last_checkpoint:
                state.checkpointed(job_id, at)

    def _observe(self, job: Job, run_dir: str | None) -> Observed:
        status = self.executor.status(job.handle)
        run_dir = str(status.run_dir) if status.run_dir is not None else run_dir
        checkpoints = self.cache.checkpoints(run_dir) if run_dir is not None else []
        if status.phase is Phase.RUNNING:
            return Observed(status, checkpoints)
        said = digest(RunDir(status.run_dir)) if status.run_dir is not None else None
        if said is None:
            return Observed(status, checkpoints, checkpoint_step=_newest_checkpoint(job))
        productive_s = said.ledger.seconds["productive"]
        return Observed(status, checkpoints, productive_s, _newest_checkpoint(job), said.steps_done, said.tokens_run)

    def _ended(self, s: Session, job: Job, execution: Execution, seen: Observed, now: float) -> tuple:
        """Record the end of the job's execution; returns it for the cache: (job, how, held seconds, cause)."""
        status = seen.status
        execution.ended_at, execution.outcome = now, status.outcome or "lost"
        execution.productive_s, execution.tokens = seen.productive_s, seen.tokens
        if self.cache.state is not None:
            speeds.observe(self.cache.state.speeds, job.kind, execution.gpu_type, execution.gpus, seen.tokens,
                           seen.productive_s)  # fmt: skip
        job.steps_done = seen.steps_done if seen.steps_done is not None else job.steps_done
        job.handle, job.placement, job.gpu_carve = None, None, None
        how = "gone"
        if status.phase is Phase.EXITED and status.outcome == "succeeded":
            move(s, job, JobState.SUCCEEDED, status.reason, now)
            how = "finished"
        elif status.phase is Phase.EXITED and status.outcome == "failed":
            move(s, job, JobState.FAILED, status.reason, now)
        elif job.cancel_requested:
            move(s, job, JobState.CANCELLED, f"cancelled: {status.reason or 'its process is gone'}", now)
        elif status.phase is Phase.EXITED:  # stopped by a signal: asked to make room, or from outside
            step = seen.checkpoint_step
            resume = f"it resumes from the checkpoint of step {step}" if step is not None else "no checkpoint yet"
            how = "requeued"
            if job.evicting_for is not None:
                move(s, job, JobState.PREEMPTED, f"{job.reason}; stopped with its checkpoint committed ({resume})", now)
                job.preemptions += 1
                job.preempted_by = sorted({*job.preempted_by, job.evicting_for})
                self._requeue(s, job, f"requeued after preemption; {resume}", now)
                how = "preempted"
            else:
                self._requeue(s, job, f"{status.reason} outside the server; requeued, {resume}", now)
        else:  # lost
            lost = s.scalar(select(func.count()).where(Execution.job == job.seq, Execution.outcome == "lost"))
            if lost >= MAX_LOST:
                move(s, job, JobState.FAILED, f"lost {lost} times; the last: {status.reason}", now)
            else:
                self._requeue(s, job, f"execution lost ({status.reason}); requeued", now)
                how = "requeued"
        held_s = s.scalar(select(func.sum(Execution.ended_at - Execution.started_at)).where(Execution.job == job.seq))
        return job.id, how, float(held_s or 0.0), job.reason

    def _requeue(self, s: Session, job: Job, cause: str, now: float) -> None:
        move(s, job, JobState.PENDING, cause, now)
        job.evicting_for, job.queued_at = None, now

    # --- 2: one scheduling round
    def _schedule(self, now: float) -> None:
        """A round on the cache, with no transaction open; then ``apply`` records its decisions in one
        transaction (the store is the executor's to-do list: an admitted job is started, a victim signalled,
        after the commit), with each pending job's reason where it changed. A job cancelled since the cache
        was synced is left alone."""
        state = self.cache.state
        with ROUND_SECONDS.time():
            self._round(state, now)

    def _round(self, state: core.State, now: float) -> None:
        core.enforce_budgets(state, now)
        decided = self.policy.schedule(state, now)
        with self._write() as s:
            core.apply(decided, state, _Recorder(s), now)
            reasons = {}
            for job in state.pending():
                if job.id in state.on_hold:
                    text = f"budget: {state.holding[job.tenant]}"
                else:
                    why = decided.why(job.id)
                    text = f"{why.kind}: {why.reason}"  # stable across rounds: rewritten only when it changes
                if self.cache.reasons.get(job.id) != text:
                    reasons[job.id] = self.cache.reasons[job.id] = text
            if reasons:  # one statement for many rows (executemany)
                jobs = Job.__table__
                s.connection().execute(
                    update(jobs).where(jobs.c.id == bindparam("key"), jobs.c.state == JobState.PENDING),
                    [{"key": job_id, "reason": text} for job_id, text in reasons.items()],
                )

    # --- 3: acting on the executor
    def _start_admitted(self) -> None:
        """Start each admitted job on the executor with no transaction open (sbatch may take a minute), then
        record its handle. A crash in between is repaired by the next start of the server: the job is still
        admitted, and starting its (job, attempt) again finds the execution already started."""
        with self.store.read() as s:
            admitted = s.scalars(select(Job).where(Job.state == JobState.ADMITTED).order_by(Job.seq)).all()
        failed = []
        for job in admitted:
            launch = Launch(job.id, job.attempt, job.spec, job.workdir, job.placement, job.nodes, job.gpu_milli,
                            job.gpu_carve)  # fmt: skip
            try:
                handle, error = self.executor.start(launch), None
            except Exception as e:
                handle, error = None, e
            now = self.clock()
            with self._write() as s:
                row = s.scalar(
                    select(Job).where(Job.id == job.id, Job.state == JobState.ADMITTED, Job.attempt == job.attempt)
                )
                if row is None:  # only this loop moves an admitted job on
                    continue
                if error is not None:
                    move(s, row, JobState.FAILED, f"the {self.executor.name} executor could not start it: {error}", now)
                    failed.append((row.id, "gone", 0.0, row.reason))
                    continue
                row.handle = handle
                cluster = self.cache.state.cluster if self.cache.state else None
                known = cluster is not None and set(row.placement) <= cluster.nodes.keys()
                s.add(
                    Execution(
                        job=row.seq,
                        tenant=row.tenant,
                        attempt=row.attempt,
                        gpus=row.gpu_use,
                        started_at=now,
                        dollars_per_h=cluster.dollars_per_h(row.placement, row.gpu_milli) if cluster else 0.0,
                        gpu_type=cluster.type_of(row.placement) if known else None,
                    )
                )
                move(s, row, JobState.RUNNING, f"started on {self.executor.name} (execution {row.attempt})", now)
        if failed:
            self.cache.ended(failed, self.clock())

    def _deliver_stops(self) -> None:
        """SIGTERM (checkpoint, then stop) to each running job asked to make room or to be cancelled, once:
        a second SIGTERM would make its supervisor kill the workers before the checkpoint commits."""
        with self.store.read() as s:
            stopping = [
                (job, _execution(s, job).run_dir)
                for job in s.scalars(
                    select(Job).where(
                        Job.state == JobState.RUNNING, Job.evicting_for.is_not(None) | Job.cancel_requested.is_(True)
                    )
                )
                if (job.id, job.attempt) not in self._signalled
            ]
        if stopping:
            with self._write():  # still this process's to deliver
                pass
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
    """What the loop found of a running job with no transaction open: its status, when the checkpoints it
    committed since the last look did, and once it ended, what its run left (productive seconds, from its
    goodput ledger; the newest committed checkpoint's step; the steps it had done; the tokens it trained on)."""

    status: Status
    checkpoints: list[float]
    productive_s: float | None = None
    checkpoint_step: int | None = None
    steps_done: int | None = None
    tokens: float | None = None

    def says_more(self, job: Job) -> bool:
        """What the cluster says of a running job (pending in its queue, running where, requeued) is new, and
        no stop the server asked for is being explained instead."""
        reason = self.status.reason
        return bool(reason) and not (job.cancel_requested or job.evicting_for) and job.reason != reason

    def news(self, job: Job, execution: Execution) -> bool:
        """Anything for the store: the run ended, its run directory is known, or the cluster says more."""
        run_dir = self.status.run_dir
        moved = run_dir is not None and str(run_dir) != execution.run_dir
        return self.status.phase is not Phase.RUNNING or moved or self.says_more(job)


def _execution(s: Session, job: Job) -> Execution:
    found = s.scalar(select(Execution).where(Execution.job == job.seq, Execution.attempt == job.attempt))
    assert found is not None, f"job {job.id} runs with no execution {job.attempt}"
    return found


class _Recorder:
    """The server's actuator: a round's decisions written to the store, in the transaction ``apply`` runs in.
    The executor acts on them after the commit (``_start_admitted``, ``_deliver_stops``)."""

    def __init__(self, session: Session):
        self.s = session

    def admit(self, admit: core.Admit, now: float) -> bool:
        job = self.s.scalar(select(Job).where(Job.id == admit.job, Job.state == JobState.PENDING))
        if job is None:  # cancelled since the cache was synced
            return False
        job.placement, job.gpu_carve, job.attempt = admit.placement, admit.carve, job.attempt + 1
        where = ", ".join(f"{node}: {gpus}" for node, gpus in admit.placement.items())
        if admit.carve is not None:
            where += f" ({job.gpu_milli / 1000:g} of its shared GPU {admit.carve})"
        move(
            self.s,
            job,
            JobState.ADMITTED,
            f"admitted on {where}" + (" (borrowed GPUs)" if admit.borrowing else ""),
            now,
        )
        return True

    def preempt(self, preempt: core.Preempt, now: float) -> bool:
        victim = self.s.scalar(select(Job).where(Job.id == preempt.job, Job.state == JobState.RUNNING))
        if victim is None or victim.evicting_for is not None:
            return False
        victim.evicting_for = preempt.for_job
        victim.reason = f"preempted for {preempt.for_job}: {preempt.reason}"
        return True


def _newest_checkpoint(job: Job) -> int | None:
    """The newest committed checkpoint's step, to say where the job resumes (the job verifies it on load)."""
    if not job.checkpoint_dir:
        return None
    checkpoints = CheckpointDir(job.checkpoint_dir)
    return checkpoints.newest_committed()


def _signal_received(run_dir: str | None) -> bool:
    if run_dir is None:
        return False
    said = digest(RunDir(Path(run_dir)))
    return said is not None and said.signalled
