"""the control loop's lease: one row, held by the server process that runs the loop

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    leases = op.create_table(
        "leases",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False, server_default=""),
        sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("expires_at", sa.Float(), nullable=False, server_default="0"),
    )
    op.bulk_insert(leases, [{"name": "control-loop", "holder": "", "epoch": 0, "expires_at": 0.0}])


def downgrade() -> None:
    op.drop_table("leases")
