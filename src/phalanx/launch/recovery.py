"""In-process recovery, the launchers' side (the store keys and the workers' exchanges: obs/protocol.py).

With ``resilience.in_process`` warm spares wait beside the workers: processes with Python and torch imported
and the recipe warmed up, forked from a zygote (launch/zygote.py), waiting on the attempt's store for a rank.

- On one node (``RankRecovery``) the supervisor keeps ``warm_spares`` of them. When a rank's process dies it
  gives a ready spare that rank (its environment, ``rank_env``), puts the spare in the dead worker's place in
  the worker group and forks a new spare for the next failure, at the lowest CPU priority until it takes a
  rank (launch/priority.py), so that what little it does takes the CPU training leaves.
- On several nodes (``NodeRecovery``) each spare node's agent keeps a node's worth of spares (launch/agent.py,
  ``procs_per_node``), and it is a node that is recovered: when a member node is found lost (its agent's
  tether closed, or its heartbeats stopped), or a rank of it crashed (its agent then kills its other workers),
  the supervisor gives the spares of the first spare node that node's ranks and group rank, and that agent
  runs them as the node's workers from then on.
Either way the supervisor then says which generation of the process group replaces which ranks (the
decision); the survivors keep their processes, leave the broken group, and with the spares rebuild on the new
one and restore the state from the ranks' memory (train/ft.py): a rank's snapshot is held by another rank, on
another node when there are several.

It does not recover in process, and the job restarts from its last checkpoint instead, when:
- the failure is one a restart handles and in-process recovery cannot: a hang (its peers cannot be told apart
  from the dead), a user error (not retried at all), a lost node of a job of one, a crashed rank of node 0
  (which hosts the job);
- no spare is ready (the first ones wait for the zygote's imports and warm-up: a failure that early), or no
  spare node is;
- another failure comes during a recovery, the recovery is not done within ``recovery_timeout_s``, or a
  failure comes before the job has got past the step where the previous recovery began (repeated failures).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, replace

from torch.distributed import TCPStore

from phalanx.launch import priority
from phalanx.launch.node import RECIPE, Plan, node_env, rank_env, spare_worker
from phalanx.launch.rendezvous import Rendezvous, attempt_key
from phalanx.launch.workers import Worker, WorkerGroup
from phalanx.launch.zygote import Zygote
from phalanx.obs import protocol
from phalanx.obs.rundir import RunDir
from phalanx.spec import JobSpec

SPARE_IDS = 1000  # spare node n numbers its spares n x SPARE_IDS, ...: unique in the attempt's store


@dataclass
class Pending:
    """A recovery under way."""

    generation: int
    ranks: list[int]  # the ranks spares took
    node: int | None  # the lost node they were on (a node's recovery), else None
    began: float  # monotonic
    deadline: float

    @property
    def who(self) -> str:
        return f"node {self.node}" if self.node is not None else f"rank {self.ranks[0]}"


class WarmSpares:
    """A node's zygote and the warm spares it forks for one attempt, kept in the node's worker group (their
    output teed, exits seen)."""

    def __init__(self, spec: JobSpec, plan: Plan, node: int, run_dir: RunDir, group: WorkerGroup, first: int = 0):
        """``first``: the number of this node's first spare (its spares' keys in the store are by number)."""
        self.spec, self.plan, self.node, self.run_dir, self.group = spec, plan, node, run_dir, group
        self.spares: list[Worker] = []
        self._zygote: Zygote[Worker] | None = None
        self._numbered = first

    def start(self, count: int) -> None:
        """The zygote and ``count`` spares, at the workers' priority: ready as soon as they are."""
        self._zygote = Zygote(RECIPE, node_env(self.plan, self.node, self.spec, self.run_dir))
        for _ in range(count):
            self.fork(beside_training=False)

    def fork(self, beside_training: bool) -> None:
        """Ask the zygote for a spare: beside training, on the CPU that training leaves."""
        assert self._zygote is not None
        spare = spare_worker(self.plan, self.node, self.spec, self.run_dir, self._numbered)
        self._numbered += 1
        self._zygote.fork(spare, spare.env, priority.LOWEST if beside_training else priority.NORMAL)

    def adopt(self) -> None:
        """The spares the zygote has forked since, into the worker group. Called every tick, so that a spare's
        log fills as it starts."""
        assert self._zygote is not None
        for spare, forked in self._zygote.forked():
            self.group.start_one(spare, f"attempt {self.plan.attempt}: warm spare {spare.spare}", forked)
            self.spares.append(spare)

    def alive(self) -> list[Worker]:
        self.spares = [s for s in self.spares if s.exited_at is None]
        return self.spares

    def take(self, spare: Worker, rank: int) -> None:
        """``spare`` is ``rank`` from now on: its output goes to the rank's log."""
        assert spare.proc is not None
        self.spares.remove(spare)
        priority.set_session_nice(spare.proc.pid, priority.NORMAL)  # a rank's share again, before it is told
        with self.run_dir.log(rank).open("a") as log:
            log.write(f"===== attempt {self.plan.attempt}: warm spare {spare.spare} takes rank {rank} =====\n")
        spare.rank, spare.spare, spare.log_path = rank, None, self.run_dir.log(rank)

    def stop(self) -> None:
        """Kill the spares still waiting (they hold no state) and the zygote, and collect them."""
        if self._zygote is not None:
            self.adopt()
            self._zygote.stop()  # and the spares it has not yet been seen to fork: they die with it
        waiting = WorkerGroup(self.spares, lambda line: None)
        waiting.send(signal.SIGKILL)
        waiting.join()
        self.spares = []


