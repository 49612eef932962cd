"""One round's scratch space, shared by every policy: the cluster, quotas and memos as the round's own
decisions leave them, so that no two admissions of a round take the same GPUs or the same quota."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from phalanx.control.scheduler.jobs import Admit, Job, Preempt, Round, Run, Wait
from phalanx.control.scheduler.placement import Placement, place
from phalanx.control.scheduler.state import State


class Snapshot:
    def __init__(self, state: State, now: float):
        self.state, self.now = state, now
        self.cluster = state.cluster.copy()
        self.free = self.cluster.free_gpus
        self.held = dict(state.held)
        self.cohort_nominal = {c: sum(state.tenants[t].nominal_gpus for t in ts) for c, ts in state.cohorts.items()}
        self.cohort_held = {c: sum(self.held[t] for t in ts) for c, ts in state.cohorts.items()}
        self.leaving = set(state.leaving)
        self.round = Round()
        self.admitted: set[str] = set()
        self._borrowers: set[str] | None = None  # tenants over their quota when the round's preemption began
        self._unplaceable: dict[int, int] = {}  # per_worker -> the fewest workers that did not fit

    def nominal(self, tenant: str) -> int:
        return self.state.tenants[tenant].nominal_gpus

    # quota ---------------------------------------------------------------------------------------------------
    def quota(self, job: Job) -> tuple[bool, str | None]:
        """(borrowing, why not): within the tenant's nominal quota, or borrowing its cohort's idle quota
        within its limit, or a reason it may not start now."""
        tenant = self.state.tenants[job.tenant]
        held, need = self.held[tenant.name], job.gpus
        if held + need <= tenant.nominal_gpus:
            if tenant.cohort is None or self.cohort_held[tenant.cohort] + need <= self.cohort_nominal[tenant.cohort]:
                return False, None
            in_use, nominal = self.cohort_held[tenant.cohort], self.cohort_nominal[tenant.cohort]
            return False, (
                f"within tenant {tenant.name}'s quota, but cohort {tenant.cohort} has lent its {self.cluster.unit} out "
                f"({in_use} of {nominal} in use): to be reclaimed"
            )
        quota = self.cluster.of(tenant.nominal_gpus)
        have = f"tenant {tenant.name} holds {held} of the {quota} of its quota and this job needs {need}"
        if tenant.cohort is None:
            return True, f"{have}; it is in no cohort to borrow from"
        over = held + need - tenant.nominal_gpus
        if tenant.borrowing_limit is not None and over > tenant.borrowing_limit:
            limit = tenant.borrowing_limit
            return True, f"{have}; that would borrow {self.cluster.of(over)}, over its borrowing limit of {limit}"
        in_use, nominal = self.cohort_held[tenant.cohort], self.cohort_nominal[tenant.cohort]
        if in_use + need > nominal:
            return True, f"{have}; cohort {tenant.cohort} has no idle quota to lend ({in_use} of {nominal} in use)"
        return True, None

    def borrowers(self) -> set[str]:
        if self._borrowers is None:
            self._borrowers = {t for t, held in self.held.items() if held > self.state.tenants[t].nominal_gpus}
        return self._borrowers

    # placement -----------------------------------------------------------------------------------------------
    def place(self, job: Job) -> Placement | None:
        """Where the whole gang fits in the round's cluster; a shape that did not fit is remembered, since GPUs
        only get taken within a round."""
        if job.workers >= self._unplaceable.get(job.per_worker, 1 << 30) or job.gpus > self.free:
            return None
        placement = place(self.cluster, job.workers, job.per_worker)
        if placement is None:
            self._unplaceable[job.per_worker] = min(job.workers, self._unplaceable.get(job.per_worker, 1 << 30))
        return placement

    def nothing_fits(self) -> bool:
        return self.free == 0 or self._unplaceable.get(1) == 1

    def seen(self, job: Job) -> bool:
        return job.id in self.round.waits or job.id in self.admitted

    def admit(self, job: Job, placement: Placement, borrowing: bool) -> None:
        self.cluster.allocate(placement.gpus)
        self.admitted.add(job.id)
        self.free -= job.gpus
        self.held[job.tenant] += job.gpus
        if (cohort := self.state.tenants[job.tenant].cohort) is not None:
            self.cohort_held[cohort] += job.gpus
        self.round.admit.append(Admit(job.id, placement.gpus, borrowing))

    def wait(self, job: Job, kind: str, reason: str, behind: str | None = None) -> None:
        self.round.waits[job.id] = Wait(job.id, kind, reason, behind)

    # preemption ----------------------------------------------------------------------------------------------
    def shortfall(self, job: Job) -> tuple[int, int]:
        """GPUs that victims must give back for ``job`` to be within quota: (of its own tenant, of its cohort)."""
        tenant = self.state.tenants[job.tenant]
        if tenant.cohort is None:
            return max(0, self.held[tenant.name] + job.gpus - tenant.nominal_gpus), 0
        limit = tenant.borrowing_limit if tenant.borrowing_limit is not None else 1 << 30
        own = max(0, self.held[tenant.name] + job.gpus - tenant.nominal_gpus - limit)
        return own, max(0, self.cohort_held[tenant.cohort] + job.gpus - self.cohort_nominal[tenant.cohort])

    def victims(self, job: Job, candidates: Iterable[Run]) -> list[Run] | None:
        """The victims, taken in the order given (the policy's: cheapest first), whose GPUs make ``job`` fit,
        both on the nodes and in its quota (GPUs of its own tenant, of its cohort: ``shortfall``). None if
        there is no such set. A job that fits on one node takes them from the node where the worst victim
        taken is the cheapest; a gang, the cheapest prefix that makes it fit, less those it would not use."""
        pool = [run for run in candidates if run.id not in self.leaving]
        own_needed, cohort_needed = self.shortfall(job)
        cohort = self.state.tenants[job.tenant].cohort

        def gives(run: Run) -> tuple[int, int]:
            victim = run.job
            return (
                victim.gpus if victim.tenant == job.tenant else 0,
                victim.gpus if cohort is not None and self.state.tenants[victim.tenant].cohort == cohort else 0,
            )

        if job.gpus <= self.cluster.largest:
            on_node: dict[str, list[Run]] = {}
            for run in pool:
                for node in run.placement:
                    on_node.setdefault(node, []).append(run)
            best: tuple[tuple[int, int], list[Run]] | None = None  # ((worst victim's rank, victims), victims)
            rank = {run.id: i for i, run in enumerate(pool)}
            for node, runs in on_node.items():
                chosen, free, own, in_cohort = [], self.cluster.free[node], 0, 0
                for run in runs:
                    if free >= job.gpus and own >= own_needed and in_cohort >= cohort_needed:
                        break
                    chosen.append(run)
                    free += run.placement[node]
                    own, in_cohort = own + gives(run)[0], in_cohort + gives(run)[1]
                score = (rank[chosen[-1].id] if chosen else -1, len(chosen))
                enough = free >= job.gpus and own >= own_needed and in_cohort >= cohort_needed
                if chosen and enough and (best is None or score < best[0]):
                    best = (score, chosen)
            if best is not None:
                return best[1]
        what_if, chosen, own, in_cohort, free = self.cluster.copy(), [], 0, 0, self.free
        per = job.per_worker
        slots = sum(gpus // per for gpus in what_if.free.values())  # workers the nodes hold: place() needs enough
        for run in pool:
            slots -= sum(what_if.free[node] // per for node in run.placement)
            what_if.release(run.placement)
            slots += sum(what_if.free[node] // per for node in run.placement)
            chosen.append(run)
            own, in_cohort = own + gives(run)[0], in_cohort + gives(run)[1]
            free += run.job.gpus
            if own < own_needed or in_cohort < cohort_needed or free < job.gpus or slots < job.workers:
                continue
            if where := place(what_if, job.workers, job.per_worker):
                used = [run for run in chosen if set(run.placement) & set(where.gpus)]
                own, in_cohort = sum(gives(run)[0] for run in used), sum(gives(run)[1] for run in used)
                for run in chosen:  # and the cheapest others, while quota is still short
                    if own >= own_needed and in_cohort >= cohort_needed:
                        break
                    if run not in used:
                        used.append(run)
                        own, in_cohort = own + gives(run)[0], in_cohort + gives(run)[1]
                return used
        return None

    def preemptible(self, job: Job, runs: Iterable[Run]) -> list[Run]:
        """Runs ``job`` may preempt as Kueue's classic preemption does, of ``runs`` (in the policy's order, read
        only as far as needed): lower priority runs of its own tenant or of borrowing tenants, and, when the job
        is within its tenant's quota, borrowed GPUs of its cohort (a borrowing tenant gives back at most what it
        borrows)."""
        state = self.state
        tenant = state.tenants[job.tenant]
        within = self.held[tenant.name] + job.gpus <= tenant.nominal_gpus
        taken: dict[str, int] = {}
        chosen, offered, enough, seen = [], 0, 8 * job.gpus + sum(self.shortfall(job)), 0
        victims_of = {job.tenant, *self.borrowers()}  # no other tenant's runs are ever victims
        for run in runs:
            if offered >= enough or seen >= 4 * enough:
                break  # the cheapest victims worth many times the job's GPUs, of the cheapest runs: enough
            victim = run.job
            if victim.tenant not in victims_of or run.id in self.leaving:
                continue
            seen += 1
            over = self.held[victim.tenant] - state.tenants[victim.tenant].nominal_gpus - taken.get(victim.tenant, 0)
            cohort = state.tenants[victim.tenant].cohort
            reclaim = within and victim.tenant != job.tenant and cohort is not None and cohort == tenant.cohort
            outranked = victim.priority < job.priority and (victim.tenant == job.tenant or over > 0)
            if outranked or (reclaim and over > 0):
                taken[victim.tenant] = taken.get(victim.tenant, 0) + victim.gpus
                chosen.append(run)
                offered += victim.gpus
        return chosen

    def preempt(self, victims: list[Run], job: Job, reason: Callable[[Run], str]) -> None:
        for run in victims:
            self.leaving.add(run.id)
            self.round.preempt.append(Preempt(run.id, job.id, reason(run)))
