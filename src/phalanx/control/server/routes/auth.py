"""Who the caller is, users and tokens."""

from __future__ import annotations

import time
from typing import Any

from phalanx.control.server import auth, lifecycle
from phalanx.control.server.deps import ServerDep, Token
from phalanx.control.server.lifecycle import Conflict
from phalanx.control.server.models import TokenCreated, TokenIn, TokenOut, UserIn, UserOut
from phalanx.control.server.routes import router as _router
from phalanx.control.store import Role, User, user_key

router = _router()


@router.get("/api/v1/whoami", tags=["auth"])
async def whoami(server: ServerDep, token: Token) -> dict[str, Any]:
    with server.scope(token) as caller:
        who = caller.who
        return {"user": who.user, "tenant": who.tenant, "role": who.role, "token": who.token}


@router.get("/api/v1/users", tags=["auth"])
async def list_users(server: ServerDep, token: Token) -> list[UserOut]:
    with server.scope(token) as caller:
        return [UserOut.model_validate(u) for u in caller.users()]


@router.post("/api/v1/users", status_code=201, tags=["auth"])
def create_user(body: UserIn, server: ServerDep, token: Token) -> UserOut:
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
        if caller.has_user(user_key(tenant, body.name)):  # of this tenant (or an admin)
            raise Conflict(f"user {body.name!r} already exists" + (f" in tenant {tenant}" if tenant else ""))
        user = User(name=user_key(tenant, body.name), tenant=tenant, role=body.role, created_at=time.time())
        caller.add(user)
        return UserOut.model_validate(user)


@router.get("/api/v1/tokens", tags=["auth"])
async def list_tokens(server: ServerDep, token: Token) -> list[TokenOut]:
    with server.scope(token) as caller:
        return [TokenOut.model_validate(t) for t in caller.tokens()]


@router.post("/api/v1/tokens", status_code=201, tags=["auth"])
def create_token(body: TokenIn, server: ServerDep, token: Token) -> TokenCreated:
    with server.scope(token, write=True) as caller:
        user = caller.user(body.user, body.tenant) if body.user else caller.user_by_key(caller.who.key)
        caller.may_manage(user)
        if body.expires_in_s > server.max_token_s:
            raise lifecycle.Invalid(
                f"expires_in_s: {body.expires_in_s:g} s is longer than this server lets a token live, "
                f"{server.max_token_s:g} s ({server.max_token_s / 86400:g} days, --max-token-days)"
            )
        now = time.time()
        row, issued = auth.issue(user, body.name, now, now + body.expires_in_s)
        caller.add(row)
        return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=issued)


@router.delete("/api/v1/tokens/{token_id}", tags=["auth"])
def revoke_token(token_id: str, server: ServerDep, token: Token) -> TokenOut:
    with server.scope(token, write=True) as caller:
        found = caller.token(token_id)
        caller.may_manage(caller.user_by_key(found.user))
        if found.revoked_at is None:
            found.revoked_at = time.time()
        return TokenOut.model_validate(found)
