"""One round's scratch space, shared by every policy: the cluster, quotas and memos as the round's own
decisions leave them, so that no two admissions of a round take the same GPUs or the same quota."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from phalanx.control.scheduler.cluster import Cluster
from phalanx.control.scheduler.jobs import Admit, Job, Preempt, Round, Run, Wait, counted
from phalanx.control.scheduler.placement import Placement, place
from phalanx.control.scheduler.state import State


class Snapshot:
    def __init__(self, state: State, now: float):
        self.state, self.now = state, now
        self.cluster = state.cluster.copy()
        self.free = self.cluster.free_gpus
        self.held, self.shared = dict(state.held), dict(state.shared)
        self.cohort_nominal = {c: sum(state.tenants[t].nominal_gpus for t in ts) for c, ts in state.cohorts.items()}
        self.cohort_held = {c: sum(self.held[t] for t in ts) for c, ts in state.cohorts.items()}
        self.leaving = set(state.leaving)
        self.round = Round()
        self.admitted: set[str] = set()
        self._borrowers: set[str] | None = None  # tenants over their quota when the round's preemption began
        self._types: dict[tuple[tuple[str, ...], ...], list[str]] = {}  # types_of, per (allowed, preferred)
        self._unplaceable: dict[tuple[str, int], int] = {}  # (type, per_worker) -> the fewest workers that did not fit

    def nominal(self, tenant: str) -> int:
        return self.state.tenants[tenant].nominal_gpus

    # quota ---------------------------------------------------------------------------------------------------
    def quota(self, job: Job) -> tuple[bool, str | None]:
        """(borrowing, why not): within the tenant's nominal quota, or borrowing its cohort's idle quota
        within its limit, or a reason it may not start now."""
        tenant = self.state.tenants[job.tenant]
        held, need = self.held[tenant.name], counted(job, self.shared[tenant.name])[0]
        if need == 0:  # a share on GPUs its tenant's shares already count
            return False, None
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

    # placement ---------------------------------------------------------------------------------------------------
    def types_of(self, job: Job) -> list[str]:
        """The GPU types ``job`` may run on: those it prefers, best first, then the others in the fleet's order."""
        key = (job.gpu_types, job.prefer)
        if (types := self._types.get(key)) is None:
            allowed = [t for t in self.cluster.types if not job.gpu_types or t in job.gpu_types]
            rank = {t: i for i, t in enumerate(job.prefer)}
            types = self._types[key] = sorted(allowed, key=lambda t: rank.get(t, len(rank)))
        return types

    def place(self, job: Job, types: Sequence[str] | None = None) -> Placement | None:
        """Where the whole gang fits in the round's cluster: on the first of ``types`` where it fits (the
        policy's order); None: the best fit over the job's types, as a policy that does not tell types apart
        places it. A gang never spans types unless the job allows it, and then only when no one type holds it.
        A shape that did not fit on a type is remembered, since GPUs only get taken within a round. A share goes
        where it fragments the fleet least (``share``)."""
        if job.shares:
            return self._share(job, self.types_of(job) if types is None else types)
        if job.gpus > self.free:
            return None
        if types is not None:
            return self._fit(self.cluster, job, types)
        fits = [where for t in self.types_of(job) if (where := self._on(self.cluster, job, t)) is not None]
        free = self.cluster.free
        best = min(fits, key=lambda where: (where.nodes, sum(free[n] for n in where.gpus)), default=None)
        return best if best is not None else self._mixed(self.cluster, job, self.types_of(job))

    def _fit(self, cluster: Cluster, job: Job, types: Sequence[str]) -> Placement | None:
        """The gang on ``cluster`` (the round's, or a what-if), on the first of ``types`` that holds it; else,
        if it may mix them, on all of them."""
        for gpu_type in types:
            if (where := self._on(cluster, job, gpu_type)) is not None:
                return where
        return self._mixed(cluster, job, types)

    def _on(self, cluster: Cluster, job: Job, gpu_type: str) -> Placement | None:
        """The gang on one type; on the round's cluster, a shape that did not fit is remembered (its GPUs only
        get taken within a round; a what-if cluster has more free, so nothing is remembered of it)."""
        if cluster is not self.cluster:
            return place(cluster, job.workers, job.per_worker, (gpu_type,))
        shape = (gpu_type, job.per_worker)
        if job.workers >= self._unplaceable.get(shape, 1 << 30):
            return None
        placement = place(cluster, job.workers, job.per_worker, (gpu_type,))
        if placement is None:
            self._unplaceable[shape] = min(job.workers, self._unplaceable.get(shape, 1 << 30))
        return placement

    @staticmethod
    def _mixed(cluster: Cluster, job: Job, types: Sequence[str]) -> Placement | None:
        """The gang over all of ``types``, when its job may span them and no one type held it."""
        return place(cluster, job.workers, job.per_worker, types) if job.mix_types and len(types) > 1 else None

    def _share(self, job: Job, types: Sequence[str]) -> Placement | None:
        """A share's node and shared GPU: of the first of ``types`` that holds it, the candidate (a shared GPU
        with room, or a free GPU to carve) that raises the node's fragmentation least for the jobs' shapes seen
        (sharing.Fragmentation, best fit among equals)."""
        cluster, ask, score = self.cluster, job.ask, self.state.share_score
        for gpu_type in types:
            best: tuple[tuple[float, ...], str, int] | None = None
            for name in cluster.typed.get(gpu_type, ()):
                if not cluster.free[name] and name not in cluster.carved:
                    continue
                room = cluster.room(name)
                for (index,) in room.choices(ask):
                    value = score(room, ask, (index,))
                    if best is None or value < best[0]:
                        best = (value, name, index)
            if best is not None:
                return Placement({best[1]: 1}, cluster.carve_of(best[1], best[2]))
        return None

    def nothing_fits(self) -> bool:
        """No whole GPU is free where a one-GPU job could go, and no shared GPU has room."""
        whole = self.free == 0 or all(
            self._unplaceable.get((t, 1)) == 1 for t in self.cluster.typed if self.cluster.typed[t]
        )
        return whole and self.cluster.carved_left == 0

    def seen(self, job: Job) -> bool:
        return job.id in self.round.waits or job.id in self.admitted

    def admit(self, job: Job, placement: Placement, borrowing: bool) -> None:
        if placement.carve is not None:  # a share: a whole GPU less when it carves one
            ((node, _),) = placement.gpus.items()
            self.free -= placement.carve not in self.cluster.carved.get(node, {})
            self.cluster.take_share(node, placement.carve, job.gpu_milli)
        else:
            self.cluster.allocate(placement.gpus)
            self.free -= job.gpus
        self.admitted.add(job.id)
        gpus, self.shared[job.tenant] = counted(job, self.shared[job.tenant])
        self.held[job.tenant] += gpus
        if (cohort := self.state.tenants[job.tenant].cohort) is not None:
            self.cohort_held[cohort] += gpus
        self.round.admit.append(Admit(job.id, placement.gpus, borrowing, placement.carve))

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

    def victims(self, job: Job, candidates: Iterable[Run], types: Sequence[str] | None = None) -> list[Run] | None:
        """The victims, taken in the order given (the policy's: cheapest first), whose GPUs make ``job`` fit,
        both on the nodes and in its quota (GPUs of its own tenant, of its cohort: ``shortfall``), on nodes of
        ``types`` (None: any the job may run on). None if there is no such set. A job that fits on one node
        takes them from the node where the worst victim taken is the cheapest; a gang, the cheapest prefix that
        makes it fit on one of the types (the first, in their order), less those it would not use. Shares are
        kept apart from gangs: a share preempts nothing and is never a victim."""
        if job.shares:
            return None
        types = self.types_of(job) if types is None else types
        nodes = self.cluster.nodes
        pool = [run for run in candidates if run.id not in self.leaving and not run.job.shares]
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
                if nodes[node].gpu_type not in types:
                    continue
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
        what_if, chosen, own, in_cohort, per = self.cluster.copy(), [], 0, 0, job.per_worker
        ours = [n for t in types for n in self.cluster.typed[t]]  # the nodes it may run on
        free = sum(what_if.free[n] for n in ours)
        slots = sum(what_if.free[n] // per for n in ours)  # workers those nodes hold: place() needs enough
        for run in pool:
            mine = [node for node in run.placement if nodes[node].gpu_type in types]
            slots -= sum(what_if.free[node] // per for node in mine)
            what_if.release(run.placement)
            slots += sum(what_if.free[node] // per for node in mine)
            chosen.append(run)
            own, in_cohort = own + gives(run)[0], in_cohort + gives(run)[1]
            free += sum(run.placement[node] for node in mine)
            if own < own_needed or in_cohort < cohort_needed or free < job.gpus or slots < job.workers:
                continue
            if where := self._fit(what_if, job, types):
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
            if victim.tenant not in victims_of or run.id in self.leaving or victim.shares:
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
