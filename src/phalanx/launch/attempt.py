"""Node 0's view of the job's nodes, and one attempt run on them.

``Agents``: the agents that joined the rendezvous, their liveness, and the keys of the exchange (what node 0
says to every agent, what each agent answers). ``AttemptRun``: one attempt across the nodes, node 0's own
workers started here and every other member's by its agent, seen as one: the first failed rank, a lost
node, success; stack dumps and stops go to every node. A job on one machine is the same with no other
agent: `phalanx run` and `phalanx agent` share every line of the attempt loop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.launch.node import LaunchError, Plan
from phalanx.launch.rendezvous import Liveness, Rendezvous, attempt_key
from phalanx.launch.tether import Tethers
from phalanx.launch.workers import Worker, WorkerGroup

POLL_S = 0.1


@dataclass(frozen=True)
class Agent:
    node: int  # its --node-rank: the agent's identity for the whole run
    addr: str  # the address others reach it at
    host: str
    pid: int

    @property
    def name(self) -> str:
        return f"node {self.node} ({self.addr})"


@dataclass(frozen=True)
class RankFailed:
    rank: int
    node: int
    returncode: int
    pid: int | None


@dataclass(frozen=True)
class NodeLost:
    node: int
    silent_s: float
    closed: bool = False  # its tether closed (its agent's process is gone); else its heartbeats stopped

    @property
    def why(self) -> str:
        if self.closed:
            return "its agent's connection to node 0 closed (the agent's process ended)"
        return f"no heartbeat from its agent for {self.silent_s:.1f} s"


Ending = RankFailed | NodeLost | None  # None: every rank exited with code 0


def this_agent(addr: str) -> Agent:
    """Node 0's agent: this process."""
    return Agent(0, addr, socket.gethostname(), os.getpid())


class Agents:
    def __init__(self, me: Agent, rdzv: Rendezvous | None, timeout_s: float, tethers: Tethers | None = None):
        """``rdzv``: the job's rendezvous (None: a job of one node, this one, and no agents to talk to);
        ``tethers``: the agents' connections, which find an agent's death at once (launch/tether.py)."""
        self.me = me
        self.rdzv = rdzv
        self.tethers = tethers
        self.joined: dict[int, Agent] = {me.node: me}
        self.liveness = Liveness(timeout_s)
        self.timeout_s = timeout_s
        self.gone: set[int] = set()  # agents found lost, or that cannot serve: not asked or waited for again
        self.found_lost: list[NodeLost] = []  # every agent found lost, members and spares, in order
        self.incarnation: dict[int, int] = {}  # node -> times it was found lost: its next agent's incarnation

    def name(self, node: int) -> str:
        return self.joined[node].name if node in self.joined else f"node {node}"

    def where(self, node: int) -> dict[str, str | None]:
        """The node's address and host, for an event."""
        agent = self.joined.get(node)
        return {"addr": agent.addr if agent else None, "host": agent.host if agent else None}

    def others(self) -> list[int]:
        return [n for n in self.joined if n != self.me.node and n not in self.gone]

    def wait_for(self, nodes: list[int], timeout_s: float, stopped: Callable[[], bool]) -> None:
        """Wait until the agents of ``nodes`` have joined; raise LaunchError naming any that cannot run or
        did not come within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while missing := [n for n in nodes if n not in self.joined]:
            if stopped():
                raise LaunchError("stopped while waiting for the nodes to join")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"node(s) {', '.join(map(str, missing))} did not join the rendezvous within {timeout_s:g} s; "
                    "start `phalanx agent JOB.yaml --rdzv HOST:PORT --node-rank N` on each"
                )
            self.poll_joins(missing)
            time.sleep(POLL_S)

    def poll_joins(self, nodes: list[int]) -> list[int]:
        """The agents among ``nodes`` that joined since the last call (raises LaunchError for one that says it
        cannot run)."""
        if self.rdzv is None:
            return []
        joined = []
        for node in nodes:
            if (node in self.gone) != (node in self.joined):
                continue  # here, or said it cannot serve (not asked again)
            record = self.rdzv.get(f"agent/{node}")
            if record is None or record.get("incarnation", 0) != self.incarnation.get(node, 0):
                continue  # not joined yet, or the agent that was found lost
            if record.get("error"):
                self.gone.add(node)
                self.joined.pop(node, None)
                raise LaunchError(f"node {node} ({record['addr']}) cannot run the job: {record['error']}")
            self.gone.discard(node)  # a lost node's agent started again: it is back
            self.liveness.forget(node)
            self.joined[node] = Agent(node, record["addr"], record["host"], record["pid"])
            self.liveness.observe(node, None)
            joined.append(node)
        return joined

    def lost(self) -> list[NodeLost]:
        """Agents whose tether closed or that have stopped beating (checked for every agent that joined, spares
        too)."""
        others = self.others()
        if not others:
            return []
        now = time.monotonic()
        for node, beat in zip(others, self.rdzv.counters([f"agent/{n}/beat" for n in others]), strict=True):  # type: ignore[union-attr]
            self.liveness.observe(node, beat, now)
        found = [NodeLost(n, self.liveness.silent_s(n, now), closed=True) for n in self._cut(others)]
        found += [
            NodeLost(n, self.liveness.silent_s(n, now))
            for n in self.liveness.gone(now)
            if n not in self.gone and n not in {f.node for f in found}
        ]
        self.gone |= {f.node for f in found}
        self.found_lost += found
        for f in found:  # an agent started again on that node's machine claims the next incarnation
            self.incarnation[f.node] = self.rdzv.add(f"agent/{f.node}/lost")  # type: ignore[union-attr]
        return found

    def _cut(self, others: list[int]) -> list[int]:
        """The agents among ``others`` whose tether closed, but for those that saw the job end and left."""
        if self.tethers is None:
            return []
        cut = [n for n in others if (n, self.incarnation.get(n, 0)) in self.tethers.cut]
        left = {n for n in cut if self.rdzv.has(f"agent/{n}/finished")}  # type: ignore[union-attr]
        self.gone |= left
        return [n for n in cut if n not in left]

    def signalled(self) -> int | None:
        """A signal an agent was sent (SIGINT/SIGTERM): the job stops with it as if node 0 was sent it."""
        for node in self.others():
            if (sig := self.rdzv.get(f"agent/{node}/signal")) is not None:  # type: ignore[union-attr]
                return int(sig)
        return None

    def finish(self, exit_code: int, reason: str) -> None:
        """Tell every agent the job is over, and wait (a bounded while) until the live ones have seen it, so
        that none takes this process's exit for a lost rendezvous."""
        if self.rdzv is None:
            return
        self.rdzv.put("finished", {"exit_code": exit_code, "reason": reason})
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            self.lost()  # a lost agent leaves others(): it is not waited for
            if all(self.rdzv.has(f"agent/{n}/finished") for n in self.others()):
                return
            time.sleep(POLL_S)


