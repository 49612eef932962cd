"""The dashboard's data, kept live over a WebSocket, and the server's Prometheus metrics."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import anyio
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from phalanx.control.server import auth, dashboard, metrics
from phalanx.control.server.deps import Server, ServerDep, Token
from phalanx.control.server.routes import router as _router
from phalanx.control.store import NotFound

LIVE_S = 1.0  # how often the live channel looks for changes
router = _router()


@router.get("/api/v1/dashboard/jobs", tags=["dashboard"])
def dashboard_jobs(server: ServerDep, token: Token) -> dict[str, Any]:
    with server.scope(token) as caller:
        return dashboard.jobs(caller)


@router.get("/api/v1/dashboard/jobs/{job_id}", tags=["dashboard"])
def dashboard_job(job_id: str, server: ServerDep, token: Token) -> dict[str, Any]:
    with server.scope(token) as caller:
        return dashboard.job(caller, job_id)


@router.get("/api/v1/dashboard/fleet", tags=["dashboard"])
def dashboard_fleet(server: ServerDep, token: Token) -> dict[str, Any]:
    with server.scope(token) as caller:
        return dashboard.fleet(caller, server.capacity, server.described)


@router.websocket("/api/v1/dashboard/live")
async def dashboard_live(ws: WebSocket) -> None:
    """The client sends {"token", "view": jobs | fleet | job, "id"}; the view comes back at once and again each
    time it changes. A browser cannot put a token in a WebSocket's headers, hence the message. The token is
    checked every time, so a revoked one ends the channel (close code 4401; 4404: no such job)."""
    server: Server = ws.app.state.server
    await ws.accept()
    try:
        ask = await ws.receive_json()
        ask = ask if isinstance(ask, dict) else {}
        view = {
            "jobs": dashboard.jobs,
            "fleet": lambda c: dashboard.fleet(c, server.capacity, server.described),
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


@router.get("/", include_in_schema=False)
def home() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/metrics", tags=["metrics"], response_class=PlainTextResponse)
def prometheus(server: ServerDep, token: Token) -> Response:
    """The server's metrics in Prometheus' text format, of the tenants the token may see (docs/platform.md)."""
    with server.scope(token) as caller:
        body = generate_latest(metrics.registry(caller, server.capacity))
    return Response(body, media_type=CONTENT_TYPE_LATEST)
