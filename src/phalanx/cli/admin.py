"""The client commands that administer the platform: API tokens, tenants and their quotas, users."""

from __future__ import annotations

import typer
from rich.table import Table

from phalanx.cli.common import err, out
from phalanx.cli.remote import call, connect, when

tokens_app = typer.Typer(no_args_is_help=True, help="API tokens: create (shown once), list, revoke.")


@tokens_app.command("create")
def tokens_create(
    name: str = typer.Option("default"),
    user: str | None = typer.Option(None, help="whose (default: yours; others': tenant-admins and admins)"),
    tenant: str | None = typer.Option(None, help="the user's tenant (an admin's, when two tenants have the name)"),
    expires_in_days: float = typer.Option(
        90.0, "--expires-in-days", min=0.001, help="at most the server's --max-token-days"
    ),
) -> None:
    """Create a token and print it: this is the only time it is shown."""
    created = call(connect().create_token, name, user, expires_in_days * 86400, tenant)
    err.print(f"token {created['id']} for {created['user']}, expires {when(created['expires_at'])}:")
    out.print(created["token"], highlight=False)


@tokens_app.command("list")
def tokens_list() -> None:
    table = Table("id", "user", "name", "created", "expires", "revoked", box=None)
    for t in call(connect().tokens):
        table.add_row(
            t["id"], t["user"], t["name"], when(t["created_at"]), when(t["expires_at"]), when(t["revoked_at"])
        )
    out.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str = typer.Argument(..., help="the token's id (tokens list)")) -> None:
    t = call(connect().revoke_token, token_id)
    err.print(f"token {t['id']} of {t['user']} revoked at {when(t['revoked_at'])}")


tenants_app = typer.Typer(no_args_is_help=True, help="Tenants and their quotas (creating them: admins).")


@tenants_app.command("list")
def tenants_list() -> None:
    client = connect()
    unit = call(client.cluster)["unit"]
    table = Table("tenant", f"quota {unit}", "cohort", "borrowing limit", "monthly budget", box=None)
    for t in call(client.tenants):
        limit = "-" if t["borrowing_limit"] is None else str(t["borrowing_limit"])
        budget = "-" if t["monthly_budget"] is None else f"${t['monthly_budget']:,.2f}"
        table.add_row(t["name"], str(t["nominal_gpus"]), t["cohort"] or "-", limit, budget)
    out.print(table)


@tenants_app.command("create")
def tenants_create(
    name: str = typer.Argument(...),
    nominal_gpus: int = typer.Option(..., "--nominal-gpus", min=0, help="GPUs (or CPU slots) guaranteed"),
    cohort: str | None = typer.Option(None, help="share idle GPUs with this cohort's other tenants"),
    borrowing_limit: int | None = typer.Option(None, "--borrowing-limit", min=0),
    monthly_budget: float | None = typer.Option(
        None, "--monthly-budget", min=0, help="dollars a calendar month; over it, its new jobs wait"
    ),
) -> None:
    client = connect()
    created = call(client.create_tenant, name, nominal_gpus, cohort, borrowing_limit, monthly_budget)
    _said(created, call(client.cluster)["unit"])


@tenants_app.command("update")
def tenants_update(
    name: str = typer.Argument(...),
    nominal_gpus: int | None = typer.Option(None, "--nominal-gpus", min=0),
    cohort: str | None = typer.Option(None),
    borrowing_limit: int | None = typer.Option(None, "--borrowing-limit", min=0),
    monthly_budget: float | None = typer.Option(None, "--monthly-budget", min=0, help="dollars a calendar month"),
    no_borrowing_limit: bool = typer.Option(False, "--no-borrowing-limit", help="it may borrow all its cohort lends"),
    no_monthly_budget: bool = typer.Option(False, "--no-monthly-budget", help="remove its budget"),
) -> None:
    changes = {
        "nominal_gpus": nominal_gpus, "cohort": cohort, "borrowing_limit": borrowing_limit,
        "monthly_budget": monthly_budget,
    }  # fmt: skip
    changes = {k: v for k, v in changes.items() if v is not None}
    for field, removed in (("borrowing_limit", no_borrowing_limit), ("monthly_budget", no_monthly_budget)):
        if removed and field in changes:
            option = field.replace("_", "-")
            err.print(f"[bold red]--{option} and --no-{option}[/]: give one", highlight=False)
            raise typer.Exit(2)
        if removed:
            changes[field] = None
    client = connect()
    changed = call(client.update_tenant, name, **changes)
    _said(changed, call(client.cluster)["unit"])


def _said(t: dict, unit: str) -> None:
    cohort = f"cohort {t['cohort']}" if t["cohort"] else "no cohort"
    limit = f"borrowing limit {t['borrowing_limit']}" if t["borrowing_limit"] is not None else "no borrowing limit"
    budget = f"${t['monthly_budget']:,.2f} a month" if t["monthly_budget"] is not None else "no budget"
    err.print(f"tenant {t['name']}: {t['nominal_gpus']} {unit}, {cohort}, {limit}, {budget}", highlight=False)
    if t["warning"]:
        err.print(f"[bold yellow]warning[/]: {t['warning']}", highlight=False)


users_app = typer.Typer(no_args_is_help=True, help="Users of your tenant (all: admins).")


@users_app.command("list")
def users_list() -> None:
    table = Table("user", "tenant", "role", "created", box=None)
    for u in call(connect().users):
        table.add_row(u["name"], u["tenant"] or "-", u["role"], when(u["created_at"]))
    out.print(table)


@users_app.command("create")
def users_create(
    name: str = typer.Argument(...),
    role: str = typer.Option("member", help="admin | tenant-admin | member | viewer"),
    tenant: str | None = typer.Option(None, help="default: yours"),
) -> None:
    u = call(connect().create_user, name, role, tenant)
    err.print(f"user {u['name']}: {u['role']} of {u['tenant'] or 'every tenant'}; `phalanx tokens create --user`")


def register(app: typer.Typer) -> None:
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(users_app, name="users")
