"""a tenant's guaranteed GPUs are its nominal quota, as the scheduling core and Kueue name them: one word for
one thing (the store said quota_gpus, the core nominal)

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.alter_column("quota_gpus", new_column_name="nominal_gpus")


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.alter_column("nominal_gpus", new_column_name="quota_gpus")
