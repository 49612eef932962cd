"""The node agent of nodes 1, 2, ...: joins node 0's rendezvous, runs this node's workers in each attempt it
is a member of (a spare waits), and does what node 0 says: dump stacks, stop. Node 0's agent is the
supervisor itself (launch/supervisor.py); `phalanx agent` picks the role from ``--node-rank``.

An agent never decides for the job: a rank that fails here is reported to node 0, which ends the attempt on
every node. The one thing it decides alone is what to do when node 0 is gone: its store fails (at once when
node 0's process died), or does not answer a call within ``resilience.node_timeout_s`` (node 0 frozen or cut
off), or its heartbeat stops for as long. The agent kills its workers, records the cause in the run directory,
runs ``on_lost`` (the cluster manager's way to start the job again: Slurm's requeue) and exits with code 1. The
rendezvous is not taken over by another node (docs/multinode.md says why); the restarted job resumes from its
last checkpoint. A spare node's agent of a job that recovers in process keeps warm spares, which may take a
lost node's ranks (launch/recovery.py); a member whose rank crashed may be told to leave them to a spare node.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from phalanx.launch.attempt import POLL_S
from phalanx.launch.lifetime import recorded_signals
from phalanx.launch.node import LaunchError, Plan, node_workers, resolve_device, spec_digest
from phalanx.launch.recovery import SPARE_IDS, WarmSpares
from phalanx.launch.rendezvous import Heartbeat, Liveness, Rendezvous, RendezvousLost, attempt_key
from phalanx.launch.tether import tie
from phalanx.launch.workers import WorkerGroup
from phalanx.obs import EventLog, RunDir
from phalanx.obs.console import Console
from phalanx.obs.events import Event
from phalanx.obs.rundir import Outcome, RunResult
from phalanx.spec import JobSpec, load_spec


class CoordinatorLost(RuntimeError):
    pass


class NodeAgent:
    def __init__(
        self,
        spec: JobSpec,
        rdzv: tuple[str, int],
        node: int,
        addr: str,
        join_timeout_s: float,
        console: TextIO = sys.stdout,
        on_lost: str | None = None,
    ):
        """``on_lost``: a shell command run once node 0 is found lost, after the workers are stopped and the
        loss recorded (bounded by ``node_timeout_s``)."""
        self.spec, self.rdzv_addr, self.node, self.addr = spec, rdzv, node, addr
        self.join_timeout_s, self.on_lost = join_timeout_s, on_lost
        self.console = Console(console, live=False)
        self.timeout_s = spec.resilience.node_timeout_s
        self.coordinator = Liveness(self.timeout_s)
        self.run_dir: RunDir | None = None
        self.tether: socket.socket | None = None  # held open: node 0 finds this agent's death by its closing
        self.group: WorkerGroup | None = None
        self._signals: list[int] = []

    def say(self, message: str) -> None:
        self.console.line(f"[phalanx node {self.node}] {message}")

    def run(self) -> int:
        """Serve the job until it finishes; the job's exit code (1 if node 0 was lost)."""
        host, port = self.rdzv_addr
        try:
            rdzv = Rendezvous.join(host, port, self.join_timeout_s, self.timeout_s)
        except RendezvousLost:
            raise LaunchError(
                f"no rendezvous at {host}:{port} within {self.join_timeout_s:g} s (is node 0's agent "
                "running, and is that its address?)"
            ) from None
        beat = None
        with recorded_signals(self._signals):  # handed to node 0, which stops the job on every node
            try:
                self._join(rdzv)
                beat = Heartbeat(
                    lambda: Rendezvous.join(host, port, self.timeout_s, self.timeout_s), f"agent/{self.node}/beat"
                )
                return self._serve(rdzv)
            except (RendezvousLost, CoordinatorLost) as e:
                return self._coordinator_lost(str(e))
            finally:
                if beat is not None:
                    beat.stop()

    def _join(self, rdzv: Rendezvous) -> None:
        # Each time node 0 finds this node rank lost, an agent started again on its machine may claim it anew.
        incarnation = rdzv.counters([f"agent/{self.node}/lost"])[0] or 0
        if rdzv.add(f"agent/{self.node}/claim/{incarnation}") > 1:
            raise LaunchError(f"node rank {self.node} is already taken by another agent of this job")
        deadline = time.monotonic() + self.join_timeout_s
        while (run := rdzv.get("run")) is None:
            if time.monotonic() > deadline:
                raise LaunchError(f"node 0 did not publish the run within {self.join_timeout_s:g} s")
            time.sleep(POLL_S)
        res = self.spec.resources
        error = None
        if self.node >= res.nodes + res.spare_nodes:
            error = (
                f"--node-rank {self.node} is out of range: nodes + spare_nodes = {res.nodes + res.spare_nodes}, "
                f"so node ranks are 0..{res.nodes + res.spare_nodes - 1}"
            )
        elif run["digest"] != spec_digest(self.spec):
            error = "its job spec differs from node 0's (every agent must be given the same spec)"
        elif not Path(run["run_dir"]).is_dir():
            error = (
                f"the run directory {run['run_dir']} that node 0 created is not visible here: --runs-dir must be "
                "a path on a filesystem shared by every node"
            )
        else:
            try:
                resolve_device(res.device, res.procs_per_node)
                self.tether = tie(self.rdzv_addr[0], run["tether_port"], self.node, incarnation, self.timeout_s)
            except LaunchError as e:
                error = str(e)
            except OSError as e:
                error = (
                    f"cannot reach node 0 at {self.rdzv_addr[0]}:{run['tether_port']} (its tether port, beside the "
                    f"rendezvous's): {e.strerror or e}"
                )
        record = {"addr": self.addr, "host": socket.gethostname(), "pid": os.getpid(), "error": error}
        rdzv.put(f"agent/{self.node}", {**record, "incarnation": incarnation})
        if error is not None:
            raise LaunchError(error)
        self.run_dir = RunDir(Path(run["run_dir"]))
        role = "a member" if self.node < res.nodes and not incarnation else "a spare"
        self.say(f"joined run {self.run_dir.run_id} at {self.rdzv_addr[0]}:{self.rdzv_addr[1]} as {role}")

    def _watch_coordinator(self, rdzv: Rendezvous) -> None:
        (beat,) = rdzv.counters(["coordinator/beat"])
        self.coordinator.observe(0, beat)
        if self.coordinator.gone():
            raise CoordinatorLost(f"its heartbeat stopped {self.coordinator.silent_s(0):.1f} s ago")

    def _serve(self, rdzv: Rendezvous) -> int:
        attempt = 0
        while True:
            if self._signals:
                rdzv.put(f"agent/{self.node}/signal", self._signals[0])
            if (finished := rdzv.get("finished")) is not None:
                rdzv.put(f"agent/{self.node}/finished", True)
                self.say(f"the job ended: {finished['reason']}")
                return int(finished["exit_code"])
            if rdzv.has(attempt_key(attempt + 1, "plan")):  # joined late, or a spare: catch up
                attempt += 1
                continue
            if (raw := rdzv.get(attempt_key(attempt, "plan"))) is not None:
                plan = Plan.from_json(raw)
                if self.node in plan.members:
                    self._run_attempt(rdzv, plan)
                    attempt += 1
                    continue
                if self.spec.resilience.in_process:  # the same in a resized attempt's spec
                    self._stand_by(rdzv, plan)
                    attempt += 1
                    continue
            self._watch_coordinator(rdzv)
            time.sleep(POLL_S)

    def _run_attempt(self, rdzv: Rendezvous, plan: Plan) -> None:
        assert self.run_dir is not None
        self.group = group = WorkerGroup(
            node_workers(plan, self.node, load_spec(plan.spec_path), self.run_dir), self.console.line
        )
        group.start(header=f"attempt {plan.attempt}")
        pids = {w.rank: w.proc.pid for w in group.workers if w.proc}
        rdzv.put(attempt_key(plan.attempt, "started", self.node), {"pids": pids})
        self._serve_attempt(rdzv, plan, group)

    def _stand_by(self, rdzv: Rendezvous, plan: Plan) -> None:
        """A spare node of a job that recovers in process: keep a node's worth of warm spares for the attempt
        (launch/recovery.py), listed in the rendezvous, until the attempt ends or node 0 gives them a lost
        node's ranks; then run them as that node's workers."""
        assert self.run_dir is not None
        a, me = plan.attempt, self.node
        self.group = group = WorkerGroup([], self.console.line)
        spares = WarmSpares(load_spec(plan.spec_path), plan, me, self.run_dir, group, first=me * SPARE_IDS)
        spares.start(plan.procs)
        listed = False
        try:
            while (takes := rdzv.get(attempt_key(a, "takes", me))) is None:
                if any(rdzv.has(k) for k in (attempt_key(a, "stop"), attempt_key(a + 1, "plan"), "finished")):
                    return  # the attempt is over: the spares are not needed
                if self._signals:
                    rdzv.put(f"agent/{me}/signal", self._signals[0])
                spares.adopt()
                if not listed and len(spares.alive()) == plan.procs:
                    rdzv.put(attempt_key(a, "spares", me), {str(s.spare): s.proc.pid for s in spares.spares if s.proc})
                    listed = True
                self._watch_coordinator(rdzv)
                time.sleep(POLL_S)
            by_number = {s.spare: s for s in spares.alive()}
            taken = [by_number[int(number)] for number in takes["ranks"]]
            for spare, rank in zip(taken, takes["ranks"].values(), strict=True):
                spares.take(spare, rank)
            group.workers = sorted(taken, key=lambda w: w.rank)  # its failures reported, stopped when told
            self._serve_attempt(rdzv, replace(plan, members=tuple(takes["members"])), group)
        finally:
            spares.stop()

    def _serve_attempt(self, rdzv: Rendezvous, plan: Plan, group: WorkerGroup) -> None:
        """Run this node's part of the attempt: report the first failed rank (or that all exited 0), dump
        stacks and stop the workers when node 0 says so."""
        a, me = plan.attempt, self.node
        self.say(
            f"attempt {plan.attempt}: ranks {plan.ranks(me).start}..{plan.ranks(me).stop - 1} "
            f"(group rank {plan.group_rank(me)} of {len(plan.members)})"
        )
        reported = dumped = False
        while (stop := rdzv.get(attempt_key(a, "stop"))) is None:
            if rdzv.has(attempt_key(a, "evict", me)):  # a rank crashed: spares took this node's ranks
                self.say(f"attempt {a}: a spare node took this node's ranks; a spare from the next attempt on")
                group.stop(signal.SIGKILL, 0)
                self.group = None
                return
            if self._signals:
                rdzv.put(f"agent/{self.node}/signal", self._signals[0])
            if not reported:
                failed = [w for w in group.exited() if w.returncode]
                if failed:
                    rdzv.put(attempt_key(a, "exit", me), {"rank": failed[0].rank, "returncode": failed[0].returncode})
                    reported = True
                elif not group.running():
                    rdzv.put(attempt_key(a, "exit", me), {"rank": None})
                    reported = True
            if not dumped and rdzv.has(attempt_key(a, "dump")):
                group.send_each(signal.SIGUSR1)
                dumped = True
            self._watch_coordinator(rdzv)
            time.sleep(POLL_S)
        group.stop(stop["signal"], stop["grace_s"], abort=lambda: rdzv.has(attempt_key(a, "kill")))
        rdzv.put(attempt_key(a, "stopped", me), {w.rank: w.returncode for w in group.workers})
        self.group = None

    def _coordinator_lost(self, why: str) -> int:
        """Node 0 is gone: stop this node's workers, say so in the run directory, start the job again if the
        cluster manager can (``on_lost``), exit 1."""
        reason = f"node 0 ({self.rdzv_addr[0]}), the rendezvous host, lost: {why}"
        then = "running " + self.on_lost if self.on_lost else "the job must be started again"
        self.say(f"{reason}; killing this node's workers and exiting ({then})")
        if self.group is not None:
            self.group.stop(signal.SIGKILL, 0)
        if self.run_dir is not None:
            EventLog(self.run_dir.events).emit(Event.RENDEZVOUS_LOST, node=self.node, addr=self.addr, cause=why)
            result = RunResult(Outcome.FAILED, 1, reason, str(self.run_dir.root), failed_node=0, node_lost=True)
            self.run_dir.write_result(result, first=True)  # every survivor tries; the first one's stands
        if self.on_lost:
            self._run_on_lost(self.on_lost)
        return 1

    def _run_on_lost(self, command: str) -> None:
        try:
            done = subprocess.run(
                command, shell=True, capture_output=True, text=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            self.say(f"`{command}` did not finish within {self.timeout_s:g} s (node_timeout_s): killed")
            return
        said = (done.stdout + done.stderr).strip()
        self.say(f"`{command}` exited with code {done.returncode}" + (f": {said}" if said else ""))
