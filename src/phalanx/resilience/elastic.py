"""Elastic shrink: when a slot of the machine (a device, and the rank on it) keeps failing, go on without it;
across machines, when a node is lost or keeps failing, replace it with a spare or go on without it.

A local slot whose rank is the first to fail in two attempts in a row is taken for lost capacity (a device
that fell off the bus, a GPU with failing memory) rather than bad luck. With ``resilience.allow_shrink`` the
next attempt runs on the remaining slots, down to ``resilience.min_procs``: the data-parallel shard degree is
refilled for the smaller world and the checkpoint is resharded into it on load; the global batch stays, so
training goes on along the same curve with more accumulation per rank.

Whether a left-out device works again cannot be seen from here, so growing back is tried: once a shrunk
attempt has trained for ``resilience.regrow_after_s``, the supervisor stops it with SIGTERM (the recipe saves
a checkpoint and exits) and starts the next attempt on every slot. A slot taken back that fails first again is
left out at once, and the next try waits twice as long.

Across nodes (``Nodes``), a node whose rank fails first, or that is lost, is replaced for the next attempt by
a hot spare (the spare takes its group rank, so the job's ranks and results are the same); a failed node
that is still alive waits as a spare itself. A node lost, or first to fail in two of its attempts in a row
(the attempts it was a member of), is out for good. With no spare left, ``allow_shrink`` goes on with fewer
nodes. Shrunk multi-node jobs do not grow back (a node that comes back joins as a spare of the next run).
"""

from __future__ import annotations

from phalanx.spec import JobSpec, validate_spec

FAILURES_TO_EXCLUDE = 2  # first to fail in this many attempts in a row


class Capacity:
    def __init__(self, procs: int, allow_shrink: bool, min_procs: int, regrow_after_s: float | None = None):
        self.full = procs
        self.slots = list(range(procs))  # usable local slots; the attempt's rank r runs on slots[r]
        self.allow_shrink, self.min_procs, self.regrow_after_s = allow_shrink, min_procs, regrow_after_s
        self._streak: tuple[int | None, int] = (None, 0)  # (slot, failures in a row)
        self._probation: set[int] = set()  # slots taken back by regrow(): their next first failure excludes them

    @property
    def shrunk(self) -> bool:
        return len(self.slots) < self.full

    def after_failure(self, rank: int | None) -> int | None:
        """Record that ``rank`` of the last attempt failed first; return the slot that is now excluded, if any."""
        slot = self.slots[rank] if rank is not None and rank < len(self.slots) else None
        count = self._streak[1] + 1 if slot is not None and slot == self._streak[0] else 1
        if slot in self._probation:
            count = FAILURES_TO_EXCLUDE
        self._streak = (slot, count)
        if slot is None or count < FAILURES_TO_EXCLUDE or not self.allow_shrink:
            return None
        if len(self.slots) - 1 < self.min_procs:
            return None
        self.slots.remove(slot)
        self._streak = (None, 0)
        return slot

    def keep(self, slot: int) -> None:
        """Undo the exclusion of ``slot`` (the job cannot run without it)."""
        self.slots = sorted({*self.slots, slot})

    def regrow(self) -> list[int]:
        """Take every left-out slot back, on probation; the wait before the next regrow doubles. Returns them."""
        back = sorted(set(range(self.full)) - set(self.slots))
        self._probation |= set(back)
        self.slots = list(range(self.full))
        if self.regrow_after_s is not None:
            self.regrow_after_s *= 2
        return back


class NoCapacity(RuntimeError):
    """The job cannot go on: a node is gone and there is neither a spare nor leave to shrink."""


class Nodes:
    """Which agents run workers (``members``, in group-rank order), which wait as ``spares``, which are ``out``."""

    def __init__(self, nodes: int, allow_shrink: bool, min_nodes: int):
        self.members = list(range(nodes))
        self.spares: list[int] = []
        self.out: dict[int, str] = {}  # node -> why it is out
        self.allow_shrink, self.min_nodes = allow_shrink, min_nodes
        self._failures: dict[int, int] = {}  # node -> attempts in a row, as a member, in which it failed first

    def add_spare(self, node: int) -> None:
        if node not in self.members and node not in self.spares and node not in self.out:
            self.spares.append(node)

    def readmit(self, node: int) -> None:
        """``node``'s agent joined: a spare, even if the node was lost before (its agent started again on its
        machine); a node out for failing first again and again stays out."""
        if self.out.get(node) == "lost":
            del self.out[node]
            self._failures.pop(node, None)
        self.add_spare(node)

    def regrow(self, nodes: int) -> list[int]:
        """After a shrink: spares become members again, up to ``nodes``; the nodes that did."""
        back = []
        while len(self.members) < nodes and self.spares:
            back.append(self.spares.pop(0))
            self.members.append(back[-1])
        return back

    def after_failure(self, node: int | None, lost: bool) -> str | None:
        """Record that ``node`` failed first in the last attempt (``lost``: its agent is gone). Returns what
        changed for the next attempt, in words, or None. Raises NoCapacity if the job cannot go on."""
        if node is None:
            return None
        for member in self.members:  # the others ran an attempt without failing first
            if member != node:
                self._failures.pop(member, None)
        self._failures[node] = self._failures.get(node, 0) + 1
        gone = lost or self._failures[node] >= FAILURES_TO_EXCLUDE
        if gone:
            self.out[node] = "lost" if lost else f"first to fail in {FAILURES_TO_EXCLUDE} of its attempts in a row"
        if node in self.spares:
            self.spares.remove(node)
            return f"spare node {node} is out ({self.out[node]})" if gone else None
        if node not in self.members:
            return None
        where = self.members.index(node)
        if self.spares:
            spare = self.members[where] = self.spares.pop(0)
            if not gone:
                self.spares.append(node)
            return f"node {node} replaced by spare node {spare}" + (f" ({self.out[node]})" if gone else "")
        if not gone:
            return None
        if self.allow_shrink and len(self.members) - 1 >= self.min_nodes:
            self.members.remove(node)
            return f"shrinking to {len(self.members)} node(s) without node {node} ({self.out[node]}); no spare left"
        if lost:
            raise NoCapacity(
                f"node {node} is lost and no spare node is left (resources.spare_nodes); "
                + (
                    "set resilience.allow_shrink: true to go on with fewer nodes"
                    if not self.allow_shrink
                    else f"resilience.min_procs keeps at least {self.min_nodes} node(s)"
                )
            )
        del self.out[node]  # failing, but the job cannot run without it: keep it
        self._failures[node] = 0
        return None


def resized(spec: JobSpec, procs: int | None = None, nodes: int | None = None) -> JobSpec:
    """``spec`` on ``nodes`` x ``procs`` processes (either kept when None): the data-parallel shard degree
    refilled (tp and dp_replicate kept). Raises SpecError if the job cannot run that way (e.g. the world no
    longer divides by tp)."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    res = data["resources"]
    res["procs_per_node"] = procs or res["procs_per_node"]
    res["nodes"] = nodes or res["nodes"]
    if data.get("train") is not None:
        data["train"]["parallel"]["dp_shard"] = -1
    return validate_spec(data, f"{spec.name} on {res['nodes']} x {res['procs_per_node']} process(es)")
