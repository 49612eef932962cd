"""Moving a store to another database (SQLite to PostgreSQL, when a second server or more clients are wanted):
every row, with no server running on the source (none holds its control loop's lease), written in one
transaction of the target's, so a copy stopped half-way leaves the target as it was."""

from __future__ import annotations

import time

from sqlalchemy import func, insert, select, text

from phalanx.control.store.database import StoreError, open_store
from phalanx.control.store.lease import leader
from phalanx.control.store.schema import Base, Lease

BATCH = 1000  # rows an INSERT carries


def copy_store(source_url: str, target_url: str) -> dict[str, int]:
    """Copy the store at ``source_url`` into the new, empty one at ``target_url``; both are brought to the
    newest schema first. Returns the rows copied, by table. The target's row counters (PostgreSQL's sequences)
    go on after the copied ids; its control-loop lease is free to take at once, at the source's epoch."""
    source, target = open_store(source_url), open_store(target_url)
    try:
        tables = Base.metadata.sorted_tables  # a table after those its keys point at
        with source.read() as s:
            if (held := leader(s, time.time())) is not None:
                raise StoreError(f"a server runs on the source database (its control loop: {held[0]}): stop it first")
        with target.read() as s:
            counts = {t.name: s.scalar(select(func.count()).select_from(t)) for t in tables}
        used = [name for name, rows in counts.items() if rows and name != Lease.__tablename__]
        if used:
            raise StoreError(f"the target database already has rows in {', '.join(used)}: copy into a new, empty one")
        copied = {}
        with source.read() as read, target.write() as write:
            write.execute(Lease.__table__.delete())  # the new database's own row, replaced by the source's
            for table in tables:
                rows = [dict(row) for row in read.execute(select(table)).mappings()]
                if table.name == Lease.__tablename__:
                    rows = [{**row, "holder": "", "expires_at": 0.0} for row in rows]
                for first in range(0, len(rows), BATCH):
                    write.execute(insert(table), rows[first : first + BATCH])
                copied[table.name] = len(rows)
            if write.get_bind().dialect.name == "postgresql":
                for table in tables:
                    for column in table.primary_key.columns:
                        if column.autoincrement is True:
                            _counter_past(write, table.name, column.name)
    finally:
        source.engine.dispose()
        target.engine.dispose()
    return copied


def _counter_past(s, table: str, column: str) -> None:
    """PostgreSQL's sequence for ``table.column`` set past the copied ids: the next row gets a new one."""
    s.execute(
        text(
            f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), "
            f"COALESCE((SELECT MAX({column}) FROM {table}), 0) + 1, false)"
        )
    )
