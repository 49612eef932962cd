"""money: each execution's price an hour, fixed when it starts, and the tokens it trained on; each tenant's
monthly budget (executions from before cost nothing: their prices were never given)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("executions") as batch_op:
        batch_op.add_column(sa.Column("tokens", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("dollars_per_h", sa.Float(), nullable=False, server_default="0"))
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.add_column(sa.Column("monthly_budget", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.drop_column("monthly_budget")
    with op.batch_alter_table("executions") as batch_op:
        batch_op.drop_column("dollars_per_h")
        batch_op.drop_column("tokens")
