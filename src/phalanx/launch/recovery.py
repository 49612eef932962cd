"""In-process recovery, the supervisor's side (the store keys and the workers' exchanges: obs/protocol.py).

With ``resilience.in_process`` each attempt keeps ``warm_spares`` spare processes started beside its
workers: Python and torch imported, warmed up, waiting for the attempt's store to give them a rank. Spares
are forks of the attempt's zygote (launch/zygote.py), which imports and warms up the recipe once. When a
rank's process dies, the supervisor gives a ready spare that rank (its environment, ``rank_env``), says which
generation replaces it, puts the spare in the dead worker's place in the worker group and forks a new spare
for the next failure, at the lowest CPU priority until it takes a rank (launch/priority.py), so that what
little it does takes the CPU training leaves. The survivors and the spare then rebuild on the new process
group and restore the state from memory.

It does not recover in process, and the job restarts from its last checkpoint instead, when:
- the failure is not a dead process (a hang, a lost node: their peers cannot be told apart from the dead),
  or is a user error (not retried at all);
- no spare is ready (the first ones wait for the zygote's imports and warm-up: a failure that early);
- another rank fails during a recovery, the recovery is not done within ``recovery_timeout_s``, or a rank
  fails before the job has got past the step where the previous recovery began (repeated failures).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass

from torch.distributed import TCPStore

from phalanx.launch import priority
from phalanx.launch.node import RECIPE, Plan, node_env, rank_env, spare_worker
from phalanx.launch.workers import Worker, WorkerGroup
from phalanx.launch.zygote import Zygote
from phalanx.obs import protocol
from phalanx.obs.rundir import RunDir
from phalanx.spec import JobSpec


@dataclass
class Pending:
    """A recovery under way."""

    generation: int
    rank: int
    spare: Worker
    reached: int  # steps the job had completed when the rank died
    began: float  # monotonic
    deadline: float


class InProcessRecovery:
    def __init__(self, spec: JobSpec, plan: Plan, node: int, run_dir: RunDir, group: WorkerGroup, store: TCPStore):
        self.spec, self.plan, self.node, self.run_dir = spec, plan, node, run_dir
        self.group, self.store = group, store
        self.generation = 0
        self.pending: Pending | None = None
        self.spares: list[Worker] = []
        self._zygote: Zygote[Worker] | None = None
        self._numbered = 0
        self._past: int | None = None  # the job must get past this step before the next recovery in process

    def start_spares(self) -> None:
        """The attempt's zygote and first spares, started with its workers at their priority: ready as soon as
        they are."""
        self._zygote = Zygote(RECIPE, node_env(self.plan, self.node, self.spec, self.run_dir))
        for _ in range(self.spec.resilience.warm_spares):
            self._start_spare(beside_training=False)

    def _start_spare(self, beside_training: bool) -> None:
        """Ask the zygote for a spare: beside training, on the CPU that training leaves."""
        assert self._zygote is not None
        spare = spare_worker(self.plan, self.node, self.spec, self.run_dir, self._numbered)
        self._numbered += 1
        self._zygote.fork(spare, spare.env, priority.LOWEST if beside_training else priority.NORMAL)

    def adopt(self) -> None:
        """The spares the zygote has forked since: into the worker group (their output teed, exits seen). The
        supervisor calls it every tick, so that a spare's log fills as it starts."""
        assert self._zygote is not None
        for spare, forked in self._zygote.forked():
            self.group.start_one(spare, f"attempt {self.plan.attempt}: warm spare {spare.spare}", forked)
            self.spares.append(spare)

    def ready_spare(self) -> Worker | None:
        """A spare that is alive and has said it waits (dead ones are dropped)."""
        self.spares = [s for s in self.spares if s.exited_at is None]
        return next((s for s in self.spares if self.store.check([protocol.ready_key(s.spare or 0)])), None)

    def refuse(self, reached: int) -> str | None:
        """Why a rank that just died (the job had completed ``reached`` steps) is not recovered in process."""
        if self.pending is not None:
            return f"another rank failed during the recovery of rank {self.pending.rank}"
        if self._past is not None and reached <= self._past:
            return f"a rank failed again before the job got past step {self._past}, where the last recovery began"
        if self.ready_spare() is None:
            return "no warm spare is ready yet"
        return None

    def begin(self, rank: int, reached: int) -> Pending:
        """Give a ready spare the dead ``rank``'s place in the next generation; start a spare to replace it."""
        spare = self.ready_spare()
        assert spare is not None and spare.spare is not None and spare.proc is not None
        self.spares.remove(spare)
        self.generation += 1
        priority.set_session_nice(spare.proc.pid, priority.NORMAL)  # a rank's share again, before it is told
        local_rank = rank - self.plan.ranks(self.node).start
        self.store.set(
            protocol.assign_key(spare.spare),
            json.dumps({"generation": self.generation, "env": rank_env(rank, local_rank, self.run_dir)}),
        )
        self.store.set(
            protocol.decision_key(self.generation),
            json.dumps({"rank": rank, "spare": spare.spare, "pid": spare.proc.pid, "reached": reached}),
        )
        self.group.workers = [spare if w.rank == rank else w for w in self.group.workers]
        with self.run_dir.log(rank).open("a") as log:
            log.write(f"===== attempt {self.plan.attempt}: warm spare {spare.spare} takes rank {rank} =====\n")
        spare.rank, spare.spare, spare.log_path = rank, None, self.run_dir.log(rank)
        now = time.monotonic()
        timeout = self.spec.resilience.recovery_timeout_s
        self.pending = Pending(self.generation, rank, spare, reached, now, now + timeout)
        self._past = reached
        self._start_spare(beside_training=True)
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

    def stop_spares(self) -> None:
        """Kill the spares (they hold no state) and the zygote, and collect them."""
        if self._zygote is not None:
            self.adopt()
            self._zygote.stop()  # and the spares it has not yet been seen to fork: they die with it
        spares = WorkerGroup(self.spares, lambda line: None)
        spares.send(signal.SIGKILL)
        spares.join()
        self.spares = []
