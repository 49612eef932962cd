"""The control plane's store: tables (SQLAlchemy 2), migrations (Alembic), and the tenant-scoped access layer
every read and write of a tenant's rows goes through."""

from phalanx.control.store.access import Ambiguous, Forbidden, Identity, NotFound, Role, Scope, TenantLoad
from phalanx.control.store.database import Store, StoreError, connect, migrate, open_store
from phalanx.control.store.schema import (
    ACTIVE,
    FINAL,
    Base,
    Execution,
    Job,
    JobState,
    Tenant,
    Token,
    Transition,
    User,
    month_start,
    user_key,
    user_name,
)

__all__ = [
    "ACTIVE",
    "FINAL",
    "Ambiguous",
    "Base",
    "Execution",
    "Forbidden",
    "Identity",
    "Job",
    "JobState",
    "NotFound",
    "Role",
    "Scope",
    "Store",
    "StoreError",
    "Tenant",
    "TenantLoad",
    "Token",
    "Transition",
    "User",
    "connect",
    "migrate",
    "month_start",
    "open_store",
    "user_key",
    "user_name",
]
