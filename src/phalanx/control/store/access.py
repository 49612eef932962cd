"""The one way to tenant-owned rows: a ``Scope`` is the store as one caller sees it. Every query of jobs,
executions, users and tokens goes through it and is filtered by the caller's tenant, so no endpoint can forget
the filter; what another tenant owns is not found (404), never forbidden (403), which would confirm it exists."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from phalanx.control.store.schema import Execution, Job, Tenant, Token, Transition, User, user_key, user_name
from phalanx.spec import excerpt


class Role(enum.StrEnum):
    ADMIN = "admin"  # everything, every tenant
    TENANT_ADMIN = "tenant-admin"  # its tenant's users, tokens and jobs
    MEMBER = "member"  # submit, cancel its own jobs, read its tenant
    VIEWER = "viewer"  # read its tenant


class NotFound(LookupError):
    def __init__(self, kind: str, key: object):
        self.kind, self.key = kind, key
        super().__init__(f"{kind} {excerpt(key)} not found")


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


class Scope:
    def __init__(self, session: Session, who: Identity):
        self.session, self.who = session, who

    def _mine(self, stmt: Select, tenant_column) -> Select:
        return stmt if self.who.is_admin else stmt.where(tenant_column == self.who.tenant)

    # --- reads
    def tenants(self) -> Sequence[Tenant]:
        return self.session.scalars(self._mine(select(Tenant), Tenant.name).order_by(Tenant.name)).all()

    def tenant(self, name: str) -> Tenant:
        found = self.session.get(Tenant, name)  # by primary key: the identity map, then one query
        if found is None or not (self.who.is_admin or found.name == self.who.tenant):
            raise NotFound("tenant", name)
        return found

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
