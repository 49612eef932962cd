"""The REST API of ``phalanx server`` (FastAPI; its OpenAPI schema at /openapi.json): the app, its routers (a
router per resource, routes/), the dashboard's pages, and the one place where domain errors become HTTP
answers. Every route works in the caller's ``Scope``: the store as that caller may see it (store/access.py),
so tenant isolation is not up to each route. Every error is a 4xx with a message naming what was wrong; a 500
is a bug."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import IntegrityError

from phalanx.control.server import auth, inputs, lifecycle
from phalanx.control.server.deps import Server
from phalanx.control.server.lifecycle import Conflict
from phalanx.control.server.metrics import REQUEST_SECONDS
from phalanx.control.server.routes import auth as auth_routes
from phalanx.control.server.routes import dashboard, jobs, tenants
from phalanx.control.store import Ambiguous, Forbidden, NotFound
from phalanx.spec import SpecError

if TYPE_CHECKING:
    from phalanx.control.server.loop import Controller

MAX_BODY = 1 << 20  # bytes of a request body
UI = Path(__file__).parent / "ui"  # the dashboard's pages, scripts and charting library: no CDN at run time


def create_app(server: Server, controller: Controller | None = None) -> FastAPI:
    """The app; with ``controller``, its control loop runs while the app serves. It stops, giving its lease up,
    as the app shuts down: uvicorn ends a process it stopped on SIGTERM with that signal again, so nothing after
    the server's return would run."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if controller is None:
            yield
            return
        controller.start()
        try:
            yield
        finally:
            await asyncio.to_thread(controller.stop)

    app = FastAPI(
        title="phalanx",
        version="1",
        description="Submit, schedule, run and track training jobs for many tenants.",
        max_body_size=MAX_BODY,
        lifespan=lifespan,
    )
    app.state.server = server
    app.router.route_class = inputs.StrictJSONRoute
    _errors(app)
    for resource in (auth_routes, tenants, jobs, dashboard):
        app.include_router(resource.router)
    app.mount("/ui", StaticFiles(directory=UI, html=True), name="ui")
    app.add_middleware(_Timed)
    return app


class _Timed:
    """Each HTTP request's latency into ``phalanx_http_request_duration_seconds``, by its route's template (one
    series per route, whatever the ids in the path), its method and status. Plain ASGI: it neither buffers a
    response nor touches the WebSocket."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, status = time.perf_counter(), [500]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            REQUEST_SECONDS.labels(route, scope["method"], str(status[0])).observe(time.perf_counter() - began)


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