class Recovery:
    """What the two kinds share: the generations of the attempt's process group, the recovery under way, and
    the rule against recovering again before the job got past the last one."""

    def __init__(self, spec: JobSpec, plan: Plan, run_dir: RunDir, store: TCPStore):
        self.spec, self.plan, self.run_dir, self.store = spec, plan, run_dir, store
        self.generation = 0
        self.pending: Pending | None = None
        self._past: int | None = None  # the job must get past this step before the next recovery in process

    def _refuse(self, reached: int) -> str | None:
        if self.pending is not None:
            return f"another failure came during the recovery of {self.pending.who}"
        if self._past is not None and reached <= self._past:
            return f"a failure came again before the job got past step {self._past}, where the last recovery began"
        return None

    def _decide(self, assigned: dict[int, dict[str, str]], node: int | None, reached: int) -> Pending:
        """Generation g + 1 gives each spare (by number) its rank's environment; then the decision, which the
        survivors wait for, names the ranks and the steps reached."""
        self.generation += 1
        g = self.generation
        for spare, env in assigned.items():
            self.store.set(protocol.assign_key(spare), json.dumps({"generation": g, "env": env}))
        ranks = sorted(int(env["RANK"]) for env in assigned.values())
        self.store.set(protocol.decision_key(g), json.dumps({"ranks": ranks, "reached": reached, "node": node}))
        now = time.monotonic()
        self.pending = Pending(g, ranks, node, now, now + self.spec.resilience.recovery_timeout_s)
        self._past = reached
        return self.pending

    def not_done(self) -> list[int]:
        """The ranks that have not restored their state in the recovery under way."""
        assert self.pending is not None
        g = self.pending.generation
        return [r for r in range(self.plan.world_size) if not self.store.check([protocol.done_key(g, r)])]

    def done(self) -> bool:
        """Whether the recovery under way has finished: every rank restored and training."""
        if self.not_done():
            return False
        self.pending = None
        return True

    def overdue(self) -> bool:
        return self.pending is not None and time.monotonic() > self.pending.deadline


