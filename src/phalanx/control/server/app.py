"""The REST API of ``phalanx server`` (FastAPI; its OpenAPI schema at /openapi.json). Every route takes the
caller's ``Scope``: the store as that caller may see it (store/access.py), so tenant isolation is not up to
each route. Every error is a 4xx with a message naming what was wrong; a 500 is a bug."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from phalanx.control.server import auth, lifecycle, views
from phalanx.control.server.lifecycle import ACTIVE, Conflict, S
from phalanx.control.server.models import (
    JobEvents,
    JobOut,
    LogChunk,
    Quota,
    SubmitIn,
    TenantIn,
    TenantOut,
    TenantPatch,
    TokenCreated,
    TokenIn,
    TokenOut,
    TransitionOut,
    UsageReport,
    UserIn,
    UserOut,
)
from phalanx.control.store import Forbidden, Job, NotFound, Role, Scope, Tenant, User
from phalanx.spec import SpecError

log = logging.getLogger("phalanx.server")
MAX_BODY = 1 << 20  # bytes of a request body
MAX_INT = 2**31 - 1


_bearer = HTTPBearer(auto_error=False, description="an API token: phx_...")


def _session(request: Request) -> Iterator[Session]:
    """One transaction per request: committed when the route returns, rolled back when it raises."""
    with request.app.state.server.sessions.begin() as s:
        yield s


def _scope(
    s: Annotated[Session, Depends(_session)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Scope:
    header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
    return Scope(s, auth.authenticate(s, header, time.time()))


Caller = Annotated[Scope, Depends(_scope)]


class Server:
    """What the routes need: the store, where jobs' files go, the cluster's size, and a way to wake the loop."""

    def __init__(self, sessions: sessionmaker[Session], jobs_dir: Path, capacity: int, wake: Callable[[], None]):
        self.sessions, self.jobs_dir, self.capacity, self.wake = sessions, jobs_dir, capacity, wake


def create_app(server: Server) -> FastAPI:
    app = FastAPI(
        title="phalanx",
        version="1",
        description="Submit, schedule, run and track training jobs for many tenants.",
    )
    app.state.server = server
    _errors(app)
    app.add_middleware(_BodyLimit, limit=MAX_BODY)

    @app.get("/api/v1/whoami", tags=["auth"])
    def whoami(caller: Caller) -> dict[str, Any]:
        who = caller.who
        return {"user": who.user, "tenant": who.tenant, "role": who.role, "token": who.token}

    # --- tenants
    @app.get("/api/v1/tenants", tags=["tenants"])
    def list_tenants(caller: Caller) -> list[TenantOut]:
        return [TenantOut.model_validate(t) for t in caller.tenants()]

    @app.post("/api/v1/tenants", status_code=201, tags=["tenants"])
    def create_tenant(body: TenantIn, caller: Caller) -> TenantOut:
        caller.require_admin("creating a tenant")
        if caller.session.get(Tenant, body.name) is not None:
            raise Conflict(f"tenant {body.name!r} already exists")
        tenant = Tenant(**body.model_dump(), created_at=time.time())
        caller.session.add(tenant)
        caller.session.flush()
        server.wake()
        return TenantOut.model_validate(tenant)

    @app.get("/api/v1/tenants/{name}", tags=["tenants"])
    def get_tenant(name: str, caller: Caller) -> TenantOut:
        return TenantOut.model_validate(caller.tenant(name))

    @app.patch("/api/v1/tenants/{name}", tags=["tenants"])
    def update_tenant(name: str, body: TenantPatch, caller: Caller) -> TenantOut:
        tenant = caller.tenant(name)
        caller.require_admin(f"changing tenant {name}'s quota")
        for field, value in body.model_dump(exclude_unset=True).items():
            setattr(tenant, field, value)
        server.wake()
        return TenantOut.model_validate(tenant)

    # --- users and tokens
    @app.get("/api/v1/users", tags=["auth"])
    def list_users(caller: Caller) -> list[UserOut]:
        return [UserOut.model_validate(u) for u in caller.users()]

    @app.post("/api/v1/users", status_code=201, tags=["auth"])
    def create_user(body: UserIn, caller: Caller) -> UserOut:
        if body.role is Role.ADMIN:
            caller.require_admin("creating an admin")
            if body.tenant is not None:
                raise lifecycle.Invalid("tenant: an admin belongs to no tenant; leave it out")
            tenant = None
        else:
            if body.tenant is None and caller.who.tenant is None:
                raise lifecycle.Invalid("tenant: name the new user's tenant (an admin belongs to none)")
            tenant = caller.tenant(body.tenant or caller.who.tenant).name
        caller.require(Role.TENANT_ADMIN, action="creating a user")
        if caller.session.get(User, body.name) is not None:
            raise Conflict(f"user {body.name!r} already exists")
        user = User(name=body.name, tenant=tenant, role=body.role, created_at=time.time())
        caller.session.add(user)
        caller.session.flush()
        return UserOut.model_validate(user)

    @app.get("/api/v1/tokens", tags=["auth"])
    def list_tokens(caller: Caller) -> list[TokenOut]:
        return [TokenOut.model_validate(t) for t in caller.tokens()]

    @app.post("/api/v1/tokens", status_code=201, tags=["auth"])
    def create_token(body: TokenIn, caller: Caller) -> TokenCreated:
        user = caller.user(body.user or caller.who.user)
        caller.may_manage(user)
        now = time.time()
        expires = now + body.expires_in_s if body.expires_in_s is not None else None
        row, token = auth.issue(caller.session, user, body.name, now, expires)
        caller.session.flush()
        return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=token)

    @app.delete("/api/v1/tokens/{token_id}", tags=["auth"])
    def revoke_token(token_id: str, caller: Caller) -> TokenOut:
        token = caller.token(token_id)
        caller.may_manage(caller.user(token.user))
        if token.revoked_at is None:
            token.revoked_at = time.time()
        return TokenOut.model_validate(token)

    # --- jobs
    @app.post("/api/v1/jobs", status_code=201, tags=["jobs"])
    def submit_job(body: SubmitIn, caller: Caller) -> JobOut:
        submission = lifecycle.Submission(body.spec, body.priority, body.tenant, body.workdir or os.getcwd())
        job = lifecycle.submit(caller, submission, server.jobs_dir, server.capacity, time.time())
        server.wake()
        return _job_out(caller, job, detail=False)

    @app.get("/api/v1/jobs", tags=["jobs"])
    def list_jobs(
        caller: Caller,
        state: Annotated[list[S] | None, Query(description="only jobs in these states")] = None,
        tenant: Annotated[str | None, Query(max_length=63)] = None,
        owner: Annotated[str | None, Query(max_length=63)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
        after: Annotated[int, Query(ge=0, le=MAX_INT, description="a job's seq: the page after it")] = 0,
    ) -> list[JobOut]:
        jobs = caller.jobs(state or (), tenant, owner, limit, after)
        return [_job_out(caller, job, detail=job.state in ACTIVE) for job in jobs]

    @app.get("/api/v1/jobs/{job_id}", tags=["jobs"])
    def get_job(job_id: str, caller: Caller) -> JobOut:
        return _job_out(caller, caller.job(job_id), detail=True)

    @app.post("/api/v1/jobs/{job_id}/cancel", tags=["jobs"])
    def cancel_job(job_id: str, caller: Caller) -> JobOut:
        job = caller.job(job_id, for_update=True)
        lifecycle.cancel(caller, job, time.time())
        server.wake()
        return _job_out(caller, job, detail=False)

    @app.get("/api/v1/jobs/{job_id}/logs", tags=["jobs"])
    def job_logs(
        job_id: str,
        caller: Caller,
        rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
        execution: Annotated[int | None, Query(ge=1, le=MAX_INT, description="default: the latest")] = None,
        offset: Annotated[int, Query(ge=0, le=2**62, description="bytes already read")] = 0,
    ) -> LogChunk:
        job = caller.job(job_id)
        return views.logs(job, views.run_dirs(caller, job), rank, execution, offset)

    @app.get("/api/v1/jobs/{job_id}/events", tags=["jobs"])
    def job_events(job_id: str, caller: Caller) -> JobEvents:
        job = caller.job(job_id)
        transitions = [TransitionOut.model_validate(t) for t in caller.transitions(job)]
        return JobEvents(transitions=transitions, events=views.events(views.run_dirs(caller, job)))

    @app.get("/api/v1/jobs/{job_id}/metrics", tags=["jobs"])
    def job_metrics(job_id: str, caller: Caller) -> list[dict[str, Any]]:
        job = caller.job(job_id)
        return views.metrics(views.run_dirs(caller, job))

    @app.get("/api/v1/jobs/{job_id}/goodput", tags=["jobs"])
    def job_goodput(job_id: str, caller: Caller) -> dict[str, Any]:
        job = caller.job(job_id)
        return views.goodput(views.run_dirs(caller, job))

    @app.get("/api/v1/jobs/{job_id}/checkpoints", tags=["jobs"])
    def job_checkpoints(job_id: str, caller: Caller) -> list[dict[str, Any]]:
        return views.checkpoints(caller.job(job_id))

    # --- quotas and usage
    @app.get("/api/v1/quota", tags=["tenants"])
    def quota(caller: Caller) -> list[Quota]:
        counts: dict[tuple[str, str], tuple[int, int]] = {
            (tenant, state): (n, gpus or 0)
            for tenant, state, n, gpus in caller.session.execute(
                select(Job.tenant, Job.state, func.count(), func.sum(Job.gpus))
                .where(Job.tenant.in_([t.name for t in caller.tenants()]))
                .where(Job.state.in_((*ACTIVE, S.PENDING)))
                .group_by(Job.tenant, Job.state)
            )
        }
        return [
            Quota(
                tenant=t.name,
                quota_gpus=t.quota_gpus,
                cohort=t.cohort,
                borrowing_limit=t.borrowing_limit,
                gpus_in_use=sum(counts.get((t.name, s), (0, 0))[1] for s in ACTIVE),
                jobs_running=sum(counts.get((t.name, s), (0, 0))[0] for s in ACTIVE),
                jobs_pending=counts.get((t.name, S.PENDING), (0, 0))[0],
            )
            for t in caller.tenants()
        ]

    @app.get("/api/v1/usage", tags=["tenants"])
    def usage(
        caller: Caller,
        since: Annotated[float, Query(ge=0, le=1e11, allow_inf_nan=False, description="Unix seconds")] = 0.0,
    ) -> UsageReport:
        return views.usage(caller, since, time.time())

    return app


def _job_out(caller: Scope, job: Job, detail: bool) -> JobOut:
    out = JobOut.model_validate(job)
    if detail:
        out.steps_done, out.total_steps = views.progress(job, views.run_dirs(caller, job))
    return out


def _errors(app: FastAPI) -> None:
    """Each failure the routes raise, as the status code and message a client can act on."""

    def reply(status: int) -> Callable[[Request, Exception], JSONResponse]:
        return lambda _request, e: JSONResponse({"detail": str(e)}, status_code=status)

    app.add_exception_handler(auth.Unauthenticated, reply(401))
    app.add_exception_handler(Forbidden, reply(403))
    app.add_exception_handler(NotFound, reply(404))
    app.add_exception_handler(Conflict, reply(409))
    app.add_exception_handler(lifecycle.Invalid, reply(422))
    app.add_exception_handler(
        IntegrityError, lambda _r, _e: JSONResponse({"detail": "conflicts with an existing record"}, status_code=409)
    )

    @app.exception_handler(SpecError)
    def invalid_spec(_request: Request, e: SpecError) -> JSONResponse:
        detail = [
            {"loc": ["body", "spec", *(issue.path.split(".") if issue.path else [])], "msg": issue.message,
             "type": "invalid_spec"}
            for issue in e.issues
        ]  # fmt: skip
        return JSONResponse({"detail": detail}, status_code=422)


class _BodyLimit:
    """413 for a request body over ``limit`` bytes, declared or streamed, before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await _too_large(send, self.limit)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            return await self.app(scope, limited, send)
        except _TooLarge:
            return await _too_large(send, self.limit)


class _TooLarge(Exception):
    pass


async def _too_large(send, limit: int) -> None:
    response = JSONResponse({"detail": f"request body over {limit} bytes"}, status_code=413)
    await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
