"""The one way to tenant-owned rows: a ``Scope`` is the store as one caller sees it. Every query of jobs,
executions, users and tokens goes through it and is filtered by the caller's tenant, so no endpoint can forget
the filter; what another tenant owns is not found (404), never forbidden (403), which would confirm it exists."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import Row, Select, case, func, select
from sqlalchemy.orm import Session

from phalanx.control.scheduler.sharing import MILLI, gpus_filled
from phalanx.control.store.schema import (
    ACTIVE,
    Base,
    Execution,
    Job,
    JobState,
    Tenant,
    Token,
    Transition,
    User,
    user_key,
    user_name,
)
from phalanx.spec import excerpt

SPEED_HISTORY = 5000  # ended executions the speed table is learned from


class Role(enum.StrEnum):
    ADMIN = "admin"  # everything, every tenant
    TENANT_ADMIN = "tenant-admin"  # its tenant's users, tokens and jobs
    MEMBER = "member"  # submit, cancel its own jobs, read its tenant
    VIEWER = "viewer"  # read its tenant


class NotFound(LookupError):
    def __init__(self, kind: str, key: object, valid: str = ""):
        """``valid``: what the client could have asked for instead, in words."""
        self.kind, self.key = kind, key
        super().__init__(f"{kind} {excerpt(key)} not found" + (f"; {valid}" if valid else ""))


class Forbidden(PermissionError):
    pass


class Ambiguous(ValueError):
    """A name that more than one visible thing has (an admin asking for a user two tenants have): 422."""


@dataclass(frozen=True)
class Identity:
    """Who is asking: the user (its name in its tenant), its tenant (None for admins), its role, and the token
    used."""

    user: str
    tenant: str | None
    role: Role
    token: str

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def key(self) -> str:
        return user_key(self.tenant, self.user)


@dataclass(frozen=True)
class TenantLoad:
    """A tenant's quota, and what its jobs hold and wait for now."""

    tenant: Tenant
    jobs: dict[str, int]  # by state
    gpus_in_use: int  # held by admitted and running jobs
    preemptions: int  # of its jobs, ever

    @property
    def jobs_active(self) -> int:
        return sum(self.jobs.get(state, 0) for state in ACTIVE)

    @property
    def jobs_pending(self) -> int:
        return self.jobs.get(JobState.PENDING, 0)


