"""Alembic's entry point: migrations run on the connection that ``database.migrate`` hands over."""

from alembic import context

from phalanx.control.store.schema import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
