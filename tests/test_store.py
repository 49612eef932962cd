"""The control plane's store, on SQLite and on a real PostgreSQL: migrations, tenant isolation in the access
layer, tokens, job transitions, and concurrent writers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select, text

from phalanx.control.server import auth, lifecycle
from phalanx.control.server.lifecycle import Submission
from phalanx.control.store import (
    Ambiguous,
    Base,
    Execution,
    Identity,
    Job,
    JobState,
    NotFound,
    Role,
    Scope,
    Tenant,
    Transition,
    User,
    connect,
    migrate,
    open_store,
    user_key,
    user_name,
)
from phalanx.control.store.access import Forbidden, spend

SPEC = "name: t\nresources: {procs_per_node: 1, device: cpu}\ncommand: [python, -c, pass]\n"


def _world(store) -> dict[str, Identity]:
    """Tenants a and b, each with a tenant-admin, a member and a viewer, and an admin; their identities."""
    who = {"admin": Identity("admin", None, Role.ADMIN, "-")}
    with store.write() as s:
        s.add(User(name="admin", tenant=None, role=Role.ADMIN, created_at=0.0))
        for tenant in ("a", "b"):
            s.add(Tenant(name=tenant, nominal_gpus=4, cohort=None, borrowing_limit=None, created_at=0.0))
            s.flush()
            for role in (Role.TENANT_ADMIN, Role.MEMBER, Role.VIEWER):
                name = f"{tenant}-{role}"
                s.add(User(name=user_key(tenant, name), tenant=tenant, role=role, created_at=0.0))
                who[name] = Identity(name, tenant, role, "-")
    return who


def _submit(store, who: Identity, tenant: str | None = None) -> str:
    with store.write() as s:
        job = lifecycle.submit(Scope(s, who), Submission(SPEC, 0, tenant, "/"), Path("/jobs"), {"gpu": 8}, 1.0)
        return job.id


def test_migrations_give_the_models_schema(database_url: str) -> None:
    store = open_store(database_url)
    with store.engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
    open_store(database_url)  # migrating again is a no-op


def test_migration_0002_names_users_per_tenant_and_keeps_their_tokens_and_jobs(database_url: str) -> None:
    """A database of the first schema, with a tenant's user, its token and its job, upgraded: the user is keyed
    <tenant>/<name>, and its token and job follow it."""
    engine = connect(database_url)
    migrate(engine, "0001")
    with engine.begin() as c:
        c.execute(text("INSERT INTO tenants VALUES ('a', 4, NULL, NULL, 0)"))
        c.execute(text("INSERT INTO users VALUES ('root', NULL, 'admin', 0), ('alice', 'a', 'member', 0)"))
        c.execute(
            text("INSERT INTO tokens VALUES ('0123456789ab', 'alice', 'ci', :sha, 0, NULL, NULL)"),
            {"sha": auth.digest("s" * 43)},
        )
        c.execute(
            text(
                "INSERT INTO jobs (id, tenant, owner, name, spec, workdir, priority, workers, gpus, state, reason, "
                "submitted_at, queued_at, attempt, cancel_requested, preemptions, preempted_by) VALUES ('j', 'a', "
                "'alice', 't', '', '/', 0, 1, 1, 'PENDING', '', 0, 0, 0, false, 0, '[]')"
            )
        )
    store = open_store(database_url)
    with store.write() as s:
        assert sorted(u.name for u in s.scalars(select(User))) == ["a/alice", "root"]
        assert s.scalar(select(Job.owner)) == "a/alice"
        who = auth.authenticate(s, "Bearer phx_0123456789ab_" + "s" * 43, now=1.0)
        assert (who.user, who.tenant, who.key) == ("alice", "a", "a/alice")
        assert [j.id for j in Scope(s, who).jobs(owner="alice")] == ["j"]
    engine.dispose()


def test_migration_0003_stores_what_the_server_reads_of_each_spec(database_url: str) -> None:
    """Jobs submitted before 0003 get their total steps, nodes and checkpoint location from their stored spec;
    a spec that is not a mapping gets the defaults."""
    engine = connect(database_url)
    migrate(engine, "0002")
    recipe = "name: r\nresources:\n  nodes: 2\ntrain:\n  steps: 7\ncheckpoint:\n  dir: s3://b/ckpt\n"
    with engine.begin() as c:
        c.execute(text("INSERT INTO tenants VALUES ('a', 4, NULL, NULL, 0)"))
        c.execute(text("INSERT INTO users VALUES ('a/alice', 'a', 'member', 0)"))
        for job_id, spec in (("recipe", recipe), ("script", "name: s\ncommand: [python, x.py]\n"), ("odd", "[1]")):
            c.execute(
                text(
                    "INSERT INTO jobs (id, tenant, owner, name, spec, workdir, priority, workers, gpus, state, "
                    "reason, submitted_at, queued_at, attempt, cancel_requested, preemptions, preempted_by) VALUES "
                    "(:id, 'a', 'a/alice', 't', :spec, '/', 0, 1, 1, 'PENDING', '', 0, 0, 0, false, 0, '[]')"
                ),
                {"id": job_id, "spec": spec},
            )
    store = open_store(database_url)
    with store.read() as s:
        stored = {j.id: (j.total_steps, j.nodes, j.checkpoint_dir) for j in s.scalars(select(Job))}
    assert stored == {"recipe": (7, 2, "s3://b/ckpt"), "script": (None, 1, None), "odd": (None, 1, None)}
    engine.dispose()


def test_each_tenant_names_its_users_and_learns_nothing_of_another_tenants(database_url: str) -> None:
    store = open_store(database_url)
    who = _world(store)
    with store.write() as s:  # b's tenant-admin makes a user named as one of a's: no conflict, nothing confirmed
        s.add(User(name=user_key("b", "a-member"), tenant="b", role=Role.MEMBER, created_at=0.0))
    with store.write() as s:
        assert Scope(s, who["a-tenant-admin"]).user("a-member").tenant == "a"
        assert Scope(s, who["b-tenant-admin"]).user("a-member").tenant == "b"
        with pytest.raises(NotFound):
            Scope(s, who["b-tenant-admin"]).user("a-viewer")
        admin = Scope(s, who["admin"])
        with pytest.raises(Ambiguous, match="tenants a, b: name its tenant"):
            admin.user("a-member")
        assert admin.user("a-member", "b").name == "b/a-member" and admin.user("a-viewer").tenant == "a"


def test_a_scope_sees_its_tenant_only(database_url: str) -> None:
    store = open_store(database_url)
    who = _world(store)
    a_job, b_job = _submit(store, who["a-member"]), _submit(store, who["b-member"])
    with store.write() as s:  # a's ran 2 s at $1 a second; b's runs at $2 a second
        for job_id, ended, per_h in ((a_job, 4.0, 3600.0), (b_job, None, 7200.0)):
            job = s.scalar(select(Job).where(Job.id == job_id))
            s.add(Execution(job=job.seq, tenant=job.tenant, attempt=1, gpus=1, started_at=2.0, ended_at=ended,
                            dollars_per_h=per_h))  # fmt: skip
    with store.write() as s:
        for role in ("tenant-admin", "member", "viewer"):
            scope = Scope(s, who[f"a-{role}"])
            assert [j.id for j in scope.jobs()] == [a_job]
            assert [job_id for _, job_id in scope.executions()] == [a_job]
            assert [t.name for t in scope.tenants()] == ["a"]
            assert {user_name(u.name) for u in scope.users()} == {"a-tenant-admin", "a-member", "a-viewer"}
            others = ((scope.job, b_job), (scope.tenant, "b"), (scope.user, "b-member"), (scope.user, "admin"))
            for lookup, key in others:
                with pytest.raises(NotFound):
                    lookup(key)
            assert scope.jobs(tenant="b") == []
            assert scope.spend(0.0, 10.0) == {"a": (2.0, 0.0)}
        admin = Scope(s, who["admin"])
        assert {j.id for j in admin.jobs()} == {a_job, b_job}
        assert admin.job(b_job).tenant == "b"
        assert admin.spend(3.0, 10.0) == {"a": (1.0, 0.0), "b": (14.0, 7200.0)}  # from 3 s on; b until now
        assert spend(s, 0.0, 10.0, ended_only=True) == {"a": (2.0, 0.0)}
        assert [e.dollars(3.0, 10.0) for e, _ in admin.executions()] == [1.0, 14.0]  # the same sum, per execution


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
        assert job.state == JobState.CANCELLED
        with pytest.raises(lifecycle.Conflict, match="already ended"):
            lifecycle.cancel(Scope(s, who["admin"]), job, 3.0)
        with pytest.raises(lifecycle.Conflict, match="cannot become RUNNING"):
            lifecycle.move(s, job, JobState.RUNNING, "no", 3.0)
        history = s.scalars(select(Transition).where(Transition.job == job.seq).order_by(Transition.id)).all()
        assert [(t.from_state, t.to_state) for t in history] == [(None, "PENDING"), ("PENDING", "CANCELLED")]
        assert history[1].cause == "cancelled by a-tenant-admin"


def test_tokens_are_kept_as_hashes_and_expire_and_revoke(database_url: str) -> None:
    store = open_store(database_url)
    _world(store)
    with store.write() as s:
        user = s.get(User, "a/a-member")
        row, token = auth.issue(user, "ci", now=100.0, expires_at=200.0)
        s.add(row)
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
