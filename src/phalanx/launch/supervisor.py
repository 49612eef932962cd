"""The job's supervisor: the attempt loop of one job, on one node or many. It runs on node 0 (``phalanx run``,
or ``phalanx agent --node-rank 0``): it starts each attempt on the member nodes (launch/fleet.py), watches
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

import contextlib
import enum
import hashlib
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from torch.distributed import TCPStore

from phalanx.launch.fleet import AttemptRun, Fleet, LaunchError, NodeLost, RankFailed, this_agent
from phalanx.launch.membership import Membership
from phalanx.launch.node import Plan, node_workers, worker_argv
from phalanx.launch.recovery import InProcessRecovery
from phalanx.launch.rendezvous import Heartbeat, Rendezvous, host_store, join_store
from phalanx.launch.workers import describe_exit
from phalanx.obs import EventLog
from phalanx.obs.console import Console
from phalanx.obs.goodput import write_ledger
from phalanx.obs.plot import plot_loss
from phalanx.obs.progress import Progress, step_line
from phalanx.obs.protocol import HEARTBEAT_KEY
from phalanx.obs.rundir import RunDir
from phalanx.obs.summary import summary
from phalanx.resilience import Failure, HangDetector, Kind, Stall, StragglerDetector, backoff_s, classify_exit, hang
from phalanx.resilience.elastic import NoCapacity
from phalanx.resilience.straggler import WINDOW as STRAGGLER_WINDOW
from phalanx.spec import JobSpec, dump_spec

POLL_S = 0.1  # how often exits and signals are checked: a crash is seen within this
HANG_CHECK_S = 0.5  # how often the heartbeats are read
STACK_DUMP_S = 2.0  # how long hung workers get to write their stacks before they are killed
STORE_TIMEOUT_S = 300.0
REGROW = Failure(Kind.INFRASTRUCTURE, "stopped to grow back", "regrow")  # not a failure: the attempt ends on purpose


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RunResult:
    outcome: Outcome
    exit_code: int  # 0 succeeded, 1 a worker failed, 128 + signal when stopped by a signal
    reason: str
    run_dir: str
    failed_rank: int | None = None
    failed_node: int | None = None  # the node of the failed rank, or the node lost
    node_lost: bool = False
    restarts: int = 0


def resolve_device(requested: str, procs_per_node: int) -> str:
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        have = torch.cuda.device_count()
        if have < procs_per_node:
            raise LaunchError(
                f"resources.device = cuda with procs_per_node = {procs_per_node}, but this machine has {have} "
                f"CUDA device(s); use procs_per_node <= {have} or device: cpu"
            )
    return requested


def spec_digest(spec: JobSpec) -> str:
    """Every agent must run the same spec: they compare this."""
    return hashlib.sha256(dump_spec(spec).encode()).hexdigest()[:16]


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
        self.console = Console(console)
        self.progress = Progress(self.run_dir.metrics, spec.train.steps if spec.train is not None else None)
        self.started = time.monotonic()
        self.restarts = 0
        self.events = EventLog(self.run_dir.events)
        self._signals: list[int] = []
        self._relayed = 0  # of _signals, those an agent handed over (not sent to this process)
        self.hangs = HangDetector(spec.resilience.hang_timeout_s)
        self.stragglers = StragglerDetector(spec.resilience.straggler_factor)
        self.rendezvous = rendezvous
        me = this_agent(rendezvous.addr if rendezvous else "127.0.0.1")
        self.fleet = Fleet(me, Rendezvous(rendezvous.store) if rendezvous else None, spec.resilience.node_timeout_s)
        self.members = Membership(spec, self.run_dir, self.fleet, self.device, self.say, self.events)

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
            "run_started",
            run_id=self.run_dir.run_id,
            world_size=self.spec.resources.world_size,
            device=self.device,
            argv=worker_argv(self.spec),
        )
        beat = None
        with self._forwarded_signals():
            try:
                if self.rendezvous is not None:
                    beat = Heartbeat(
                        lambda: Rendezvous(
                            join_store(self.rendezvous.addr, self.rendezvous.store.port, STORE_TIMEOUT_S)
                        ),
                        "coordinator/beat",
                    )
                    result = self._gather_nodes() or self._attempts()
                else:
                    result = self._attempts()
            finally:
                self._show_progress()
                self.console.end_status()
        self.events.emit("run_finished", **asdict(result))
        self.run_dir.result.write_text(json.dumps(asdict(result), indent=2) + "\n")
        ledger = write_ledger(self.run_dir)
        try:
            plot = plot_loss(self.run_dir)
        except Exception as e:  # a plot is a convenience: it never fails a run that ran
            self.say(f"no loss curve: {type(e).__name__}: {e}")
            plot = None
        self.console.show(summary(self.run_dir, ledger, self.progress.latest, self.progress.total_steps, plot))
        self.fleet.finish(result.exit_code, result.reason)
        if beat is not None:
            beat.stop()
        return result

    def _gather_nodes(self) -> RunResult | None:
        """Publish the run and wait for every node's agent to join; a failed result if they cannot."""
        assert self.fleet.rdzv is not None and self.rendezvous is not None
        res = self.spec.resources
        self.fleet.rdzv.put(
            "run",
            {
                "run_dir": str(self.run_dir.root),
                "digest": spec_digest(self.spec),
                "nodes": res.nodes,
                "spare_nodes": res.spare_nodes,
            },
        )
        self.say(
            f"run {self.run_dir.run_id}: waiting for {res.nodes - 1} more node(s) at "
            f"{self.rendezvous.addr}:{self.rendezvous.store.port} (and up to {res.spare_nodes} spare(s))"
        )
        try:
            self.fleet.wait_for(list(range(1, res.nodes)), self.rendezvous.join_timeout_s, lambda: bool(self._signals))
        except LaunchError as e:
            self.say(f"cannot start: {e}")
            return RunResult(Outcome.FAILED, 1, str(e), str(self.run_dir.root))
        self.members.poll_spares()
        self.events.emit("nodes_joined", **self.members.record())
        return None

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
                "restart_scheduled",
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

    def _stop_to_regrow(self, run: AttemptRun) -> tuple[RunResult, Failure]:
        """Stop a shrunk attempt that has trained for regrow_after_s (SIGTERM: the recipe checkpoints first)."""
        capacity = self.members.capacity
        self.say(
            f"{len(run.pids)} process(es) trained for {capacity.regrow_after_s:g} s since the shrink: "
            f"stopping them (SIGTERM, they checkpoint) to try all {capacity.full} again"
        )
        self.events.emit("regrow_stop", procs=len(run.pids), after_s=capacity.regrow_after_s)
        run.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)
        return RunResult(Outcome.STOPPED, 0, "stopped to grow back", str(self.run_dir.root)), REGROW

    def _attempt(self, attempt: int) -> tuple[RunResult, Failure | None]:
        store = host_store(self.fleet.me.addr, 0, STORE_TIMEOUT_S)
        plan = self.members.plan(attempt, store.port)
        me = self.fleet.me.node
        spec = self.members.attempt_spec
        local = node_workers(plan, me, spec, self.run_dir) if me in plan.members else []
        run = AttemptRun(self.fleet, plan, local, self.console.line)
        recovery = None
        if spec.resilience.in_process and me in plan.members:
            recovery = InProcessRecovery(spec, plan, me, self.run_dir, run.group, store)
        try:
            return self._run_attempt(attempt, store, plan, run, recovery)
        finally:
            if recovery is not None:
                recovery.stop_spares()

    def _run_attempt(
        self, attempt: int, store: TCPStore, plan: Plan, run: AttemptRun, recovery: InProcessRecovery | None
    ) -> tuple[RunResult, Failure | None]:
        where = f"{plan.world_size} worker(s) on {self.device}"
        if self.multi_node:
            where += f" on {len(plan.members)} node(s) ({', '.join(self.fleet.name(n) for n in plan.members)})"
        self.say(
            (f"run {self.run_dir.run_id}" if attempt == 0 else f"attempt {attempt}") + f": {where}, logs in "
            f"{self.run_dir.logs}"
        )
        lost = run.start(header=f"attempt {attempt}")
        self.events.emit(
            "attempt_started",
            attempt=attempt,
            rendezvous_addr=plan.master_addr,
            rendezvous_port=store.port,
            pids=run.pids,
            nodes={str(g): n for g, n in enumerate(plan.members)},
        )
        if lost is not None:
            return self._stop_on_lost(run, lost)
        if recovery is not None:
            recovery.start_spares()
        self.hangs.reset()
        self.stragglers.reset()
        next_hang_check = time.monotonic()
        while True:
            self._show_progress()
            if not self._signals and self.multi_node and (sig := self.fleet.signalled()) is not None:
                self.say(f"{signal.Signals(sig).name} reached an agent: stopping the job on every node")
                self._signals.append(sig)
                self._relayed = 1
            if self._signals:
                return self._stop_on_signal(run), None
            if recovery is not None:
                recovery.adopt()
            ended, how = run.poll()
            if isinstance(how, NodeLost):
                return self._stop_on_lost(run, how)
            if isinstance(how, RankFailed):
                if recovery is not None and self._recover_in_process(run, how, store, recovery):
                    continue
                return self._stop_on_failure(run, how, store)
            if recovery is not None and (pending := recovery.pending) is not None:
                if recovery.done():
                    took = time.monotonic() - pending.began
                    self.say(f"recovered in process: every rank restored {took:.2f} s after rank {pending.rank} died")
                elif recovery.overdue():
                    return self._stop_on_stalled_recovery(run, recovery)
            if ended:
                run.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)  # nothing left running: collects exits
                self.say(f"succeeded: all {plan.world_size} worker(s) exited with code 0")
                return RunResult(Outcome.SUCCEEDED, 0, "all workers exited with code 0", str(self.run_dir.root)), None
            if time.monotonic() >= next_hang_check:
                next_hang_check = time.monotonic() + HANG_CHECK_S
                if (stall := self._stalled(store, plan)) is not None:
                    return self._stop_on_hang(run, stall)
                if self.members.regrow_due(self.hangs.first_progress, self.hangs.latest_step, time.monotonic()):
                    return self._stop_to_regrow(run)
                if self.multi_node:
                    self.members.poll_spares()
            time.sleep(POLL_S)

    def where(self, rank: int, plan: Plan) -> str:
        """Rank, node rank and host of a rank, in words."""
        agent = self.fleet.agents.get(plan.node_of(rank), self.fleet.me)
        return f"rank {rank} on node {agent.node} ({agent.addr}, host {agent.host})"

    def _stalled(self, store: TCPStore, plan: Plan) -> Stall | None:
        """Read the heartbeats: report a straggler if one appeared; return the hang if there is one."""
        now = time.monotonic()
        for rank in range(plan.world_size):
            if (beat := last_heartbeat(store, rank)) is not None:
                self.hangs.observe(rank, beat["step"], now)
                if beat.get("compute_s") is not None:
                    self.stragglers.observe(rank, beat["step"], beat["compute_s"])
        if (slow := self.stragglers.check()) is not None:
            node = plan.node_of(slow.rank)
            self.say(
                f"{self.where(slow.rank, plan)} is a straggler: {slow.compute_s * 1e3:.1f} ms of compute per step, "
                f"{slow.ratio:.2f}x the other ranks' {slow.others_s * 1e3:.1f} ms (median of the last "
                f"{STRAGGLER_WINDOW} steps); every step waits for it"
            )
            self.events.emit(
                "straggler",
                rank=slow.rank,
                node=node,
                **self.fleet.where(node),
                compute_s=slow.compute_s,
                others_s=slow.others_s,
            )
        return self.hangs.stalled(now)

    def _stop_on_hang(self, run: AttemptRun, stall: Stall) -> tuple[RunResult, Failure]:
        """Dump every rank's Python stacks (on every node) into the run directory, then kill them all: a
        collective stalled on a peer cannot be aborted in place. A rank that does not answer the dump (stopped,
        or stuck in the kernel) is the hung one; otherwise the rank behind the others is named."""
        plan = run.plan
        self.say(
            f"no progress for {stall.silent_s:.1f} s (hang timeout {stall.timeout_s:.1f} s): dumping every rank's "
            f"Python stacks to {self.run_dir.logs}/rank-<r>.stacks.txt, then killing the workers"
        )
        ranks = range(plan.world_size)
        before = {r: _size(self.run_dir.stacks(r)) for r in ranks}
        run.dump_stacks()
        time.sleep(STACK_DUMP_S)
        run.stop(signal.SIGKILL, 0)
        dumped = [r for r in ranks if _size(self.run_dir.stacks(r)) > before[r]]
        unresponsive = [r for r in ranks if r not in dumped]
        if unresponsive:
            stall = replace(stall, rank=unresponsive[0])
        failure = hang(stall)
        node = plan.node_of(stall.rank)
        self.events.emit(
            "hang_detected",
            rank=stall.rank,
            node=node,
            **self.fleet.where(node),
            step=stall.step,
            silent_s=stall.silent_s,
            timeout_s=stall.timeout_s,
            stacks=[str(self.run_dir.stacks(r)) for r in dumped],
            unresponsive=unresponsive,
        )
        if unresponsive:
            self.say(f"rank(s) {', '.join(map(str, unresponsive))} did not answer the stack dump: not running")
        reason = f"rank {stall.rank} {failure.why}"
        self.say(f"failed: {self.where(stall.rank, plan)} {failure.why}")
        result = RunResult(Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_rank=stall.rank, failed_node=node)
        return result, failure

    def _stop_on_lost(
        self, run: AttemptRun, lost: NodeLost, then: list[str] | None = None
    ) -> tuple[RunResult, Failure]:
        """A member node's agent stopped beating (its machine is gone): kill the workers everywhere else (their
        collectives cannot complete) and name the node."""
        why = (
            f"lost: no heartbeat from its agent for {lost.silent_s:.1f} s "
            f"(resilience.node_timeout_s {self.fleet.timeout_s:g})"
        )
        name = self.fleet.name(lost.node)
        if then is None:
            self.say(f"{name} {why}; killing the workers on the other nodes")
            run.stop(signal.SIGKILL, 0)
        self.events.emit(
            "node_lost",
            node=lost.node,
            **self.fleet.where(lost.node),
            silent_s=lost.silent_s,
            then=then or [],
        )
        reason = f"{name} {why}"
        self.say(f"failed: {reason}")
        result = RunResult(Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_node=lost.node, node_lost=True)
        return result, Failure(Kind.INFRASTRUCTURE, reason, "node_lost")

    def _what_failed(self, first: RankFailed, store: TCPStore) -> tuple[str, str, Failure]:
        """How a rank ended ("killed by SIGKILL after step 24"), the error it recorded, and what kind of
        failure that makes."""
        step = last_step(store, first.rank)
        cause = describe_exit(first.returncode) + (f" after step {step}" if step is not None else "")
        detail = recorded_error(self.run_dir.error_file(first.rank))
        return cause, detail, classify_exit(first.returncode, detail)

    def _worker_failed(self, first: RankFailed, detail: str, failure: Failure, then: list[str]) -> None:
        self.events.emit(
            "worker_failed",
            rank=first.rank,
            node=first.node,
            pid=first.pid,
            returncode=first.returncode,
            error=detail or None,
            failure=failure.kind,
            then=then,
        )

    def _stop_on_failure(self, run: AttemptRun, first: RankFailed, store: TCPStore) -> tuple[RunResult, Failure]:
        cause, detail, failure = self._what_failed(first, store)
        on = f" on {self.fleet.name(first.node)}" if self.multi_node else ""
        self.say(f"rank {first.rank}{on} (pid {first.pid}) {cause}; stopping the other workers")
        codes = run.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)
        others = [
            f"rank {rank} {describe_exit(code)}" for rank, code in sorted(codes.items()) if rank != first.rank and code
        ]
        if run.lost:  # a node gone is the root cause; this rank's exit was its first consequence
            return self._stop_on_lost(run, run.lost[0], then=[f"rank {first.rank} {cause}", *others])
        self._worker_failed(first, detail, failure, then=others)
        tail = _tail(self.run_dir.log(first.rank), 15)
        self.say(
            f"failed: rank {first.rank}{on} {cause}"
            + (f": {detail}" if detail else "")
            + (f"\n  last lines of {self.run_dir.log(first.rank)}:\n" + tail if tail else "")
        )
        reason = f"rank {first.rank} {cause}" + (f": {detail}" if detail else "")
        result = RunResult(
            Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_rank=first.rank, failed_node=first.node
        )
        return result, failure

    def _recover_in_process(
        self, run: AttemptRun, first: RankFailed, store: TCPStore, recovery: InProcessRecovery
    ) -> bool:
        """A rank died: put a warm spare in its place and let the survivors recover in their processes (see
        launch/recovery.py). False: this failure takes the restart path (a user error, the restart budget
        spent, or a reason recovery gives), which says why."""
        cause, detail, failure = self._what_failed(first, store)
        policy = self.spec.resilience
        if not failure.retryable or self.restarts >= policy.max_restarts:
            return False
        plan = run.plan
        steps = [s for r in range(plan.world_size) if (s := last_step(store, r)) is not None]
        reached = max(steps, default=-1) + 1
        if (why := recovery.refuse(reached)) is not None:
            self.say(f"rank {first.rank} {cause}; not recovering in process: {why}")
            self.events.emit("in_process_refused", rank=first.rank, why=why)
            return False
        self._worker_failed(first, detail, failure, then=[])
        pending = recovery.begin(first.rank, reached)
        assert pending.spare.proc is not None
        self.restarts += 1
        run.pids[first.rank] = pending.spare.proc.pid
        self.say(
            f"rank {first.rank} (pid {first.pid}) {cause}; recovery {self.restarts}/{policy.max_restarts} in "
            f"process: a warm spare (pid {pending.spare.proc.pid}) takes rank {first.rank}, the state comes "
            "from memory"
        )
        self.events.emit(
            "recovery_started",
            attempt=plan.attempt,
            restart=self.restarts,
            generation=pending.generation,
            rank=first.rank,
            pids=run.pids,
            failure=failure.kind,
            cause=failure.why,
            category=failure.category,
            reason=f"rank {first.rank} {cause}",
        )
        self.hangs.reset()  # the ranks go back to the snapshot's step
        return True

    def _stop_on_stalled_recovery(self, run: AttemptRun, recovery: InProcessRecovery) -> tuple[RunResult, Failure]:
        """A recovery in process did not finish in time (a survivor stuck in a collective gloo cannot abort,
        a spare that did not join): kill the workers; the job restarts from its last checkpoint."""
        pending, timeout = recovery.pending, self.spec.resilience.recovery_timeout_s
        assert pending is not None
        waiting = ", ".join(map(str, recovery.not_done()))
        why = f"did not recover in process within {timeout:g} s (recovery_timeout_s; rank(s) {waiting} not back)"
        self.say(f"rank {pending.rank}'s recovery {why}: killing the workers, restarting from the last checkpoint")
        run.stop(signal.SIGKILL, 0)
        self.events.emit("recovery_stalled", rank=pending.rank, generation=pending.generation, timeout_s=timeout)
        reason = f"rank {pending.rank} {why}"
        result = RunResult(
            Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_rank=pending.rank, failed_node=self.fleet.me.node
        )
        return result, Failure(Kind.INFRASTRUCTURE, reason, "hang")

    def _stop_on_signal(self, run: AttemptRun) -> RunResult:
        sig = self._signals[0]
        name = signal.Signals(sig).name
        self.say(
            f"received {name}: forwarding it to {len(run.pids)} worker(s), "
            f"{self.spec.resilience.stop_grace_s:g} s before SIGKILL (send it again to kill now)"
        )
        self.events.emit("signal_received", signal=name)
        # A second signal sent here kills at once. On Slurm every agent is sent the same SIGTERM: the one an
        # agent handed over first, then this process's own, is still one.
        run.stop(sig, self.spec.resilience.stop_grace_s, abort=lambda: len(self._signals) - self._relayed > 1)
        self.say(f"stopped by {name}")
        return RunResult(Outcome.STOPPED, 128 + sig, f"stopped by {name}", str(self.run_dir.root))

    @contextlib.contextmanager
    def _forwarded_signals(self):
        """Record SIGINT/SIGTERM for the loop to forward instead of dying on them; restore the handlers after."""
        caught = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, lambda signum, _frame: self._signals.append(signum)) for sig in caught}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def last_heartbeat(store: TCPStore, rank: int) -> dict[str, Any] | None:
    """The last heartbeat ``rank`` sent through the worker SDK ({step, ts, compute_s}), if it sent any."""
    key = HEARTBEAT_KEY.format(rank=rank)
    return json.loads(store.get(key)) if store.check([key]) else None


def last_step(store: TCPStore, rank: int) -> int | None:
    beat = last_heartbeat(store, rank)
    return beat["step"] if beat is not None else None


def recorded_error(error_file: Path) -> str:
    """The root cause a worker wrote with torch's ``@record`` (elastic error-file format), or ""."""
    try:
        message = json.loads(error_file.read_text()).get("message", "")
    except (OSError, ValueError):
        return ""
    return message.get("message", "") if isinstance(message, dict) else str(message)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])
