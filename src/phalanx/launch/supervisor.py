"""The job's supervisor: the attempt loop of one job, on one node or many. It runs on node 0 (``phalanx run``,
or ``phalanx agent --node-rank 0``): it starts each attempt on the member nodes (launch/attempt.py), watches
them, ends the attempt everywhere when anything fails, and decides what comes next: restart from the last
valid checkpoint, replace or leave out a node, or stop, and says how the job ended.

Why not torch.distributed.elastic's agent (LocalElasticAgent, what torchrun runs)? We evaluated it and use
its protocols but not its control loop:
- its monitor loop restarts on every failure alike, with no room to classify failures (a user's import error
  should not be retried, a lost node should), to watch heartbeats for hangs, to dump every rank's stacks
  before a kill, or to shrink the world by our own policy; all of that is phalanx's job (resilience/);
- its process layer (elastic.multiprocessing.PContext) installs process-wide signal handlers, closes workers
  with a fixed SIGTERM and 30 s on any failure, and tees output by polling log files.
What we keep from torch.distributed, so that a plain torchrun script runs unchanged: the supervisor hosts a
c10d TCPStore per attempt and workers join it through the agent-store protocol
(TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR/PORT), the torchrun environment variables, and the elastic error
file (TORCHELASTIC_ERROR_FILE, written by ``@record``) for a rank's root cause.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from torch.distributed import TCPStore

from phalanx.launch.attempt import Agents, AttemptRun, NodeLost, RankFailed, this_agent
from phalanx.launch.lifetime import recorded_signals
from phalanx.launch.membership import Membership
from phalanx.launch.node import LaunchError, Plan, node_workers, resolve_device, worker_argv
from phalanx.launch.recovery import NodeRecovery, RankRecovery, Recovery
from phalanx.launch.rendezvous import Heartbeat, Rendezvous, host_store, join_store
from phalanx.launch.stops import REGROW, Stopped, Stops
from phalanx.launch.tether import Tethers
from phalanx.obs import EventLog
from phalanx.obs.console import Console
from phalanx.obs.events import Event
from phalanx.obs.goodput import write_ledger
from phalanx.obs.plot import plot_loss
from phalanx.obs.progress import ProgressFeed, step_line
from phalanx.obs.protocol import last_heartbeat, last_step
from phalanx.obs.ranks import RankFigures
from phalanx.obs.rundir import Outcome, RunDir, RunResult
from phalanx.obs.summary import summary
from phalanx.resilience import Failure, HangDetector, Kind, Stall, StragglerDetector, backoff_s
from phalanx.resilience.elastic import NoCapacity
from phalanx.resilience.straggler import WINDOW as STRAGGLER_WINDOW
from phalanx.spec import JobSpec, dump_spec

POLL_S = 0.1  # how often exits and signals are checked: a crash is seen within this
HANG_CHECK_S = 0.5  # how often the heartbeats are read
STORE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class HostedRendezvous:
    """Node 0's side of a multi-node job's rendezvous: the store it hosts, and its own address."""

    store: TCPStore
    addr: str
    join_timeout_s: float


class Supervisor:
    def __init__(
        self,
        spec: JobSpec,
        runs_root: str | Path,
        console: TextIO = sys.stdout,
        rendezvous: HostedRendezvous | None = None,
    ):
        """Check the job can start here, then create its run directory under ``runs_root``. ``rendezvous``:
        this is node 0 of a multi-node job, hosting its rendezvous (`phalanx agent --node-rank 0`)."""
        if spec.resources.nodes + spec.resources.spare_nodes > 1 and rendezvous is None:
            raise LaunchError(
                f"resources.nodes = {spec.resources.nodes} (spare_nodes = {spec.resources.spare_nodes}): "
                "`phalanx run` runs one node on this machine; use nodes: 1, or `phalanx run JOB.yaml "
                "--local-nodes` to run every node on this machine (an agent process per node), or `phalanx agent "
                "JOB.yaml --rdzv HOST:PORT --node-rank N` on each machine (docs/multinode.md)"
            )
        self.spec = spec
        self.device = resolve_device(spec.resources.device, spec.resources.procs_per_node)
        self.run_dir = RunDir.create(runs_root, spec.name)
        self.console = Console(console, copy=self.run_dir.supervisor_log)
        self.progress = ProgressFeed(self.run_dir.metrics, spec.train.steps if spec.train is not None else None)
        self.started = time.monotonic()
        self.restarts = 0
        self.events = EventLog(self.run_dir.events)
        self._signals: list[int] = []
        self._relayed = 0  # of _signals, those an agent handed over (not sent to this process)
        self.hangs = HangDetector(spec.resilience.hang_timeout_s)
        self.stragglers = StragglerDetector(spec.resilience.straggler_factor)
        self.ranks = RankFigures(self.run_dir)
        self.rendezvous = rendezvous
        me = this_agent(rendezvous.addr if rendezvous else "127.0.0.1")
        self.agents = Agents(
            me,
            Rendezvous(rendezvous.store) if rendezvous else None,
            spec.resilience.node_timeout_s,
            Tethers(rendezvous.addr) if rendezvous else None,
        )
        self.members = Membership(spec, self.run_dir, self.agents, self.device, self.say, self.events)
        self.stops = Stops(spec, self.run_dir, self.agents, self.say, self.events)

    @property
    def multi_node(self) -> bool:
        return self.rendezvous is not None

    def say(self, message: str) -> None:
        self.console.line(f"[phalanx] {message}")

    def _show_progress(self) -> None:
        """New steps: on a terminal into the live status line; elsewhere as a line each."""
        for record in self.progress.poll():
            if not self.console.live:
                self.console.line(step_line(record, self.progress.total_steps))
        self.console.status(self.progress.status(time.monotonic() - self.started, self.restarts))

    def run(self) -> RunResult:
        self.run_dir.spec.write_text(dump_spec(self.spec))
        self.events.emit(
            Event.RUN_STARTED,
            run_id=self.run_dir.run_id,
            world_size=self.spec.resources.world_size,
            device=self.device,
            argv=worker_argv(self.spec),
        )
        beat = None
        with recorded_signals(self._signals):  # forwarded to the workers by the attempt loop
            try:
                if self.rendezvous is not None:
                    beat = Heartbeat(
                        lambda: Rendezvous(
                            join_store(self.rendezvous.addr, self.rendezvous.store.port, STORE_TIMEOUT_S)
                        ),
                        "coordinator/beat",
                    )
                    hosted, stopped = self.rendezvous, lambda: bool(self._signals)
                    gathered = self.members.gather(hosted.addr, hosted.store.port, hosted.join_timeout_s, stopped)
                    result = gathered or self._attempts()
                else:
                    result = self._attempts()
            finally:
                self._show_progress()
                self.console.end_status()
                self.ranks.flush(time.monotonic(), due=True)
        self.events.emit(Event.RUN_FINISHED, **result.to_json())
        self.run_dir.write_result(result)
        ledger = write_ledger(self.run_dir)
        try:
            plot = plot_loss(self.run_dir)
        except Exception as e:  # a plot is a convenience: it never fails a run that ran
            self.say(f"no loss curve: {type(e).__name__}: {e}")
            plot = None
        self.console.show(summary(self.run_dir, ledger, self.progress.latest, self.progress.total_steps, plot))
        self.agents.finish(result.exit_code, result.reason)
        if beat is not None:
            beat.stop()
        if self.agents.tethers is not None:
            self.agents.tethers.close()
        return result

    def _attempts(self) -> RunResult:
        """Run attempts until one succeeds, a signal stops the job, or a failure is not worth retrying
        (a user error, or the restart budget is spent). Each restart resumes from the last valid checkpoint."""
        policy = self.spec.resilience
        attempt = 0
        while True:
            result, failure = self._attempt(attempt)
            attempt += 1
            restarts = self.restarts  # in-process recoveries count too
            result = replace(result, restarts=restarts)
            if failure is None:
                return result
            if failure is REGROW:
                self.members.regrow(attempt)
                continue
            if not failure.retryable:
                self.say(f"not restarting: {failure.why}")
                return replace(result, reason=f"{result.reason} (a user error: not retried)")
            if restarts >= policy.max_restarts:
                self.say(f"not restarting: all {policy.max_restarts} restart(s) of resilience.max_restarts used")
                return replace(result, reason=f"{result.reason} (after {restarts} restart(s))")
            restarts = self.restarts = restarts + 1
            try:
                self.members.after_failure(result.failed_rank, result.failed_node, result.node_lost, attempt)
            except NoCapacity as e:
                self.say(f"not restarting: {e}")
                return replace(result, reason=f"{result.reason} ({e})")
            wait = backoff_s(restarts, policy.restart_backoff_s)
            self.say(f"restart {restarts}/{policy.max_restarts} in {wait:g} s, from the last valid checkpoint")
            self.events.emit(
                Event.RESTART_SCHEDULED,
                restart=restarts,
                backoff_s=wait,
                failure=failure.kind,
                cause=failure.why,
                category=failure.category,
                reason=result.reason,
            )
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not self._signals:
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if self._signals:
                name = signal.Signals(self._signals[0]).name
                self.say(f"stopped by {name} before restarting")
                stopped = RunResult(Outcome.STOPPED, 128 + self._signals[0], f"stopped by {name}", result.run_dir)
                return replace(stopped, restarts=restarts)

    def _attempt(self, attempt: int) -> Stopped | tuple[RunResult, None]:
        store = host_store(self.agents.me.addr, 0, STORE_TIMEOUT_S)
        plan = self.members.plan(attempt, store.port)
        me = self.agents.me.node
        spec = self.members.attempt_spec
        local = node_workers(plan, me, spec, self.run_dir) if me in plan.members else []
        run = AttemptRun(self.agents, plan, local, self.console.line)
        recovery: Recovery | None = None
        if spec.resilience.in_process and self.agents.rdzv is not None:
            recovery = NodeRecovery(spec, plan, self.run_dir, store, self.agents.rdzv)
        elif spec.resilience.in_process and me in plan.members:
            recovery = RankRecovery(spec, plan, me, self.run_dir, run.group, store)
        try:
            return self._run_attempt(attempt, store, plan, run, recovery)
        finally:
            if isinstance(recovery, RankRecovery):
                recovery.spares.stop()

    def _run_attempt(
        self, attempt: int, store: TCPStore, plan: Plan, run: AttemptRun, recovery: Recovery | None
    ) -> Stopped | tuple[RunResult, None]:
        where = f"{plan.world_size} worker(s) on {self.device}"
        if self.multi_node:
            where += f" on {len(plan.members)} node(s) ({', '.join(self.agents.name(n) for n in plan.members)})"
        self.say(
            (f"run {self.run_dir.run_id}" if attempt == 0 else f"attempt {attempt}") + f": {where}, logs in "
            f"{self.run_dir.logs}"
        )
        lost = run.start(header=f"attempt {attempt}")
        self.events.emit(
            Event.ATTEMPT_STARTED,
            attempt=attempt,
            rendezvous_addr=plan.master_addr,
            rendezvous_port=store.port,
            pids=run.pids,
            nodes={str(g): n for g, n in enumerate(plan.members)},
        )
        if lost is not None:
            return self.stops.lost(run, lost)
        if isinstance(recovery, RankRecovery):
            recovery.spares.start(self.spec.resilience.warm_spares)
        self.hangs.reset()
        self.stragglers.reset()
        next_hang_check = time.monotonic()
        while True:
            self._show_progress()
            if not self._signals and self.multi_node and (sig := self.agents.signalled()) is not None:
                self.say(f"{signal.Signals(sig).name} reached an agent: stopping the job on every node")
                self._signals.append(sig)
                self._relayed = 1
            if self._signals:
                # A second signal sent here kills at once. On Slurm every agent is sent the same SIGTERM: the one
                # an agent handed over first, then this process's own, is still one.
                again = lambda: len(self._signals) - self._relayed > 1  # noqa: E731
                return self.stops.signalled(run, self._signals[0], again), None
            if isinstance(recovery, RankRecovery):
                recovery.spares.adopt()
            ended, how = run.poll()
            if isinstance(how, NodeLost):
                if isinstance(recovery, NodeRecovery) and self._recover(run, how, store, recovery):
                    continue
                return self.stops.lost(run, how)
            if isinstance(how, RankFailed):
                if recovery is not None and self._recover(run, how, store, recovery):
                    continue
                return self.stops.rank_failed(run, how, store)
            if recovery is not None and (pending := recovery.pending) is not None:
                if recovery.done():
                    took = time.monotonic() - pending.began
                    self.say(f"recovered in process: every rank restored {took:.2f} s after {pending.who} failed")
                elif recovery.overdue():
                    return self.stops.recovery_stalled(run, recovery)
            if ended:
                run.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)  # nothing left running: collects exits
                self.say(f"succeeded: all {plan.world_size} worker(s) exited with code 0")
                return RunResult(Outcome.SUCCEEDED, 0, "all workers exited with code 0", str(self.run_dir.root)), None
            if time.monotonic() >= next_hang_check:
                next_hang_check = time.monotonic() + HANG_CHECK_S
                if (stall := self._stalled(store, run.plan)) is not None:
                    return self.stops.hang(run, stall)
                if self.members.regrow_due(self.hangs.first_progress, self.hangs.latest_step, time.monotonic()):
                    regrow_after_s = self.members.capacity.regrow_after_s
                    return self.stops.to_regrow(run, regrow_after_s or 0.0, self.members.full)
                if self.multi_node:
                    self.members.poll_spares()
                if isinstance(recovery, NodeRecovery):
                    for node, after_s in recovery.newly_ready(self.members.nodes.spares):
                        self.say(f"{self.agents.name(node)}'s warm spares are ready ({after_s:.1f} s)")
                        self.events.emit(Event.SPARES_READY, node=node, after_s=after_s)
            time.sleep(POLL_S)

    def _stalled(self, store: TCPStore, plan: Plan) -> Stall | None:
        """Read the heartbeats: report a straggler if one appeared; return the hang if there is one."""
        now = time.monotonic()
        for rank in range(plan.world_size):
            if (beat := last_heartbeat(store, rank)) is not None:
                self.ranks.observe(rank, plan.node_of(rank), beat)
                self.hangs.observe(rank, beat["step"], now)
                if beat.get("compute_s") is not None:
                    self.stragglers.observe(rank, beat["step"], beat["compute_s"])
        self.ranks.flush(now)
        if (slow := self.stragglers.check()) is not None:
            node = plan.node_of(slow.rank)
            self.say(
                f"{self.stops.where(slow.rank, plan)} is a straggler: {slow.compute_s * 1e3:.1f} ms of compute per "
                f"step, {slow.ratio:.2f}x the other ranks' {slow.others_s * 1e3:.1f} ms (median of the last "
                f"{STRAGGLER_WINDOW} steps); every step waits for it"
            )
            self.events.emit(
                Event.STRAGGLER,
                rank=slow.rank,
                node=node,
                **self.agents.where(node),
                compute_s=slow.compute_s,
                others_s=slow.others_s,
            )
        return self.hangs.stalled(now)

    def _recover(self, run: AttemptRun, how: NodeLost | RankFailed, store: TCPStore, recovery: Recovery) -> bool:
        """Recover in process (launch/recovery.py): on one node a warm spare takes a dead rank's place; on
        several a spare node's warm spares take a lost node's ranks, or those of a node whose rank crashed (a
        GPU failure, say: that node is a spare from then on). The survivors keep their processes. False: the
        restart path (a user error, the restart budget spent, or a reason recovery gives), which says why."""
        node, name = how.node, self.agents.name(how.node)
        if isinstance(how, RankFailed):
            cause, detail, failure = self.stops.what_failed(how, store)
            what = (
                f"rank {how.rank} {cause}"
                if isinstance(recovery, RankRecovery)
                else f"rank {how.rank} on {name} {cause}"
            )
        else:
            what = f"{name} lost: {how.why}"
            failure = Failure(Kind.INFRASTRUCTURE, what, "node_lost")
        if not failure.retryable or self.restarts >= self.spec.resilience.max_restarts:
            return False
        reached, spare = self._reached(store, run.plan), next(iter(self.members.nodes.spares), None)
        if isinstance(recovery, RankRecovery):
            why = recovery.refuse(reached)
        elif isinstance(recovery, NodeRecovery):
            hosts = (
                "node 0 hosts the job: its ranks are not replaced in process" if node == self.agents.me.node else None
            )
            why = hosts or recovery.refuse(reached, spare)
        if why is not None:
            self.say(f"{what}; not recovering in process: {why}")
            self.events.emit(Event.IN_PROCESS_REFUSED, rank=getattr(how, "rank", None), node=node, why=why)
            return False
        if isinstance(how, RankFailed):
            self.stops.worker_failed(how, detail, failure, then=[])
        else:
            self.events.emit(Event.NODE_LOST, node=node, **self.agents.where(node), silent_s=how.silent_s,
                             closed=how.closed, then=[])  # fmt: skip
        more: dict[str, int] = {}
        if isinstance(recovery, RankRecovery):
            pending, pid = recovery.begin(how.rank, reached)  # type: ignore[union-attr]
            run.pids[pending.ranks[0]] = pid
            took = f"a warm spare (pid {pid}) takes it"
        else:
            assert isinstance(recovery, NodeRecovery) and spare is not None
            if isinstance(how, RankFailed):
                self.agents.rdzv.put(run.key("evict", node), True)  # type: ignore[union-attr]  # the spares' now
            pending, pids = recovery.begin(node, spare, reached)
            run.replace(node, spare, pids)
            took = f"the warm spares of {self.agents.name(spare)} take its ranks {', '.join(map(str, pending.ranks))}"
            more = {"node": node, "spare_node": spare}
        self.restarts += 1
        self.say(f"{what}; recovery {self.restarts}/{self.spec.resilience.max_restarts} in process: {took}, "
                 "the state comes from memory (or storage, where no snapshot will do)")  # fmt: skip
        self.events.emit(
            Event.RECOVERY_STARTED, attempt=run.plan.attempt, restart=self.restarts, generation=pending.generation,
            rank=pending.ranks[0], ranks=pending.ranks, pids=run.pids, failure=failure.kind, cause=failure.why,
            category=failure.category, reason=what, **more,
        )  # fmt: skip
        self.hangs.reset()  # the ranks go back to the snapshot's step
        if more:
            self.members.replaced(node, lost=isinstance(how, NodeLost))
        return True

    @staticmethod
    def _reached(store: TCPStore, plan: Plan) -> int:
        """The steps the job had completed: the furthest step any rank reported."""
        return max((s for r in range(plan.world_size) if (s := last_step(store, r)) is not None), default=-1) + 1
