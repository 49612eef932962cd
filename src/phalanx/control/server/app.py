"""The REST API of ``phalanx server`` (FastAPI; its OpenAPI schema at /openapi.json). Every route works in
the caller's ``Scope``: the store as that caller may see it (store/access.py), so tenant isolation is not up to
each route. Every error is a 4xx with a message naming what was wrong; a 500 is a bug.

Routes that only read the database are ``async def`` and open their transaction inside (``server.scope``),
with no ``await`` while it is open: a thread hop costs more than the queries of a request (a route with a
sync dependency runs about 1,000 requests/s here, an async one 5,000), and reads never wait for a writer
(SQLite in WAL mode, PostgreSQL's MVCC). Routes that write run in the thread pool: they may wait for the
store's write lock, and a submission parses its spec and checks its files (launch/preflight.py); neither may
hold up the event loop, which answers everyone. So do routes that read run directories (a job's progress,
logs, metrics): an async route touches nothing but the database."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from phalanx.control.server import auth, dashboard, inputs, lifecycle, metrics, views
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
from phalanx.control.store import Ambiguous, Forbidden, Job, NotFound, Role, Scope, Store, Tenant, User, user_key
from phalanx.spec import SpecError

log = logging.getLogger("phalanx.server")
MAX_BODY = 1 << 20  # bytes of a request body
MAX_INT = 2**31 - 1
LIVE_S = 1.0  # how often the live channel looks for changes
UI = Path(__file__).parent / "ui"  # the dashboard's pages, scripts and charting library: no CDN at run time


_bearer = HTTPBearer(auto_error=False, description="an API token: phx_...")


async def _authorization(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str | None:
    return f"{credentials.scheme} {credentials.credentials}" if credentials else None


Token = Annotated[str | None, Depends(_authorization)]


MAX_TOKEN_S = 365 * 86400  # the longest a token may live, whoever makes it (phalanx server --max-token-days)


class Server:
    """What the routes need: the store, where jobs' files go, the cluster's size, a way to wake the loop, and
    the longest a token may live."""

    def __init__(
        self,
        store: Store,
        jobs_dir: Path,
        capacity: int,
        wake: Callable[[], None],
        max_token_s: float = MAX_TOKEN_S,
    ):
        self.store, self.jobs_dir, self.capacity, self.wake = store, jobs_dir, capacity, wake
        self.max_token_s = max_token_s

    @contextlib.contextmanager
    def scope(self, authorization: str | None, write: bool = False) -> Iterator[Scope]:
        """The caller's view of the store, in one transaction: committed when the block ends (``write``),
        rolled back when it raises; 401 unless the token is valid."""
        with self.store.write() if write else self.store.read() as s:
            yield Scope(s, auth.authenticate(s, authorization, time.time()))


def create_app(server: Server) -> FastAPI:
    app = FastAPI(
        title="phalanx",
        version="1",
        description="Submit, schedule, run and track training jobs for many tenants.",
        max_body_size=MAX_BODY,
    )
    app.router.route_class = inputs.StrictJSONRoute
    _errors(app)

    @app.get("/api/v1/whoami", tags=["auth"])
    async def whoami(token: Token) -> dict[str, Any]:
        with server.scope(token) as caller:
            who = caller.who
            return {"user": who.user, "tenant": who.tenant, "role": who.role, "token": who.token}

    # --- tenants
    @app.get("/api/v1/tenants", tags=["tenants"])
    async def list_tenants(token: Token) -> list[TenantOut]:
        with server.scope(token) as caller:
            return [TenantOut.model_validate(t) for t in caller.tenants()]

    @app.post("/api/v1/tenants", status_code=201, tags=["tenants"])
    def create_tenant(body: TenantIn, token: Token) -> TenantOut:
        with server.scope(token, write=True) as caller:
            caller.require_admin("creating a tenant")
            if caller.session.get(Tenant, body.name) is not None:
                raise Conflict(f"tenant {body.name!r} already exists")
            tenant = Tenant(**body.model_dump(), created_at=time.time())
            caller.session.add(tenant)
            caller.session.flush()
            created = TenantOut.model_validate(tenant)
        server.wake()
        return created

    @app.get("/api/v1/tenants/{name}", tags=["tenants"])
    async def get_tenant(name: str, token: Token) -> TenantOut:
        with server.scope(token) as caller:
            return TenantOut.model_validate(caller.tenant(name))

    @app.patch("/api/v1/tenants/{name}", tags=["tenants"])
    def update_tenant(name: str, body: TenantPatch, token: Token) -> TenantOut:
        with server.scope(token, write=True) as caller:
            tenant = caller.tenant(name)
            caller.require_admin(f"changing tenant {name}'s quota")
            for field, value in body.model_dump(exclude_unset=True).items():
                setattr(tenant, field, value)
            changed = TenantOut.model_validate(tenant)
        server.wake()
        return changed

    # --- users and tokens
    @app.get("/api/v1/users", tags=["auth"])
    async def list_users(token: Token) -> list[UserOut]:
        with server.scope(token) as caller:
            return [UserOut.model_validate(u) for u in caller.users()]

    @app.post("/api/v1/users", status_code=201, tags=["auth"])
    def create_user(body: UserIn, token: Token) -> UserOut:
        with server.scope(token, write=True) as caller:
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
            if caller.session.get(User, user_key(tenant, body.name)) is not None:  # of this tenant (or an admin)
                raise Conflict(f"user {body.name!r} already exists" + (f" in tenant {tenant}" if tenant else ""))
            user = User(name=user_key(tenant, body.name), tenant=tenant, role=body.role, created_at=time.time())
            caller.session.add(user)
            caller.session.flush()
            return UserOut.model_validate(user)

    @app.get("/api/v1/tokens", tags=["auth"])
    async def list_tokens(token: Token) -> list[TokenOut]:
        with server.scope(token) as caller:
            return [TokenOut.model_validate(t) for t in caller.tokens()]

    @app.post("/api/v1/tokens", status_code=201, tags=["auth"])
    def create_token(body: TokenIn, token: Token) -> TokenCreated:
        with server.scope(token, write=True) as caller:
            user = caller.user(body.user, body.tenant) if body.user else caller.user_by_key(caller.who.key)
            caller.may_manage(user)
            if body.expires_in_s > server.max_token_s:
                raise lifecycle.Invalid(
                    f"expires_in_s: {body.expires_in_s:g} s is longer than this server lets a token live, "
                    f"{server.max_token_s:g} s ({server.max_token_s / 86400:g} days, --max-token-days)"
                )
            now = time.time()
            row, issued = auth.issue(caller.session, user, body.name, now, now + body.expires_in_s)
            caller.session.flush()
            return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=issued)

    @app.delete("/api/v1/tokens/{token_id}", tags=["auth"])
    def revoke_token(token_id: str, token: Token) -> TokenOut:
        with server.scope(token, write=True) as caller:
            token = caller.token(token_id)
            caller.may_manage(caller.user_by_key(token.user))
            if token.revoked_at is None:
                token.revoked_at = time.time()
            return TokenOut.model_validate(token)

    # --- jobs
    @app.post("/api/v1/jobs", status_code=201, tags=["jobs"])
    def submit_job(body: SubmitIn, token: Token) -> JobOut:
        with server.scope(token, write=True) as caller:
            submission = lifecycle.Submission(body.spec, body.priority, body.tenant, body.workdir or os.getcwd())
            job = lifecycle.submit(caller, submission, server.jobs_dir, server.capacity, time.time())
            queued = _job_out(caller, job, detail=False)
        server.wake()  # after the commit: the loop must see the job
        return queued

    @app.get("/api/v1/jobs", tags=["jobs"])
    def list_jobs(
        token: Token,
        state: Annotated[list[S] | None, Query(description="only jobs in these states")] = None,
        tenant: Annotated[str | None, Query(max_length=63)] = None,
        owner: Annotated[str | None, Query(max_length=63)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
        after: Annotated[int, Query(ge=0, le=MAX_INT, description="a job's seq: the page after it")] = 0,
    ) -> list[JobOut]:
        with server.scope(token) as caller:
            jobs = caller.jobs(state or (), tenant, owner, limit, after)
            return [_job_out(caller, job, detail=job.state in ACTIVE) for job in jobs]

    @app.get("/api/v1/jobs/{job_id}", tags=["jobs"])
    def get_job(job_id: str, token: Token) -> JobOut:
        with server.scope(token) as caller:
            return _job_out(caller, caller.job(job_id), detail=True)

    @app.post("/api/v1/jobs/{job_id}/cancel", tags=["jobs"])
    def cancel_job(job_id: str, token: Token) -> JobOut:
        with server.scope(token, write=True) as caller:
            job = caller.job(job_id, for_update=True)
            lifecycle.cancel(caller, job, time.time())
            cancelling = _job_out(caller, job, detail=False)
        server.wake()
        return cancelling

    @app.get("/api/v1/jobs/{job_id}/logs", tags=["jobs"])
    def job_logs(
        job_id: str,
        token: Token,
        rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
        execution: Annotated[int | None, Query(ge=1, le=MAX_INT, description="default: the latest")] = None,
        offset: Annotated[int, Query(ge=0, le=2**62, description="bytes already read")] = 0,
    ) -> LogChunk:
        with server.scope(token) as caller:
            job = caller.job(job_id)
            return views.logs(job, views.run_dirs(caller, job), rank, execution, offset)

    @app.get("/api/v1/jobs/{job_id}/events", tags=["jobs"])
    def job_events(job_id: str, token: Token) -> JobEvents:
        with server.scope(token) as caller:
            job = caller.job(job_id)
            transitions = [TransitionOut.model_validate(t) for t in caller.transitions(job)]
            return JobEvents(transitions=transitions, events=views.events(views.run_dirs(caller, job)))

    @app.get("/api/v1/jobs/{job_id}/metrics", tags=["jobs"])
    def job_metrics(job_id: str, token: Token) -> list[dict[str, Any]]:
        with server.scope(token) as caller:
            job = caller.job(job_id)
            return views.metrics(views.run_dirs(caller, job))

    @app.get("/api/v1/jobs/{job_id}/goodput", tags=["jobs"])
    def job_goodput(job_id: str, token: Token) -> dict[str, Any]:
        with server.scope(token) as caller:
            job = caller.job(job_id)
            return views.goodput(views.run_dirs(caller, job))

    @app.get("/api/v1/jobs/{job_id}/checkpoints", tags=["jobs"])
    def job_checkpoints(job_id: str, token: Token) -> list[dict[str, Any]]:
        with server.scope(token) as caller:
            return views.checkpoints(caller.job(job_id))

    # --- quotas and usage
    @app.get("/api/v1/quota", tags=["tenants"])
    async def quota(token: Token) -> list[Quota]:
        with server.scope(token) as caller:
            tenants = caller.tenants()
            counts: dict[tuple[str, str], tuple[int, int]] = {
                (tenant, state): (n, gpus or 0)
                for tenant, state, n, gpus in caller.session.execute(
                    select(Job.tenant, Job.state, func.count(), func.sum(Job.gpus))
                    .where(Job.tenant.in_([t.name for t in tenants]))
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
                for t in tenants
            ]

    @app.get("/api/v1/usage", tags=["tenants"])
    def usage(
        token: Token,
        since: Annotated[float, Query(ge=0, le=1e11, allow_inf_nan=False, description="Unix seconds")] = 0.0,
    ) -> UsageReport:
        with server.scope(token) as caller:
            return views.usage(caller, since, time.time())

    # --- the dashboard: its pages' data, kept live over a WebSocket, and the pages themselves
    @app.get("/api/v1/dashboard/jobs", tags=["dashboard"])
    def dashboard_jobs(token: Token) -> dict[str, Any]:
        with server.scope(token) as caller:
            return dashboard.jobs(caller)

    @app.get("/api/v1/dashboard/jobs/{job_id}", tags=["dashboard"])
    def dashboard_job(job_id: str, token: Token) -> dict[str, Any]:
        with server.scope(token) as caller:
            return dashboard.job(caller, job_id)

    @app.get("/api/v1/dashboard/fleet", tags=["dashboard"])
    def dashboard_fleet(token: Token) -> dict[str, Any]:
        with server.scope(token) as caller:
            return dashboard.fleet(caller, server.capacity)

    @app.websocket("/api/v1/dashboard/live")
    async def dashboard_live(ws: WebSocket) -> None:
        """The client sends {"token", "view": jobs | fleet | job, "id"}; the view comes back at once and again
        each time it changes. A browser cannot put a token in a WebSocket's headers, hence the message. The token
        is checked every time, so a revoked one ends the channel (close code 4401; 4404: no such job)."""
        await ws.accept()
        try:
            ask = await ws.receive_json()
            ask = ask if isinstance(ask, dict) else {}
            view = {
                "jobs": dashboard.jobs,
                "fleet": lambda c: dashboard.fleet(c, server.capacity),
                "job": lambda c: dashboard.job(c, str(ask.get("id"))),
            }.get(ask.get("view"))
            if view is None:
                await ws.close(4422, "view: give jobs, fleet or job")
                return
            token = f"Bearer {ask.get('token', '')}"

            def compute() -> dict[str, Any]:
                with server.scope(token) as caller:
                    return view(caller)

            sent = None
            while True:
                try:
                    now = await anyio.to_thread.run_sync(compute)
                except (auth.Unauthenticated, NotFound) as e:
                    await ws.close(4401 if isinstance(e, auth.Unauthenticated) else 4404, str(e)[:120])
                    return
                if now != sent:
                    await ws.send_json(now)
                    sent = now
                with contextlib.suppress(TimeoutError):  # the pause, or the client's leaving
                    await asyncio.wait_for(ws.receive_text(), LIVE_S)
        except (WebSocketDisconnect, ValueError):  # gone, or not JSON
            return

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=UI, html=True), name="ui")

    # --- Prometheus
    @app.get("/metrics", tags=["metrics"], response_class=PlainTextResponse)
    def prometheus(token: Token) -> Response:
        """The server's metrics in Prometheus' text format, of the tenants the token may see (docs/platform.md)."""
        with server.scope(token) as caller:
            body = generate_latest(metrics.registry(caller, server.capacity))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

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

    app.add_exception_handler(RequestValidationError, inputs.validation_failed)
    app.add_exception_handler(auth.Unauthenticated, reply(401))
    app.add_exception_handler(Forbidden, reply(403))
    app.add_exception_handler(NotFound, reply(404))
    app.add_exception_handler(Conflict, reply(409))
    app.add_exception_handler(lifecycle.Invalid, reply(422))
    app.add_exception_handler(Ambiguous, reply(422))
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
