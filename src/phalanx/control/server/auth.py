"""API tokens: ``phx_<id>_<secret>``. The id finds the row; only the secret's SHA-256 is stored and it is
compared in constant time, so the database never holds a usable token and a token is shown once, when made.
Tokens are never logged: the access log of ``phalanx server`` records paths, not headers."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from phalanx.control.store import Identity, Role, Token, User, user_name

_FORMAT = re.compile(r"phx_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_DUMMY = hashlib.sha256(b"no such token").hexdigest()
_LOOKUP = (
    select(Token.secret_sha256, Token.revoked_at, Token.expires_at, User.name, User.tenant, User.role)
    .join(User, User.name == Token.user)
    .where(Token.id == bindparam("id"))
)


class Unauthenticated(Exception):
    pass


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue(user: User, name: str, now: float, expires_at: float | None) -> tuple[Token, str]:
    """A new token for ``user``: the row to keep (the caller adds it) and the token itself, to hand over once."""
    token_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    row = Token(
        id=token_id,
        user=user.name,
        name=name,
        secret_sha256=digest(secret),
        created_at=now,
        expires_at=expires_at,
        revoked_at=None,
    )
    return row, f"phx_{token_id}_{secret}"


def authenticate(session: Session, authorization: str | None, now: float) -> Identity:
    """The identity behind an ``Authorization: Bearer <token>`` header. One message for every way it can be
    wrong, so that a caller learns nothing about which tokens exist."""
    scheme, _, token = (authorization or "").partition(" ")
    match = _FORMAT.fullmatch(token.strip()) if scheme.lower() == "bearer" else None
    row = session.execute(_LOOKUP, {"id": match.group(1)}).first() if match else None  # one query, every request
    expected = row.secret_sha256 if row is not None else _DUMMY
    valid = hmac.compare_digest(digest(match.group(2) if match else ""), expected)
    if not valid or row is None or row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
        raise Unauthenticated("missing, invalid, expired or revoked token; send Authorization: Bearer phx_...")
    return Identity(user_name(row.name), row.tenant, Role(row.role), match.group(1))
