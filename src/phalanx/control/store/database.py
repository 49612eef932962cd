"""Opening the store: an engine for a database URL, migrated to the current schema by Alembic. SQLite (the
default, a file, nothing to install) runs in WAL mode so that readers never wait for the writer; PostgreSQL is
taken by URL (postgresql+psycopg://...)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"


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
        engine = create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(parsed, pool_size=10, max_overflow=20, pool_pre_ping=True)
    raise StoreError(f"database URL {url!r}: only sqlite:// and postgresql:// databases are supported")


def _sqlite_pragmas(connection, _record) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint of the WAL; never corrupt
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def migrate(engine: Engine) -> None:
    """Bring the database to the newest schema (a new database gets every migration)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def open_store(url: str) -> sessionmaker[Session]:
    """A session factory over a migrated database."""
    engine = connect(url)
    try:
        migrate(engine)
    except Exception as e:
        engine.dispose()
        raise StoreError(f"cannot open the database {engine.url.render_as_string(hide_password=True)}: {e}") from e
    return sessionmaker(engine, expire_on_commit=False)
