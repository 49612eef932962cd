"""Who runs the next attempt, and with which spec: on one node, which local slots (a device each, shrunk and
grown back by ``Capacity``); across nodes, which agents (members, spares and nodes out, by ``Nodes``). The
supervisor tells it how each failed attempt ended and asks it for each attempt's plan; it writes the resized
spec an attempt runs after a shrink, and says every change on the console and in the events."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.launch.attempt import Agents
from phalanx.launch.node import LaunchError, Plan, spec_digest
from phalanx.obs import EventLog, RunDir
from phalanx.obs.events import Event
from phalanx.obs.rundir import Outcome, RunResult
from phalanx.resilience.elastic import FAILURES_TO_EXCLUDE, Capacity, Nodes, resized
from phalanx.spec import JobSpec, SpecError, dump_spec


class Membership:
    def __init__(
        self, spec: JobSpec, run_dir: RunDir, agents: Agents, device: str, say: Callable[[str], None], events: EventLog
    ):
        r, res = spec.resilience, spec.resources
        self.spec, self.run_dir, self.agents, self.device = spec, run_dir, agents, device
        self.say, self.events = say, events
        self.capacity = Capacity(res.procs_per_node, r.allow_shrink, r.min_procs, r.regrow_after_s)
        self.nodes = Nodes(res.nodes, r.allow_shrink, max(1, math.ceil(r.min_procs / res.procs_per_node)))
        self.attempt_spec, self.attempt_spec_path = spec, run_dir.spec  # what the next attempt runs
        self._lost_seen = 0  # how many of the agents's lost agents have been looked at

    def gather(self, addr: str, port: int, timeout_s: float, stopped: Callable[[], bool]) -> RunResult | None:
        """Publish the run in the rendezvous at ``addr:port`` and wait for every member node's agent to join
        (spares may join later); a failed result if they cannot."""
        assert self.agents.rdzv is not None
        res, tethers = self.spec.resources, self.agents.tethers
        run = {"run_dir": str(self.run_dir.root), "digest": spec_digest(self.spec), "nodes": res.nodes,
               "spare_nodes": res.spare_nodes, "tether_port": tethers.port if tethers else None}  # fmt: skip
        self.agents.rdzv.put("run", run)
        self.say(
            f"run {self.run_dir.run_id}: waiting for {res.nodes - 1} more node(s) at {addr}:{port} (and up to "
            f"{res.spare_nodes} spare(s))"
        )
        try:
            self.agents.wait_for(list(range(1, res.nodes)), timeout_s, stopped)
        except LaunchError as e:
            self.say(f"cannot start: {e}")
            return RunResult(Outcome.FAILED, 1, str(e), str(self.run_dir.root))
        self.poll_spares()
        self.events.emit(Event.NODES_JOINED, **self.record())
        return None

    def plan(self, attempt: int, port: int) -> Plan:
        """The next attempt's plan, its worker store on this node at ``port``."""
        visible = None  # after a one-node shrink on CUDA: rank r runs on the device of slot slots[r]
        if self.device == "cuda" and self.capacity.shrunk:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            names = env.split(",") if env else [str(i) for i in range(self.capacity.full)]
            visible = ",".join(names[slot] for slot in self.capacity.slots)
        return Plan(
            attempt=attempt,
            members=tuple(self.nodes.members),
            procs=self.attempt_spec.resources.procs_per_node,
            master_addr=self.agents.me.addr,
            master_port=port,
            spec_path=str(self.attempt_spec_path),
            device=self.device,
            max_restarts=self.spec.resilience.max_restarts,
            visible_devices=visible,
        )

    def record(self) -> dict[str, Any]:
        """The nodes, for the events: every agent that joined, the members, the spares, the nodes out."""
        agents = {str(n): {"addr": a.addr, "host": a.host, "pid": a.pid} for n, a in self.agents.joined.items()}
        return {"agents": agents, "members": self.nodes.members, "spares": self.nodes.spares, "out": self.nodes.out}

    def poll_spares(self) -> None:
        """Spares that joined become available; spares found lost leave the pool (members lost are the
        attempt's business)."""
        for lost in self.agents.found_lost[self._lost_seen :]:
            if lost.node in self.nodes.spares:
                agent = self.agents.joined[lost.node]
                self.say(f"spare {agent.name} lost: {lost.why}")
                self.events.emit(
                    Event.SPARE_LOST,
                    node=lost.node,
                    addr=agent.addr,
                    host=agent.host,
                    silent_s=lost.silent_s,
                    closed=lost.closed,
                )
                self._changed(self.nodes.after_failure(lost.node, lost=True))
        self._lost_seen = len(self.agents.found_lost)
        res = self.spec.resources
        try:  # spares, and the agent of a lost node started again on its machine
            joined = self.agents.poll_joins(list(range(1, res.nodes + res.spare_nodes)))
        except LaunchError as e:
            self.say(f"a spare cannot serve: {e}")
            return
        for node in joined:
            back = self.nodes.out.get(node) == "lost"
            self.nodes.readmit(node)
            self.say(f"{self.agents.name(node)} {'rejoined' if back else 'joined'} as a spare")
            if back:
                self.events.emit(Event.NODES_CHANGED, change=f"node {node} rejoined as a spare", **self.record())

    def after_failure(self, failed_rank: int | None, failed_node: int | None, node_lost: bool, attempt: int) -> None:
        """Decide the next attempt's nodes (multi-node) or slots (one node) after a failed attempt. Raises
        NoCapacity if the job cannot go on."""
        if self.agents.rdzv is None:
            self._shrink_slots(failed_rank, attempt)
            return
        self.poll_spares()
        before = len(self.nodes.members)
        self._changed(self.nodes.after_failure(failed_node, lost=node_lost))
        if len(self.nodes.members) != before:
            self._run_next(resized(self.spec, nodes=len(self.nodes.members)), attempt)

    def replaced(self, node: int, lost: bool) -> None:
        """``node`` (``lost``, or a rank of it crashed) recovered in process by the first spare: later attempts
        run on that spare too; a node not lost waits as a spare itself, unless it keeps failing first."""
        self._changed(self.nodes.after_failure(node, lost=lost))

    def _changed(self, change: str | None) -> None:
        if change is not None:
            self.say(change)
            self.events.emit(Event.NODES_CHANGED, change=change, **self.record())

    def _run_next(self, spec: JobSpec, attempt: int) -> Path:
        """From ``attempt`` on, run ``spec``, written beside the run's own as spec.attempt-<n>.yaml."""
        self.attempt_spec = spec
        self.attempt_spec_path = self.run_dir.root / f"spec.attempt-{attempt}.yaml"
        self.attempt_spec_path.write_text(dump_spec(spec))
        return self.attempt_spec_path

    def _shrink_slots(self, failed_rank: int | None, attempt: int) -> None:
        """With allow_shrink, leave out the slot whose rank keeps failing first; later attempts run without it."""
        slot = self.capacity.after_failure(failed_rank)
        if slot is None:
            return
        procs = len(self.capacity.slots)
        try:
            spec = resized(self.spec, procs)
        except SpecError as e:
            self.capacity.keep(slot)
            self.say(f"cannot shrink to {procs} process(es): {'; '.join(map(str, e.issues))}; keeping all of them")
            return
        path = self._run_next(spec, attempt)
        self.say(
            f"shrinking to {procs} process(es) without local slot {slot}: its rank failed first in "
            f"{FAILURES_TO_EXCLUDE} attempts in a row (spec of the next attempts: {path})"
        )
        self.events.emit(Event.SHRUNK, slot=slot, slots=self.capacity.slots, procs=procs)

    @property
    def shrunk(self) -> bool:
        """Running on fewer slots than the spec's (one node), or on fewer nodes with a spare back to grow on."""
        short = len(self.nodes.members) < self.spec.resources.nodes and bool(self.nodes.spares)
        return self.capacity.shrunk or (self.agents.rdzv is not None and short)

    @property
    def full(self) -> int:
        """The processes of the job grown back."""
        return self.capacity.full if self.agents.rdzv is None else self.spec.resources.world_size

    def regrow_due(self, since: float | None, latest_step: int | None, now: float) -> bool:
        """A shrunk attempt has trained (reported steps since ``since``) for regrow_after_s, and has steps left."""
        wait = self.capacity.regrow_after_s
        if not self.shrunk or wait is None or since is None or now - since < wait:
            return False
        train = self.spec.train
        return train is None or latest_step is None or latest_step + 1 < train.steps

    def regrow(self, attempt: int) -> None:
        if self.agents.rdzv is not None:
            self._regrow_nodes(attempt)
            return
        back = self.capacity.regrow()
        self.attempt_spec, self.attempt_spec_path = self.spec, self.run_dir.spec
        self.say(
            f"growing back to {self.capacity.full} process(es) with slot(s) {back}; a slot that fails first again "
            "is left out at once"
        )
        self.events.emit(Event.GROWN, slots=back, procs=self.capacity.full, attempt=attempt)

    def _regrow_nodes(self, attempt: int) -> None:
        """Spares back in the members' places, up to the spec's nodes; from ``attempt`` on, its spec again."""
        back = self.nodes.regrow(self.spec.resources.nodes)
        nodes = len(self.nodes.members)
        if nodes == self.spec.resources.nodes:
            self.attempt_spec, self.attempt_spec_path = self.spec, self.run_dir.spec
        else:
            self._run_next(resized(self.spec, nodes=nodes), attempt)
        change = f"growing back to {nodes} node(s) with node(s) {', '.join(map(str, back))}"
        self.say(change)
        self.events.emit(Event.NODES_CHANGED, change=change, **self.record())
