"""GPU shares: a job's share of one GPU in thousandths (1000: whole GPUs) and the shared GPU it holds, and an
execution's GPUs as a fraction where it held a share

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("gpu_milli", sa.Integer(), nullable=False, server_default="1000"))
        batch_op.add_column(sa.Column("gpu_carve", sa.Integer(), nullable=True))
    with op.batch_alter_table("executions") as batch_op:
        batch_op.alter_column("gpus", existing_type=sa.Integer(), type_=sa.Float(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("executions") as batch_op:
        batch_op.alter_column("gpus", existing_type=sa.Float(), type_=sa.Integer(), existing_nullable=False)
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("gpu_carve")
        batch_op.drop_column("gpu_milli")