class Scope:
    def __init__(self, session: Session, who: Identity):
        self.session, self.who = session, who

    def _mine(self, stmt: Select, tenant_column) -> Select:
        return stmt if self.who.is_admin else stmt.where(tenant_column == self.who.tenant)

    # --- writes
    def add(self, row: Base) -> None:
        """A new row, flushed: its key is taken now, and a duplicate is found now (IntegrityError: a 409)."""
        self.session.add(row)
        self.session.flush()

    def has_tenant(self, name: str) -> bool:
        """Whether a tenant of this name exists: a clear 409 before creating one (asked after require_admin)."""
        return self.session.get(Tenant, name) is not None

    def has_user(self, key: str) -> bool:
        """Whether a user of this key (``user_key``) exists: a clear 409 before creating one."""
        return self.session.get(User, key) is not None

    # --- reads
    def tenants(self) -> Sequence[Tenant]:
        return self.session.scalars(self._mine(select(Tenant), Tenant.name).order_by(Tenant.name)).all()

    def tenant(self, name: str) -> Tenant:
        found = self.session.get(Tenant, name)  # by primary key: the identity map, then one query
        if found is None or not (self.who.is_admin or found.name == self.who.tenant):
            raise NotFound("tenant", name)
        return found

    def tenant_loads(self) -> list[TenantLoad]:
        """Each visible tenant's load, in one query: what /quota, the dashboard's fleet and /metrics show."""
        tenants = self.tenants()
        jobs: dict[str, dict[str, int]] = {t.name: {} for t in tenants}
        gpus = dict.fromkeys(jobs, 0)
        preemptions = dict.fromkeys(jobs, 0)
        shared = dict.fromkeys(jobs, 0)  # thousandths in shares: together, the whole GPUs they fill count
        share = Job.gpu_milli < MILLI
        rows = self.session.execute(
            select(Job.tenant, Job.state, func.count(), func.sum(case((share, 0), else_=Job.gpus)),
                   func.sum(case((share, Job.gpu_milli), else_=0)), func.sum(Job.preemptions))
            .where(Job.tenant.in_(list(jobs)))
            .group_by(Job.tenant, Job.state)
        )  # fmt: skip
        for tenant, state, n, held, milli, preempted in rows:
            jobs[tenant][state] = n
            if state in ACTIVE:
                gpus[tenant] += held or 0
                shared[tenant] += milli or 0
            preemptions[tenant] += preempted or 0
        for tenant, milli in shared.items():
            gpus[tenant] += gpus_filled(milli)  # the scheduler's rule
        return [TenantLoad(t, jobs[t.name], gpus[t.name], preemptions[t.name]) for t in tenants]

    def spend(self, since: float, now: float) -> dict[str, tuple[float, float]]:
        """Each visible tenant's (dollars from ``since`` to ``now``, dollars an hour of its running executions)."""
        return spend(self.session, since, now, tenant=None if self.who.is_admin else self.who.tenant)

    def jobs(
        self,
        states: Sequence[str] = (),
        tenant: str | None = None,
        owner: str | None = None,
        limit: int = 1000,
        after: int = 0,
        newest_first: bool = False,
    ) -> Sequence[Job]:
        """Jobs in submit order, from the one after ``after`` (a job's seq: pages through many); or the newest
        ``limit`` of them, newest first."""
        stmt = self._mine(select(Job), Job.tenant).where(Job.seq > after)
        if states:
            stmt = stmt.where(Job.state.in_(states))
        if tenant is not None:
            stmt = stmt.where(Job.tenant == tenant)
        if owner is not None:  # a name: of the caller's tenant, or (an admin's view) of the job's or an admin
            stmt = stmt.where((Job.owner == owner) | (Job.owner == Job.tenant + "/" + owner))
        return self.session.scalars(stmt.order_by(Job.seq.desc() if newest_first else Job.seq).limit(limit)).all()

    def job(self, job_id: str, for_update: bool = False) -> Job:
        stmt = self._mine(select(Job).where(Job.id == job_id), Job.tenant)
        found = self.session.scalar(stmt.with_for_update() if for_update else stmt)
        if found is None:
            raise NotFound("job", job_id)
        return found

    def kinds(self) -> Sequence[str]:
        """The kinds of the visible jobs, by name."""
        stmt = self._mine(select(Job.kind).distinct(), Job.tenant).where(Job.kind != "")
        return self.session.scalars(stmt.order_by(Job.kind)).all()

    def transitions(self, job: Job) -> Sequence[Transition]:
        return self.session.scalars(select(Transition).where(Transition.job == job.seq).order_by(Transition.id)).all()

    def executions(self, job: Job | None = None, since: float = 0.0) -> Sequence[tuple[Execution, str]]:
        """Executions, each with its job's id, of ``job`` or of every visible job, that were still running at
        ``since`` or later."""
        stmt = self._mine(select(Execution, Job.id).join(Job, Job.seq == Execution.job), Execution.tenant)
        if job is not None:
            stmt = stmt.where(Execution.job == job.seq)
        stmt = stmt.where((Execution.ended_at.is_(None)) | (Execution.ended_at >= since))
        return [(e, job_id) for e, job_id in self.session.execute(stmt.order_by(Execution.id))]

    def queueings(self) -> Iterator[tuple[str, int, str, float]]:
        """(tenant, job seq, PENDING or ADMITTED, when) of every visible job's transitions into the queue and out
        of it, job by job in order: what admission latency is measured from."""
        stmt = self._mine(
            select(Job.tenant, Transition.job, Transition.to_state, Transition.at).join(Job, Job.seq == Transition.job),
            Job.tenant,
        )
        stmt = stmt.where(Transition.to_state.in_((JobState.PENDING, JobState.ADMITTED)))
        yield from self.session.execute(stmt.order_by(Transition.job, Transition.id))

    def users(self) -> Sequence[User]:
        return self.session.scalars(self._mine(select(User), User.tenant).order_by(User.name)).all()

    def user(self, name: str, tenant: str | None = None) -> User:
        """The user ``name`` of ``tenant`` (default: the caller's). An admin naming no tenant finds an admin of
        that name, else the one tenant's user of that name; two tenants' are ambiguous (Ambiguous)."""
        if not self.who.is_admin:
            if tenant not in (None, self.who.tenant):
                raise NotFound("user", name)
            return self.user_by_key(user_key(self.who.tenant, name))
        if tenant is not None:
            return self.user_by_key(user_key(tenant, name))
        found = self.session.scalars(
            select(User).where((User.name == name) | (User.name == User.tenant + "/" + name)).limit(3)
        ).all()
        if len(found) > 1 and not any(u.tenant is None for u in found):
            raise Ambiguous(
                f"user {name!r} is a user of tenants {', '.join(sorted(str(u.tenant) for u in found))}: name its tenant"
            )
        if not found:
            raise NotFound("user", name)
        return min(found, key=lambda u: u.tenant is not None)  # an admin's name is the admin's first

    def user_by_key(self, key: str) -> User:
        found = self.session.get(User, key)
        if found is None or not (self.who.is_admin or found.tenant == self.who.tenant):
            raise NotFound("user", user_name(key))
        return found

    def tokens(self) -> Sequence[Token]:
        """The caller's own tokens; a tenant-admin's also those of its tenant's users; an admin's all."""
        stmt = select(Token).join(User, User.name == Token.user)
        if self.who.role is Role.TENANT_ADMIN:
            stmt = stmt.where(User.tenant == self.who.tenant)
        elif not self.who.is_admin:
            stmt = stmt.where(Token.user == self.who.key)
        return self.session.scalars(stmt.order_by(Token.created_at)).all()

    def token(self, token_id: str) -> Token:
        found = next((t for t in self.tokens() if t.id == token_id), None)
        if found is None:
            raise NotFound("token", token_id)
        return found

    # --- permissions within what the caller sees
    def require(self, *roles: Role, action: str) -> None:
        if self.who.role not in roles and not self.who.is_admin:
            raise Forbidden(
                f"{action} needs the role {' or '.join(roles) or 'admin'}; {self.who.user} is a {self.who.role}"
            )

    def require_admin(self, action: str) -> None:
        self.require(action=action)

    def may_cancel(self, job: Job) -> None:
        if self.who.role is Role.MEMBER and job.owner != self.who.key:
            raise Forbidden(f"job {job.id} belongs to {user_name(job.owner)}; a member cancels only its own jobs")
        self.require(Role.TENANT_ADMIN, Role.MEMBER, action="cancelling a job")

    def may_manage(self, user: User) -> None:
        """Tokens of others: an admin's for anyone, a tenant-admin's for its tenant's users (``user`` came
        through this scope, so it is of the caller's tenant)."""
        if user.name != self.who.key:
            self.require(Role.TENANT_ADMIN, action=f"managing user {user_name(user.name)}'s tokens")


