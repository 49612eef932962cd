"""The default replay: Philly's jobs of one month on a cluster of racks of 8-GPU nodes, its virtual clusters
as tenants in one cohort with quotas proportional to their GPU-time share, every policy on the same cluster,
placement and costs, and each tenant also alone on its quota (finish-time fairness needs that reference)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from phalanx.control.scheduler import POLICIES, Cluster, Tenant, place
from phalanx.control.sim.simulator import PreemptionCosts, Replayed, alone_cluster, simulate, split_gpus
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
    costs: PreemptionCosts = field(default_factory=PreemptionCosts)
    seed: int = 0
    limit: int | None = None  # the first N jobs only (a quick look)

    @property
    def gpus(self) -> int:
        return self.racks * self.nodes_per_rack * self.gpus_per_node

    def jobs(self) -> tuple[list[TraceJob], list[Tenant]]:
        jobs, shares = philly(self.trace, self.start, self.end)
        cohort = "all" if self.borrowing else None
        tenants = [Tenant(name, gpus, cohort) for name, gpus in quotas(shares, self.gpus).items()]
        return jobs[: self.limit], tenants


@dataclass
class Replay:
    """One policy's replay, and each tenant's alone on its quota (job -> JCT; absent: cannot run alone)."""

    shared: Replayed
    alone_jct: dict[str, float]


def _one(policy: str, scenario: Scenario, jobs: list[TraceJob], tenants: list[Tenant], alone: str | None) -> Replayed:
    """One replay: the whole cluster, or only tenant ``alone``'s jobs on a cluster of its quota."""
    if alone is None:
        cluster = Cluster.uniform(scenario.racks, scenario.nodes_per_rack, scenario.gpus_per_node)
    else:
        quota = next(t for t in tenants if t.name == alone)
        cluster = alone_cluster(quota.nominal_gpus, scenario.gpus_per_node, scenario.nodes_per_rack)
        jobs = [
            j for j in jobs if j.tenant == alone and place(cluster, *split_gpus(j.gpus, cluster.largest)) is not None
        ]
        tenants = [replace(quota, cohort=None)]
    return simulate(POLICIES[policy](), jobs, cluster, tenants, scenario.costs, scenario.seed)


def replay(scenario: Scenario, policies: Sequence[str], workers: int = 2) -> dict[str, Replay]:
    """Every policy's replay and its tenants' alone replays, ``workers`` processes at a time."""
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown polic(ies) {unknown}; known: {sorted(POLICIES)}")
    jobs, tenants = scenario.jobs()
    present = sorted({job.tenant for job in jobs})
    nominal = {t.name: t.nominal_gpus for t in tenants}
    tasks = [(p, None) for p in policies] + [(p, t) for p in policies for t in present if nominal[t] > 0]
    with ProcessPoolExecutor(workers) as pool:
        futures = {task: pool.submit(_one, task[0], scenario, jobs, tenants, task[1]) for task in tasks}
        results = {task: future.result() for task, future in futures.items()}
    out = {}
    for policy in policies:
        alone = {}
        for tenant in present:
            if (policy, tenant) in results:
                alone.update({r.id: r.jct for r in results[policy, tenant].records.values()})
        out[policy] = Replay(results[policy, None], alone)
    return out
