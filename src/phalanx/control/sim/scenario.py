"""The default replay: Philly's jobs of one month on a cluster of racks of 8-GPU nodes, its virtual clusters
as tenants in one cohort with quotas proportional to their GPU-time share, every policy on the same cluster,
placement and costs, and each tenant also alone on its quota (finish-time fairness needs that reference).
With a ``fleet`` of several GPU types, the same total of GPUs in the fleet's types, each job a workload of
the fleet's table (fleet.py); no tenant is replayed alone then (a quota is not tied to a type). ``budgets``
give tenants a budget for the whole replay, priced at the fleet's types' on-demand prices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from phalanx.control.scheduler import POLICIES, Cluster, Policy, Tenant, place
from phalanx.control.sim.fleet import Fleet
from phalanx.control.sim.simulator import ReplayCosts, Replayed, alone_cluster, simulate, split_gpus
from phalanx.control.sim.trace import TraceJob, philly, quotas


@dataclass(frozen=True)
class Scenario:
    trace: Path
    start: str = "2017-10-01"
    end: str = "2017-11-01"
    racks: int = 10
    nodes_per_rack: int = 8
    gpus_per_node: int = 8
    borrowing: bool = True
    costs: ReplayCosts = field(default_factory=ReplayCosts)
    seed: int = 0
    limit: int | None = None  # the first N jobs only (a quick look)
    fleet: Fleet | None = None  # several GPU types; None: one
    budgets: dict[str, float] = field(default_factory=dict)  # tenant -> the dollars it may spend in the replay

    @property
    def gpus(self) -> int:
        return self.racks * self.nodes_per_rack * self.gpus_per_node

    def jobs(self) -> tuple[list[TraceJob], list[Tenant]]:
        jobs, shares = philly(self.trace, self.start, self.end)
        cohort = "all" if self.borrowing else None
        quota = quotas(shares, self.gpus)
        tenants = [Tenant(name, gpus, cohort, budget=self.budgets.get(name)) for name, gpus in quota.items()]
        jobs = jobs[: self.limit]
        return (self.fleet.assign(jobs, self.seed) if self.fleet else jobs), tenants


@dataclass
class Replay:
    """One policy's replay, and each tenant's alone on its quota (job -> JCT; absent: cannot run alone)."""

    shared: Replayed
    alone_jct: dict[str, float]


def told(name: str, costs: ReplayCosts) -> Policy:
    """The policy ``name``, told what a preemption costs when it models that (phalanx's does, as its server is
    told with --restart-s and --commit-s): an operator knows their cluster's restart and commit times."""
    policy = POLICIES[name]()
    fields = {f.name for f in dataclasses.fields(policy)}  # type: ignore[arg-type]
    return replace(policy, cost=costs.preemption) if "cost" in fields else policy  # type: ignore[type-var]


def _one(policy: str, scenario: Scenario, jobs: list[TraceJob], tenants: list[Tenant], alone: str | None) -> Replayed:
    """One replay: the whole cluster, or only tenant ``alone``'s jobs on a cluster of its quota."""
    fleet = scenario.fleet
    if fleet is not None:
        cluster = fleet.cluster(scenario.nodes_per_rack)
    elif alone is None:
        cluster = Cluster.uniform(scenario.racks, scenario.nodes_per_rack, scenario.gpus_per_node)
    else:
        quota = next(t for t in tenants if t.name == alone)
        cluster = alone_cluster(quota.nominal_gpus, scenario.gpus_per_node, scenario.nodes_per_rack)
        jobs = [
            j for j in jobs if j.tenant == alone and place(cluster, *split_gpus(j.gpus, cluster.largest)) is not None
        ]
        tenants = [replace(quota, cohort=None)]
    truth = fleet.truth if fleet is not None else None
    return simulate(told(policy, scenario.costs), jobs, cluster, tenants, scenario.costs, scenario.seed, truth=truth)


def carried(jobs: Sequence[TraceJob], tenants: Sequence[Tenant]) -> list[str]:
    """The tenants whose quota can carry their jobs alone: GPU-time within quota x the window (from the first
    submit to the last). Alone on a quota that cannot, a tenant's backlog grows for the whole replay, its jobs
    would wait weeks alone, and its replay would take hours: its jobs count as those that cannot run alone
    (rho <= 1, report.py)."""
    if not jobs:
        return []
    window_s = max(1.0, jobs[-1].submit_s - jobs[0].submit_s)
    work: dict[str, float] = {}
    for job in jobs:
        work[job.tenant] = work.get(job.tenant, 0.0) + job.gpus * job.duration_s
    return [t.name for t in tenants if t.name in work and 0 < work[t.name] <= t.nominal_gpus * window_s]


def replay(scenario: Scenario, policies: Sequence[str], workers: int = 2) -> dict[str, Replay]:
    """Every policy's replay and its tenants' alone replays, ``workers`` processes at a time."""
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown polic(ies) {unknown}; known: {sorted(POLICIES)}")
    jobs, tenants = scenario.jobs()
    alone = carried(jobs, tenants) if scenario.fleet is None else []
    tasks = [(p, None) for p in policies] + [(p, t) for p in policies for t in alone]
    with ProcessPoolExecutor(workers) as pool:
        futures = {task: pool.submit(_one, task[0], scenario, jobs, tenants, task[1]) for task in tasks}
        results = {task: future.result() for task, future in futures.items()}
    out = {}
    for policy in policies:
        jcts = {}
        for tenant in alone:
            jcts.update({r.id: r.jct for r in results[policy, tenant].records.values()})
        out[policy] = Replay(results[policy, None], jcts)
    return out
