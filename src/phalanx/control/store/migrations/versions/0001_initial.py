"""initial schema: tenants, users, tokens, jobs, transitions, executions

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("quota_gpus", sa.Integer(), nullable=False),
        sa.Column("cohort", sa.String(length=63), nullable=True),
        sa.Column("borrowing_limit", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "users",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant"],
            ["tenants.name"],
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "jobs",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("owner", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("workdir", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("workers", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("submitted_at", sa.Float(), nullable=False),
        sa.Column("queued_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("placement", sa.JSON(), nullable=True),
        sa.Column("handle", sa.JSON(), nullable=True),
        sa.Column("evicting_for", sa.String(length=32), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("preempted_by", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["owner"],
            ["users.name"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant"],
            ["tenants.name"],
        ),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_state", ["state"], unique=False)
        batch_op.create_index("ix_jobs_tenant_state", ["tenant", "state"], unique=False)

    op.create_table(
        "tokens",
        sa.Column("id", sa.String(length=16), nullable=False),
        sa.Column("user", sa.String(length=63), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=True),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["user"],
            ["users.name"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tokens_user"), ["user"], unique=False)

    op.create_table(
        "executions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job", sa.Integer(), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("run_dir", sa.Text(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("productive_s", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job"],
            ["jobs.seq"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant"],
            ["tenants.name"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_executions_job"), ["job"], unique=False)
        batch_op.create_index(batch_op.f("ix_executions_tenant"), ["tenant"], unique=False)

    op.create_table(
        "transitions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job"],
            ["jobs.seq"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("transitions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_transitions_job"), ["job"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("transitions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_transitions_job"))

    op.drop_table("transitions")
    with op.batch_alter_table("executions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_executions_tenant"))
        batch_op.drop_index(batch_op.f("ix_executions_job"))

    op.drop_table("executions")
    with op.batch_alter_table("tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tokens_user"))

    op.drop_table("tokens")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_tenant_state")
        batch_op.drop_index("ix_jobs_state")

    op.drop_table("jobs")
    op.drop_table("users")
    op.drop_table("tenants")
