"""the GPU types a job may run on, those it prefers, and whether one gang may span types: read from its spec at
submit, as the rest of what the scheduler reads (jobs from before run on any type, as they did)

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("gpu_types", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("prefer_gpu_types", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("mix_gpu_types", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("mix_gpu_types")
        batch_op.drop_column("prefer_gpu_types")
        batch_op.drop_column("gpu_types")
