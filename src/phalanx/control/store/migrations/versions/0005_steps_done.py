"""the steps a job had done when its last execution ended, stored then: a list of jobs shows them without
reading every finished job's run directory (jobs that ended before this migration show none); and the job
a job was resubmitted from, whose checkpoints it goes on from (its lineage)

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("steps_done", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("resumed_from", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("resumed_from")
        batch_op.drop_column("steps_done")
