"""what the server reads of a job's spec, stored at submit: its total steps, its nodes and where its checkpoints
go (the spec was parsed again for every job row of every dashboard tick, and up to six times per job)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
import yaml
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("total_steps", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("nodes", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("checkpoint_dir", sa.Text(), nullable=True))
    connection = op.get_bind()
    for seq, text in connection.execute(sa.text("SELECT seq, spec FROM jobs")).all():
        try:  # the resolved YAML phalanx stored: defaults filled in
            spec = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            spec = {}
        spec = spec if isinstance(spec, dict) else {}
        train, resources, checkpoint = (spec.get(k) or {} for k in ("train", "resources", "checkpoint"))
        connection.execute(
            sa.text("UPDATE jobs SET total_steps = :steps, nodes = :nodes, checkpoint_dir = :where WHERE seq = :seq"),
            {"steps": train.get("steps"), "nodes": resources.get("nodes", 1), "where": checkpoint.get("dir"),
             "seq": seq},
        )  # fmt: skip


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        for column in ("checkpoint_dir", "nodes", "total_steps"):
            batch_op.drop_column(column)
