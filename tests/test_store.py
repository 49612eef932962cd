"""The control plane's store, on SQLite and on a real PostgreSQL: migrations, tenant isolation in the access
layer, tokens, job transitions, and concurrent writers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select

from phalanx.control.server import auth, lifecycle
from phalanx.control.server.lifecycle import S, Submission
from phalanx.control.store import (
    Base,
    Execution,
    Identity,
    Job,
    NotFound,
    Role,
    Scope,
    Tenant,
    Transition,
    User,
    open_store,
)
from phalanx.control.store.access import Forbidden

SPEC = "name: t\nresources: {procs_per_node: 1, device: cpu}\ncommand: [python, -c, pass]\n"


def _world(store) -> dict[str, Identity]:
    """Tenants a and b, each with a tenant-admin, a member and a viewer, and an admin; their identities."""
    who = {"admin": Identity("admin", None, Role.ADMIN, "-")}
    with store.write() as s:
        s.add(User(name="admin", tenant=None, role=Role.ADMIN, created_at=0.0))
        for tenant in ("a", "b"):
            s.add(Tenant(name=tenant, quota_gpus=4, cohort=None, borrowing_limit=None, created_at=0.0))
            s.flush()
            for role in (Role.TENANT_ADMIN, Role.MEMBER, Role.VIEWER):
                name = f"{tenant}-{role}"
                s.add(User(name=name, tenant=tenant, role=role, created_at=0.0))
                who[name] = Identity(name, tenant, role, "-")
    return who


def _submit(store, who: Identity, tenant: str | None = None) -> str:
    with store.write() as s:
        job = lifecycle.submit(Scope(s, who), Submission(SPEC, 0, tenant, "/"), Path("/jobs"), 8, 1.0)
        return job.id


def test_migrations_give_the_models_schema(database_url: str) -> None:
    store = open_store(database_url)
    with store.engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
    open_store(database_url)  # migrating again is a no-op


def test_a_scope_sees_its_tenant_only(database_url: str) -> None:
    store = open_store(database_url)
    who = _world(store)
    a_job, b_job = _submit(store, who["a-member"]), _submit(store, who["b-member"])
    with store.write() as s:
        for job_id in (a_job, b_job):
            job = s.scalar(select(Job).where(Job.id == job_id))
            s.add(Execution(job=job.seq, tenant=job.tenant, attempt=1, gpus=1, started_at=2.0))
    with store.write() as s:
        for role in ("tenant-admin", "member", "viewer"):
            scope = Scope(s, who[f"a-{role}"])
            assert [j.id for j in scope.jobs()] == [a_job]
            assert [job_id for _, job_id in scope.executions()] == [a_job]
            assert [t.name for t in scope.tenants()] == ["a"]
            assert {u.name for u in scope.users()} == {"a-tenant-admin", "a-member", "a-viewer"}
            others = ((scope.job, b_job), (scope.tenant, "b"), (scope.user, "b-member"), (scope.user, "admin"))
            for lookup, key in others:
                with pytest.raises(NotFound):
                    lookup(key)
            assert scope.jobs(tenant="b") == []
        admin = Scope(s, who["admin"])
        assert {j.id for j in admin.jobs()} == {a_job, b_job}
        assert admin.job(b_job).tenant == "b"


def test_roles_decide_who_may_submit_and_cancel(database_url: str) -> None:
    store = open_store(database_url)
    who = _world(store)
    with pytest.raises(Forbidden):
        _submit(store, who["a-viewer"])
    with pytest.raises(NotFound):  # another tenant's name is as unknown as a name that does not exist
        _submit(store, who["a-member"], tenant="b")
    with pytest.raises(lifecycle.Invalid):  # an admin names the tenant
        _submit(store, who["admin"])
    mine = _submit(store, who["a-tenant-admin"])
    with store.write() as s, pytest.raises(Forbidden):
        scope = Scope(s, who["a-member"])
        lifecycle.cancel(scope, scope.job(mine), 2.0)
    with store.write() as s:
        scope = Scope(s, who["a-tenant-admin"])
        lifecycle.cancel(scope, scope.job(mine), 2.0)
    with store.write() as s:
        job = Scope(s, who["admin"]).job(mine)
        assert job.state == S.CANCELLED
        with pytest.raises(lifecycle.Conflict, match="already ended"):
            lifecycle.cancel(Scope(s, who["admin"]), job, 3.0)
        with pytest.raises(lifecycle.Conflict, match="cannot become RUNNING"):
            lifecycle.move(s, job, S.RUNNING, "no", 3.0)
        history = s.scalars(select(Transition).where(Transition.job == job.seq).order_by(Transition.id)).all()
        assert [(t.from_state, t.to_state) for t in history] == [(None, "PENDING"), ("PENDING", "CANCELLED")]
        assert history[1].cause == "cancelled by a-tenant-admin"


def test_tokens_are_kept_as_hashes_and_expire_and_revoke(database_url: str) -> None:
    store = open_store(database_url)
    _world(store)
    with store.write() as s:
        user = s.get(User, "a-member")
        row, token = auth.issue(s, user, "ci", now=100.0, expires_at=200.0)
        token_id = row.id
    secret = token.split("_", 2)[2]
    with store.write() as s:
        stored = s.get(auth.Token, token_id)
        assert secret not in (stored.secret_sha256, stored.id, stored.name)
        assert auth.authenticate(s, f"Bearer {token}", now=150.0) == Identity("a-member", "a", Role.MEMBER, token_id)
        for header, now in (
            (f"Bearer {token}", 200.0),  # expired
            (f"Bearer {token[:-1]}{'A' if token[-1] != 'A' else 'B'}", 150.0),  # a wrong secret
            (f"Basic {token}", 150.0),
            ("Bearer phx_000000000000_" + "x" * 43, 150.0),  # no such id
            (None, 150.0),
        ):
            with pytest.raises(auth.Unauthenticated):
                auth.authenticate(s, header, now)
        stored.revoked_at = 160.0
    with store.write() as s, pytest.raises(auth.Unauthenticated):
        auth.authenticate(s, f"Bearer {token}", now=170.0)


def test_concurrent_submits_lose_nothing(database_url: str) -> None:
    """Eight writers at once: every job stored once, in a total order, each with its first transition."""
    store = open_store(database_url)
    who = _world(store)
    submitted: list[str] = []
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for _ in range(15):
                submitted.append(_submit(store, who["a-member" if n % 2 else "b-member"]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with store.write() as s:
        jobs = s.scalars(select(Job)).all()
        assert sorted(j.id for j in jobs) == sorted(submitted) and len(set(submitted)) == 120
        assert len({j.seq for j in jobs}) == 120
        assert s.query(Transition).count() == 120
