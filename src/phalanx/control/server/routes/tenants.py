"""Tenants, their quotas and what they use."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Query

from phalanx.control.server import views
from phalanx.control.server.deps import Server, ServerDep, Token
from phalanx.control.server.lifecycle import Conflict
from phalanx.control.server.models import (
    Cluster,
    Quota,
    SpeedTable,
    Spend,
    TenantIn,
    TenantOut,
    TenantPatch,
    UsageReport,
)
from phalanx.control.server.routes import router as _router
from phalanx.control.store import Tenant
from phalanx.control.store.lease import leader

router = _router()


@router.get("/api/v1/tenants", tags=["tenants"])
async def list_tenants(server: ServerDep, token: Token) -> list[TenantOut]:
    with server.scope(token) as caller:
        return [TenantOut.model_validate(t) for t in caller.tenants()]


@router.post("/api/v1/tenants", status_code=201, tags=["tenants"])
def create_tenant(body: TenantIn, server: ServerDep, token: Token) -> TenantOut:
    with server.scope(token, write=True) as caller:
        caller.require_admin("creating a tenant")
        if caller.has_tenant(body.name):
            raise Conflict(f"tenant {body.name!r} already exists")
        tenant = Tenant(**body.model_dump(), created_at=time.time())
        caller.add(tenant)
        created = _checked(TenantOut.model_validate(tenant), server)
    server.wake()
    return created


@router.get("/api/v1/tenants/{name}", tags=["tenants"])
async def get_tenant(name: str, server: ServerDep, token: Token) -> TenantOut:
    with server.scope(token) as caller:
        return TenantOut.model_validate(caller.tenant(name))


@router.patch("/api/v1/tenants/{name}", tags=["tenants"])
def update_tenant(name: str, body: TenantPatch, server: ServerDep, token: Token) -> TenantOut:
    with server.scope(token, write=True) as caller:
        tenant = caller.tenant(name)
        caller.require_admin(f"changing tenant {name}'s quota")
        for field, value in body.model_dump(exclude_unset=True).items():
            setattr(tenant, field, value)
        changed = _checked(TenantOut.model_validate(tenant), server)
    server.wake()
    return changed


def _checked(tenant: TenantOut, server: Server) -> TenantOut:
    """A quota larger than the whole cluster is kept (the cluster may grow), with a warning."""
    if tenant.nominal_gpus > server.capacity:
        tenant.warning = (
            f"tenant {tenant.name}'s quota of {tenant.nominal_gpus} {server.unit} is more than the cluster's "
            f"{server.capacity}: it can never hold all of it"
        )
    return tenant


@router.get("/api/v1/cluster", tags=["tenants"])
async def cluster(server: ServerDep, token: Token) -> Cluster:
    """What the tenants' quotas share: the executor's capacity, and what it counts (GPUs, or CPU slots); and
    which server process runs the control loop."""
    with server.scope(token) as caller:
        held = leader(caller.session, time.time())
        return Cluster(
            capacity=server.capacity, types=server.types, unit=server.unit,
            leader=held[0] if held else None, lease_epoch=held[1] if held else None,
        )  # fmt: skip


@router.get("/api/v1/speeds", tags=["tenants"])
def speeds(server: ServerDep, token: Token) -> SpeedTable:
    """How fast each kind of the caller's jobs runs on each GPU type (the scheduler's speed table)."""
    with server.scope(token) as caller:
        return views.speed_table(caller, server.described)


@router.get("/api/v1/quota", tags=["tenants"])
async def quota(server: ServerDep, token: Token) -> list[Quota]:
    with server.scope(token) as caller:
        return [
            Quota(
                tenant=load.tenant.name,
                nominal_gpus=load.tenant.nominal_gpus,
                cohort=load.tenant.cohort,
                borrowing_limit=load.tenant.borrowing_limit,
                gpus_in_use=load.gpus_in_use,
                jobs_running=load.jobs_active,
                jobs_pending=load.jobs_pending,
            )
            for load in caller.tenant_loads()
        ]


@router.get("/api/v1/usage", tags=["tenants"])
def usage(
    server: ServerDep,
    token: Token,
    since: Annotated[float, Query(ge=0, le=1e11, allow_inf_nan=False, description="Unix seconds")] = 0.0,
) -> UsageReport:
    with server.scope(token) as caller:
        return views.usage(caller, since, time.time())


@router.get("/api/v1/spend", tags=["tenants"])
def spend(server: ServerDep, token: Token) -> Spend:
    """This calendar month's (UTC) dollars per tenant against its monthly budget, and the fleet's."""
    with server.scope(token) as caller:
        return views.spend(caller, time.time())
