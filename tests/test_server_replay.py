"""The server runs what the simulator measured: its control loop, driven by a fake clock and an executor that
plays a slice of Philly's trace with the simulator's own run model, makes the same admissions, placements and
preemptions, at the same moments, as ``phalanx sim`` on that slice."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import select

from conftest import REPO, unavailable
from phalanx.control import scheduler as core
from phalanx.control.executors import Launch, Phase, Status
from phalanx.control.server.loop import Controller
from phalanx.control.sim.simulator import Arrival, ModelledRun, ReplayCosts, arrivals, simulate, split_gpus
from phalanx.control.sim.trace import philly, quotas
from phalanx.control.store import Job, JobState, Tenant, Transition, User, open_store

TRACES = Path(os.environ.get("PHALANX_TRACES", REPO.parent / "shared" / "traces"))
SPEC = "name: trace\nresources: {procs_per_node: 1, device: cpu}\ntrain: {steps: 1}\n"
COSTS = ReplayCosts()


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class TraceExecutor:
    """Plays each execution as the simulator models it (``ModelledRun``): it ends when its work is done, it
    commits a checkpoint every interval from its phase (written to its run directory's events, where the server
    reads them), and on SIGTERM it snapshots at once and leaves when the save commits."""

    name = "trace"
    unit = "GPUs"
    shares = False  # Philly's jobs take whole GPUs

    def __init__(self, arrived: list[Arrival], nodes: list[core.Node], clock: Clock, root: Path, store):
        self.arrived = {a.job.id: a for a in arrived}
        self.nodes, self.clock, self.root, self.store = nodes, clock, root, store
        self.work = {a.job.id: a.job.duration_s for a in arrived}
        self.runs: dict[str, ModelledRun] = {}
        self.leaves: dict[str, float] = {}  # victim -> when its checkpoint commits
        self.written: dict[str, float] = {}  # job -> its last checkpoint written to its events
        self.ran: set[str] = set()
        self.dirs: dict[str, Path] = {}  # job -> its current run directory
        self.decided: list[tuple] = []

    def capacity(self) -> list[core.Node]:
        return self.nodes

    def start(self, launch: Launch) -> dict:
        now, job = self.clock(), launch.job_id
        run = self.runs[job] = ModelledRun.begin(now, self.work[job], job in self.ran, COSTS)
        self.written[job] = -1.0
        self.dirs[job] = self.root / job / f"attempt-{launch.attempt}"
        self.dirs[job].mkdir(parents=True)
        (self.dirs[job] / "events.jsonl").write_text(f'{{"ts": {now!r}, "kind": "run_started"}}\n')
        self.decided.append((now, "admit", job, launch.placement))
        assert run.finish > now
        return {"job": job}

    def adopt(self, handle: dict) -> None:
        raise AssertionError("the server was not restarted")

    def status(self, handle: dict) -> Status:
        now, job = self.clock(), handle["job"]
        run, leaves = self.runs[job], self.leaves.get(job, float("inf"))
        self._checkpoints(job, run, now, min(run.finish, leaves))
        run_dir = self.dirs[job]
        if run.finish <= now and run.finish <= leaves:
            del self.runs[job]
            return Status(Phase.EXITED, run_dir, "succeeded", 0, "finished")
        if leaves <= now:
            del self.runs[job], self.leaves[job]
            self.ran.add(job)
            return Status(Phase.EXITED, run_dir, "stopped", 0, "stopped by SIGTERM")
        return Status(Phase.RUNNING, run_dir)

    def _checkpoints(self, job: str, run: ModelledRun, now: float, end: float) -> None:
        """Every checkpoint committed by ``now``: those before the run's end (one due at the moment it ends is
        never made)."""
        c = run.first_checkpoint(self.arrived[job].phase_s, COSTS)
        while c <= self.written[job]:
            c += COSTS.checkpoint_every_s
        lines = []
        while c <= now and c < end:
            lines.append(f'{{"ts": {c!r}, "kind": "checkpoint_committed", "step": 0}}\n')
            self.written[job] = c
            c += COSTS.checkpoint_every_s
        if lines:
            with (self.dirs[job] / "events.jsonl").open("a") as f:
                f.writelines(lines)

    def signal(self, handle: dict, signum: int) -> None:
        assert signum == signal.SIGTERM
        now, job = self.clock(), handle["job"]
        if job not in self.runs:
            return  # it ended first
        self.work[job] = self.runs[job].left_at(now)
        self.leaves[job] = now + COSTS.commit(self.arrived[job].job.gpus)
        with self.store.read() as s:
            for_job = s.scalar(select(Job.evicting_for).where(Job.id == job))
        self.decided.append((now, "preempt", job, for_job))

    def cancel(self, handle: dict) -> None:
        raise AssertionError("nothing is cancelled")

    def next_change(self) -> float:
        return min((min(run.finish, self.leaves.get(job, float("inf"))) for job, run in self.runs.items()),
                   default=float("inf"))  # fmt: skip


def _by_moment(decided: list[tuple]) -> list[tuple[float, list]]:
    """Decisions grouped by the moment they were made, sorted within it (the server starts a round's admitted
    jobs in submission order, the simulator in the round's)."""
    moments: dict[float, list] = defaultdict(list)
    for t, *rest in decided:
        moments[t].append(tuple(tuple(sorted(x.items())) if isinstance(x, dict) else x for x in rest))
    return [(t, sorted(moments[t])) for t in sorted(moments)]


@pytest.mark.parametrize(("policy", "first_jobs"), [("phalanx", 1000), ("tiresias-like", 600)])
def test_the_server_loop_decides_as_the_simulator_on_a_philly_slice(
    policy: str, first_jobs: int, tmp_path: Path
) -> None:
    trace = TRACES / "philly_pollux_jobs.csv"
    if not trace.is_file():
        unavailable(f"Philly's trace is not at {trace}: set PHALANX_TRACES to the folder holding it (shared/traces)")
    jobs, shares = philly(trace, "2017-10-01", "2017-11-01")
    jobs = jobs[:first_jobs]  # of October 2017
    cluster = core.Cluster.uniform(2, 8, 8)  # 128 GPUs: contended, so that jobs wait and are preempted
    tenants = [core.Tenant(name, gpus, "all") for name, gpus in quotas(shares, cluster.total_gpus).items()]
    fits = {j.id for j in jobs if core.place(cluster, *split_gpus(j.gpus, cluster.largest)) is not None}
    jobs = [j for j in jobs if j.id in fits]

    sim = simulate(core.POLICIES[policy](), jobs, cluster, tenants, COSTS, seed=3)

    store = open_store(f"sqlite:///{tmp_path / 'phalanx.db'}")
    with store.write() as s:
        s.add_all(Tenant(name=t.name, nominal_gpus=t.nominal_gpus, cohort=t.cohort, created_at=0.0) for t in tenants)
        s.add(User(name="trace", tenant=None, role="admin", created_at=0.0))
    clock, arrived = Clock(), arrivals(jobs, COSTS, seed=3, jitter_s=60.0)
    executor = TraceExecutor(arrived, list(cluster.nodes.values()), clock, tmp_path, store)
    controller = Controller(store, executor, core.POLICIES[policy](), clock=clock)
    queue = sorted(arrived, key=lambda a: a.submit)  # stable: the trace's order among equal times
    while queue or executor.runs:
        clock.t = min(queue[0].submit if queue else float("inf"), executor.next_change())
        assert clock.t < float("inf"), "jobs wait with nothing running"
        with store.write() as s:
            while queue and queue[0].submit <= clock.t:
                _submit(s, queue.pop(0))
        controller.tick()
    with store.read() as s:
        states = set(s.scalars(select(Job.state)))
    assert states == {JobState.SUCCEEDED}

    served, simulated = _by_moment(executor.decided), _by_moment(sim.decisions)
    assert sum(kind == "preempt" for _, kind, *_ in sim.decisions) >= 10  # the slice exercises preemption
    for (t_server, at_server), (t_sim, at_sim) in zip(served, simulated, strict=False):
        only_server, only_sim = set(at_server) - set(at_sim), set(at_sim) - set(at_server)
        assert (t_server, only_server, only_sim) == (t_sim, set(), set()), f"the first moment they differ: {t_sim}"
    assert len(served) == len(simulated)


def _submit(s, arrival: Arrival) -> None:
    """The row ``lifecycle.submit`` writes for a job of the trace's size (its spec is not what is replayed)."""
    tj = arrival.job
    workers, _ = split_gpus(tj.gpus, 8)
    job = Job(
        id=tj.id, tenant=tj.tenant, owner="trace", name=tj.id, spec=SPEC, workdir="/", priority=0, total_steps=1,
        nodes=workers, checkpoint_dir=None, workers=workers,
        gpus=tj.gpus, state=JobState.PENDING, reason="queued", submitted_at=arrival.submit, queued_at=arrival.submit,
        attempt=0, cancel_requested=False, preemptions=0, preempted_by=[],
    )  # fmt: skip
    s.add(job)
    s.flush()
    s.add(Transition(job=job.seq, at=arrival.submit, from_state=None, to_state=JobState.PENDING, cause="submitted"))