class AttemptRun:
    """One attempt across the plan's nodes."""

    def __init__(self, agents: Agents, plan: Plan, local: list[Worker], show: Callable[[str], None]):
        """``local``: this node's workers (none when node 0 is not a member of the plan)."""
        self.agents, self.plan = agents, plan
        self.group = WorkerGroup(local, show)
        self.remote = [n for n in plan.members if n != agents.me.node]
        self.pids: dict[int, int] = {}
        self.lost: list[NodeLost] = []  # members found lost while the attempt ran or stopped

    def key(self, name: str, node: int | None = None) -> str:
        return attempt_key(self.plan.attempt, name, node)

    def start(self, header: str) -> NodeLost | None:
        """Start the workers on every member node; return once all have started (their pids in ``pids``), or
        with the first member lost before it did."""
        self.group.start(header)
        self.pids = {w.rank: w.proc.pid for w in self.group.workers if w.proc}
        if self.agents.rdzv is None:
            return None
        self.agents.rdzv.put(self.key("plan"), self.plan.to_json())
        waiting = list(self.remote)
        while waiting:
            for node in list(waiting):
                if (started := self.agents.rdzv.get(self.key("started", node))) is not None:
                    self.pids.update({int(r): int(p) for r, p in started["pids"].items()})
                    waiting.remove(node)
            if lost := self._lost_members():
                return lost[0]
            time.sleep(POLL_S)
        return None

    def _lost_members(self) -> list[NodeLost]:
        found = [f for f in self.agents.lost() if f.node in self.plan.members]
        self.lost += found
        return found

    def poll(self) -> tuple[bool, Ending]:
        """(whether the attempt has ended, how): a member lost, the first failed rank, or None (success)."""
        if lost := self._lost_members():
            return True, lost[0]
        failed = [w for w in self.group.exited() if w.returncode]
        if failed:
            w = failed[0]
            return True, RankFailed(w.rank, self.agents.me.node, w.returncode or 0, w.proc.pid if w.proc else None)
        done = not self.group.running()
        for node in self.remote:
            ended = self.agents.rdzv.get(self.key("exit", node))  # type: ignore[union-attr]
            if ended is None:
                done = False
            elif ended["rank"] is not None:
                return True, RankFailed(ended["rank"], node, ended["returncode"], self.pids.get(ended["rank"]))
        return done, None

    def replace(self, lost: int, spare: int, pids: dict[int, int]) -> None:
        """Node ``lost`` recovered in process: ``spare``'s agent runs its ranks from now on (``pids``)."""
        self.plan = dataclasses.replace(self.plan, members=tuple(spare if n == lost else n for n in self.plan.members))
        self.remote = [spare if n == lost else n for n in self.remote]
        self.pids.update(pids)

    def dump_stacks(self) -> None:
        """SIGUSR1 to every worker process on every node: each writes its Python stacks to the run directory."""
        self.group.send_each(signal.SIGUSR1)
        if self.agents.rdzv is not None:
            self.agents.rdzv.put(self.key("dump"), True)

    def stop(self, sig: int, grace_s: float, abort: Callable[[], bool] = lambda: False) -> dict[int, int | None]:
        """Stop the workers on every node (``sig``, then SIGKILL after ``grace_s``, at ``abort()`` or when a member
        is found lost); wait until each member has stopped or is found lost. Returns the exit code of every rank
        not on a lost node."""
        rdzv = self.agents.rdzv
        if rdzv is not None and self.remote:
            rdzv.put(self.key("stop"), {"signal": int(sig), "grace_s": grace_s})

        def aborted() -> bool:  # a member lost meanwhile: the others' collectives cannot complete, kill now
            if abort() or self._lost_members():
                if rdzv is not None and self.remote:
                    rdzv.put(self.key("kill"), True)
                return True
            return False

        self.group.stop(sig, grace_s, aborted)
        codes: dict[int, int | None] = {w.rank: w.returncode for w in self.group.workers}
        waiting = [n for n in self.remote if n not in {f.node for f in self.lost}]
        while waiting:
            for node in list(waiting):
                if (stopped := rdzv.get(self.key("stopped", node))) is not None:  # type: ignore[union-attr]
                    codes.update({int(r): c for r, c in stopped.items()})
                    waiting.remove(node)
            self._lost_members()
            waiting = [n for n in waiting if n not in {f.node for f in self.lost}]
            aborted()
            time.sleep(POLL_S)
        return codes
