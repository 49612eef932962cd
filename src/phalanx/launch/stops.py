"""How an attempt stops, in one place: for each thing the supervisor acts on (a rank that died, a hang, a lost
node, a recovery in process that stalled, a shrunk attempt stopped to grow back), what is done to the workers,
the event written, and the words: one reason for the console, the events and result.json, and the Failure
the restart policy decides on. Every failing stop ends the same way (``_failed``)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from torch.distributed import TCPStore

from phalanx.launch.attempt import Agents, AttemptRun, NodeLost, RankFailed
from phalanx.launch.node import Plan
from phalanx.launch.recovery import Recovery
from phalanx.launch.workers import describe_exit
from phalanx.obs import EventLog
from phalanx.obs.events import Event
from phalanx.obs.protocol import last_step
from phalanx.obs.rundir import Outcome, RunDir, RunResult
from phalanx.resilience import Failure, Kind, Stall, classify_exit, hang
from phalanx.spec import JobSpec

STACK_DUMP_S = 2.0  # how long hung workers get to write their stacks before they are killed
REGROW = Failure(Kind.INFRASTRUCTURE, "stopped to grow back", "regrow")  # not a failure: the attempt ends on purpose

Stopped = tuple[RunResult, Failure]


class Stops:
    def __init__(self, spec: JobSpec, run_dir: RunDir, agents: Agents, say: Callable[[str], None], events: EventLog):
        self.spec, self.run_dir, self.agents, self.say, self.events = spec, run_dir, agents, say, events
        self.multi_node = agents.rdzv is not None

    def where(self, rank: int, plan: Plan) -> str:
        """Rank, node rank and host of a rank, in words."""
        agent = self.agents.joined.get(plan.node_of(rank), self.agents.me)
        return f"rank {rank} on node {agent.node} ({agent.addr}, host {agent.host})"

    def _failed(self, reason: str, failure: Failure, said: str | None = None, **fields) -> Stopped:
        self.say(f"failed: {said or reason}")
        return RunResult(Outcome.FAILED, 1, reason, str(self.run_dir.root), **fields), failure

    def hang(self, run: AttemptRun, stall: Stall) -> Stopped:
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
            Event.HANG_DETECTED,
            rank=stall.rank,
            node=node,
            **self.agents.where(node),
            step=stall.step,
            silent_s=stall.silent_s,
            timeout_s=stall.timeout_s,
            stacks=[str(self.run_dir.stacks(r)) for r in dumped],
            unresponsive=unresponsive,
        )
        if unresponsive:
            self.say(f"rank(s) {', '.join(map(str, unresponsive))} did not answer the stack dump: not running")
        said = f"{self.where(stall.rank, plan)} {failure.why}"
        return self._failed(f"rank {stall.rank} {failure.why}", failure, said, failed_rank=stall.rank, failed_node=node)

    def lost(self, run: AttemptRun, lost: NodeLost, then: list[str] | None = None) -> Stopped:
        """A member node's agent died or stopped beating (its machine is gone): kill the workers everywhere else
        (their collectives cannot complete) and name the node. ``then``: what failed next, already stopped."""
        why = f"lost: {lost.why}" + ("" if lost.closed else f" (resilience.node_timeout_s {self.agents.timeout_s:g})")
        name = self.agents.name(lost.node)
        if then is None:
            self.say(f"{name} {why}; killing the workers on the other nodes")
            run.stop(signal.SIGKILL, 0)
        self.events.emit(
            Event.NODE_LOST,
            node=lost.node,
            **self.agents.where(lost.node),
            silent_s=lost.silent_s,
            closed=lost.closed,
            then=then or [],
        )
        reason = f"{name} {why}"
        return self._failed(
            reason, Failure(Kind.INFRASTRUCTURE, reason, "node_lost"), failed_node=lost.node, node_lost=True
        )

    def what_failed(self, first: RankFailed, store: TCPStore) -> tuple[str, str, Failure]:
        """How a rank ended ("killed by SIGKILL after step 24": steps counted from 1, as the progress line and a
        checkpoint's step count them; a heartbeat names its step from 0), the error it recorded, and what kind
        of failure that makes."""
        step = last_step(store, first.rank)
        cause = describe_exit(first.returncode) + (f" after step {step + 1}" if step is not None else "")
        detail = recorded_error(self.run_dir.error_file(first.rank))
        return cause, detail, classify_exit(first.returncode, detail)

    def worker_failed(self, first: RankFailed, detail: str, failure: Failure, then: list[str]) -> None:
        self.events.emit(
            Event.WORKER_FAILED,
            rank=first.rank,
            node=first.node,
            pid=first.pid,
            returncode=first.returncode,
            error=detail or None,
            failure=failure.kind,
            then=then,
        )

    def rank_failed(self, run: AttemptRun, first: RankFailed, store: TCPStore) -> Stopped:
        """A rank exited non-zero: stop the others (SIGTERM, then the grace) and say what it was."""
        cause, detail, failure = self.what_failed(first, store)
        on = f" on {self.agents.name(first.node)}" if self.multi_node else ""
        self.say(f"rank {first.rank}{on} (pid {first.pid}) {cause}; stopping the other workers")
        codes = run.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)
        others = [
            f"rank {rank} {describe_exit(code)}" for rank, code in sorted(codes.items()) if rank != first.rank and code
        ]
        if run.lost:  # a node gone is the root cause; this rank's exit was its first consequence
            return self.lost(run, run.lost[0], then=[f"rank {first.rank} {cause}", *others])
        self.worker_failed(first, detail, failure, then=others)
        for rank in sorted(set(codes) - {first.rank}):  # a survivor's traceback (a gloo error, say) explained
            if (log := self.run_dir.log(rank)).is_file():
                with log.open("a") as f:
                    f.write(f"[phalanx] rank {rank} was stopped because rank {first.rank}{on} {cause}; an error "
                            "above from its collectives is this rank losing that peer, not the cause\n")  # fmt: skip
        tail = _tail(self.run_dir.log(first.rank), 15)
        said = (
            f"rank {first.rank}{on} {cause}"
            + (f": {detail}" if detail else "")
            + (f"\n  last lines of {self.run_dir.log(first.rank)}:\n" + tail if tail else "")
        )
        reason = f"rank {first.rank} {cause}" + (f": {detail}" if detail else "")
        return self._failed(reason, failure, said, failed_rank=first.rank, failed_node=first.node)

    def recovery_stalled(self, run: AttemptRun, recovery: Recovery) -> Stopped:
        """A recovery in process did not finish in time (a survivor stuck in a collective gloo cannot abort,
        a spare that did not join): kill the workers; the job restarts from its last checkpoint."""
        pending, timeout = recovery.pending, self.spec.resilience.recovery_timeout_s
        assert pending is not None
        waiting = ", ".join(map(str, recovery.not_done()))
        why = f"did not recover in process within {timeout:g} s (recovery_timeout_s; rank(s) {waiting} not back)"
        self.say(f"{pending.who}'s recovery {why}: killing the workers, restarting from the last checkpoint")
        run.stop(signal.SIGKILL, 0)
        self.events.emit(
            Event.RECOVERY_STALLED, rank=pending.ranks[0], node=pending.node, generation=pending.generation,
            timeout_s=timeout,
        )  # fmt: skip
        reason = f"{pending.who} {why}"
        failure = Failure(Kind.INFRASTRUCTURE, reason, "hang")
        node = pending.node if pending.node is not None else self.agents.me.node
        return self._failed(reason, failure, failed_rank=pending.ranks[0], failed_node=node)

    def signalled(self, run: AttemptRun, sig: int, again: Callable[[], bool]) -> RunResult:
        """SIGINT or SIGTERM reached the job: forward it to every worker (the recipe checkpoints first), and kill
        what still runs after the grace, or at once when ``again`` says a second signal came."""
        name = signal.Signals(sig).name
        grace = self.spec.resilience.stop_grace_s
        self.say(
            f"received {name}: forwarding it to {len(run.pids)} worker(s), {grace:g} s before SIGKILL "
            "(send it again to kill now)"
        )
        self.events.emit(Event.SIGNAL_RECEIVED, signal=name)
        run.stop(sig, grace, abort=again)
        self.say(f"stopped by {name}")
        return RunResult(Outcome.STOPPED, 128 + sig, f"stopped by {name}", str(self.run_dir.root))

    def to_regrow(self, run: AttemptRun, regrow_after_s: float, full: int) -> Stopped:
        """Stop a shrunk attempt that has trained for regrow_after_s (SIGTERM: the recipe checkpoints first)."""
        self.say(
            f"{len(run.pids)} process(es) trained for {regrow_after_s:g} s since the shrink: "
            f"stopping them (SIGTERM, they checkpoint) to try all {full} again"
        )
        self.events.emit(Event.REGROW_STOP, procs=len(run.pids), after_s=regrow_after_s)
        run.stop(signal.SIGTERM, self.spec.resilience.stop_grace_s)
        return RunResult(Outcome.STOPPED, 0, "stopped to grow back", str(self.run_dir.root)), REGROW


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