def spend(
    session: Session, since: float, now: float, ended_only: bool = False, tenant: str | None = None
) -> dict[str, tuple[float, float]]:
    """Each tenant's (dollars its executions cost from ``since`` to ``now``, the running ones until now, and
    what its running executions cost an hour), in one query (``Execution.dollars``, summed). ``ended_only``:
    of the executions that ended; ``tenant``: of that tenant's only."""
    start = case((Execution.started_at > since, Execution.started_at), else_=since)
    end = func.coalesce(Execution.ended_at, now)
    stmt = select(
        Execution.tenant,
        func.sum(Execution.dollars_per_h * case((end > start, end - start), else_=0.0)) / 3600,
        func.sum(case((Execution.ended_at.is_(None), Execution.dollars_per_h), else_=0.0)),
    )
    ended = Execution.ended_at >= since
    stmt = stmt.where(ended if ended_only else Execution.ended_at.is_(None) | ended)
    if tenant is not None:
        stmt = stmt.where(Execution.tenant == tenant)
    return {t: (float(d or 0.0), float(h or 0.0)) for t, d, h in session.execute(stmt.group_by(Execution.tenant))}


def speed_runs(session: Session, limit: int = SPEED_HISTORY) -> Sequence[Row]:
    """The newest ``limit`` ended executions that say how fast their kind runs on their GPU type, oldest first:
    (kind, GPU type, GPUs, tokens, productive seconds) each. What the server's speed table is learned from,
    of every tenant's runs (how types compare is the fleet's to learn)."""
    rows = session.execute(
        select(Job.kind, Execution.gpu_type, Execution.gpus, Execution.tokens, Execution.productive_s)
        .join(Job, Job.seq == Execution.job)
        .where(Execution.gpu_type.is_not(None), Execution.tokens > 0, Execution.productive_s > 0)
        .order_by(Execution.ended_at.desc(), Execution.id.desc())
        .limit(limit)
    ).all()
    return rows[::-1]
