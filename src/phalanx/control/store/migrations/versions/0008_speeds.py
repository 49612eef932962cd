"""speeds: each job's kind and each execution's GPU type, from which the server learns its speed table
(executions from before have no type: they teach nothing)

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(64), nullable=False, server_default=""))
    with op.batch_alter_table("executions") as batch_op:
        batch_op.add_column(sa.Column("gpu_type", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("executions") as batch_op:
        batch_op.drop_column("gpu_type")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("kind")