class RankRecovery(Recovery):
    """One node: a dead rank's place goes to one of this node's warm spares."""

    def __init__(self, spec: JobSpec, plan: Plan, node: int, run_dir: RunDir, group: WorkerGroup, store: TCPStore):
        super().__init__(spec, plan, run_dir, store)
        self.node, self.group = node, group
        self.spares = WarmSpares(spec, plan, node, run_dir, group)

    def ready_spare(self) -> Worker | None:
        """A spare that is alive and has said it waits (dead ones are dropped)."""
        ready = [s for s in self.spares.alive() if self.store.check([protocol.ready_key(s.spare or 0)])]
        return ready[0] if ready else None

    def refuse(self, reached: int) -> str | None:
        """Why a rank that just died (the job had completed ``reached`` steps) is not recovered in process."""
        if (why := self._refuse(reached)) is not None:
            return why
        return "no warm spare is ready yet" if self.ready_spare() is None else None

    def begin(self, rank: int, reached: int) -> tuple[Pending, int]:
        """Give a ready spare the dead ``rank``'s place in the next generation; start a spare to replace it. The
        pending recovery, and the rank's new pid."""
        spare = self.ready_spare()
        assert spare is not None and spare.spare is not None and spare.proc is not None
        number = spare.spare
        self.spares.take(spare, rank)
        env = rank_env(rank, rank - self.plan.ranks(self.node).start, self.run_dir)
        pending = self._decide({number: env}, None, reached)
        self.group.workers = [spare if w.rank == rank else w for w in self.group.workers]
        self.spares.fork(beside_training=True)
        return pending, spare.proc.pid


class NodeRecovery(Recovery):
    """Several nodes: a lost node's ranks go to the warm spares of a spare node, which its agent keeps
    (launch/agent.py) and lists in the rendezvous (``attempt/<a>/<n>/spares``: number -> pid)."""

    def __init__(self, spec: JobSpec, plan: Plan, run_dir: RunDir, store: TCPStore, rdzv: Rendezvous):
        super().__init__(spec, plan, run_dir, store)
        self.rdzv = rdzv
        self.began = time.monotonic()
        self.ready: set[int] = set()  # spare nodes whose spares were all seen waiting

    def newly_ready(self, spare_nodes: list[int]) -> list[tuple[int, float]]:
        """The spare nodes whose spares are all waiting since the last call, with the seconds that took."""
        found = [n for n in spare_nodes if n not in self.ready and self.ready_spares(n) is not None]
        self.ready |= set(found)
        return [(n, time.monotonic() - self.began) for n in found]

    def ready_spares(self, node: int) -> dict[int, int] | None:
        """Spare node ``node``'s spares (number -> pid), if it has a node's worth and every one says it waits."""
        listed = self.rdzv.get(attempt_key(self.plan.attempt, "spares", node)) or {}
        spares = {int(number): pid for number, pid in listed.items()}
        if len(spares) < self.plan.procs or not self.store.check([protocol.ready_key(n) for n in spares]):
            return None
        return spares

    def refuse(self, reached: int, spare_node: int | None) -> str | None:
        """Why a lost node (the job had completed ``reached`` steps) is not recovered in process."""
        if (why := self._refuse(reached)) is not None:
            return why
        if spare_node is None:
            return "no spare node is left"
        if self.ready_spares(spare_node) is None:
            return f"spare node {spare_node}'s warm spares are not ready yet"
        return None

    def begin(self, lost: int, spare_node: int, reached: int) -> tuple[Pending, dict[int, int]]:
        """Give spare node ``spare_node``'s spares the ranks and group rank of ``lost``, tell its agent to run
        them as that node's workers, and go on with the plan that has it in the lost node's place. The
        pending recovery, and the ranks' new pids."""
        spares = self.ready_spares(spare_node)
        assert spares is not None
        group = self.plan.group_rank(lost)
        takes = dict(zip(sorted(spares)[: self.plan.procs], self.plan.ranks(lost), strict=True))  # number -> rank
        assigned = {
            number: {**rank_env(rank, local, self.run_dir), "GROUP_RANK": str(group)}
            for local, (number, rank) in enumerate(takes.items())
        }
        pending = self._decide(assigned, lost, reached)
        members = tuple(spare_node if n == lost else n for n in self.plan.members)
        self.plan = replace(self.plan, members=members)
        said = {"ranks": {str(number): rank for number, rank in takes.items()}, "members": members}
        self.rdzv.put(attempt_key(self.plan.attempt, "takes", spare_node), said)
        return pending, {rank: spares[number] for number, rank in takes.items()}
