"""``phalanx db``: the server's database, moved to another (SQLite to PostgreSQL)."""

from __future__ import annotations

import typer

from phalanx.cli.common import err, out

db_app = typer.Typer(no_args_is_help=True, help="The server's database: copy it to another.")


@db_app.command("copy")
def db_copy(
    source: str = typer.Argument(..., help="the store's database URL now (sqlite:////HOME/.local/share/phalanx/...)"),
    target: str = typer.Argument(..., help="a new, empty database's URL (postgresql+psycopg://USER@HOST/DB)"),
) -> None:
    """Copy every row of a server's database into a new, empty one, in one transaction each side. Stop the
    server first (the copy refuses a database a server runs on), then start it with --db TARGET and the same
    --data-dir (docs/platform.md)."""
    from phalanx.control.store import StoreError
    from phalanx.control.store.copy import copy_store

    try:
        copied = copy_store(source, target)
    except StoreError as e:
        err.print(f"[bold red]cannot copy[/]: {e}", highlight=False)
        raise typer.Exit(2) from None
    out.print(", ".join(f"{table} {rows}" for table, rows in copied.items()), highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
