"""users named per tenant: a tenant's user is keyed <tenant>/<name>, so two tenants may each have an alice and
creating one tells nothing of the other's

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

KEY = sa.String(length=127)  # <tenant>/<name>: two names of at most 63


def upgrade() -> None:
    with op.batch_alter_table("users") as batch_op:
        batch_op.alter_column("name", type_=KEY, existing_type=sa.String(length=63), existing_nullable=False)
    with op.batch_alter_table("tokens") as batch_op:
        batch_op.alter_column("user", type_=KEY, existing_type=sa.String(length=63), existing_nullable=False)
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("owner", type_=KEY, existing_type=sa.String(length=63), existing_nullable=False)
    connection = op.get_bind()
    users = connection.execute(sa.text("SELECT name, tenant, role, created_at FROM users WHERE tenant IS NOT NULL"))
    for name, tenant, role, created_at in users.all():
        key = f"{tenant}/{name}"
        connection.execute(
            sa.text("INSERT INTO users (name, tenant, role, created_at) VALUES (:key, :tenant, :role, :at)"),
            {"key": key, "tenant": tenant, "role": role, "at": created_at},
        )
        for table, column in (("tokens", '"user"'), ("jobs", "owner")):
            connection.execute(
                sa.text(f"UPDATE {table} SET {column} = :key WHERE {column} = :name"), {"key": key, "name": name}
            )
        connection.execute(sa.text("DELETE FROM users WHERE name = :name"), {"name": name})


def downgrade() -> None:
    raise NotImplementedError("users named per tenant cannot go back to one namespace: two tenants may share a name")
