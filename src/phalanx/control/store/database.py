"""Opening the store: an engine for a database URL, migrated to the current schema by Alembic. SQLite (the
default, a file, nothing to install) runs in WAL mode so that readers never wait for the writer; PostgreSQL is
taken by URL (postgresql+psycopg://...)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"
MIGRATION_LOCK = 0x7068616C616E78  # "phalanx": the advisory lock a migration of a PostgreSQL store holds


class StoreError(RuntimeError):
    pass


def connect(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise StoreError(f"database URL {url!r}: {e}; e.g. sqlite:///phalanx.db or postgresql+psycopg://HOST/DB") from e
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=20, max_overflow=60
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql":  # as many connections as the API has threads, and the loop
        # No wait is unbounded: a lock waited for 10 s fails the statement, and a session left in a transaction
        # for 30 s (its process frozen, say) is ended by the server, its locks freed (the loop's: lease.py).
        bounds = "-c lock_timeout=10s -c idle_in_transaction_session_timeout=30s"
        return create_engine(parsed, pool_size=20, max_overflow=30, pool_recycle=3600, connect_args={"options": bounds})
    raise StoreError(f"database URL {url!r}: only sqlite:// and postgresql:// databases are supported")


def _sqlite_pragmas(connection, _record) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint of the WAL; never corrupt
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the database to the newest schema (a new database gets every migration), or to ``revision``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        if sqlite:  # a migration rebuilds tables that others point at (batch mode): check the keys after, not during
            _pragma(connection, "foreign_keys=OFF")  # outside a transaction, or SQLite ignores it
        try:
            with connection.begin():
                if connection.dialect.name == "postgresql":  # servers starting at once on a new database: in turn
                    connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
                if sqlite and (broken := connection.exec_driver_sql("PRAGMA foreign_key_check").all()):
                    raise StoreError(f"the migration left rows pointing at rows that are gone: {broken[:5]}")
        finally:
            if sqlite:
                _pragma(connection, "foreign_keys=ON")


def _pragma(connection, setting: str) -> None:
    connection.exec_driver_sql(f"PRAGMA {setting}")
    connection.commit()


class Store:
    """Sessions over a migrated database: ``read()`` for a look, ``write()`` for a transaction that changes
    something. SQLite has one writer at a time, and makes another wait by sleeping and retrying (up to 100 ms a
    try), so this process's writers take turns on a lock instead and none of them sleeps; PostgreSQL locks
    rows, and its writers go ahead together."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)
        self._writer = threading.Lock() if engine.dialect.name == "sqlite" else contextlib.nullcontext()

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction, committed when the block ends, rolled back if it raises."""
        with self._writer, self.sessions.begin() as session:
            yield session


def open_store(url: str) -> Store:
    engine = connect(url)
    try:
        migrate(engine)
    except Exception as e:
        engine.dispose()
        raise StoreError(f"cannot open the database {engine.url.render_as_string(hide_password=True)}: {e}") from e
    return Store(engine)
