"""The platform's commands: `phalanx server`, and the client commands that talk to it (login, submit, jobs,
status, logs, cancel, quota, usage, tokens, tenants, users). They all go through ``phalanx.client.Client``."""

from __future__ import annotations

import datetime as dt
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from phalanx.client import Client, ClientError, save_login

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 10_000)  # piped: a row a line


def _client() -> Client:
    try:
        return Client()
    except ClientError as e:
        _fail(e)


def _fail(e: ClientError) -> None:
    err.print(f"[bold red]error[/] ({e.status or 'no connection'}):", highlight=False)
    for line in str(e).splitlines():
        err.print(f"  {line}", highlight=False)
    raise typer.Exit(2 if e.status in (400, 413, 422) else 1)


def _call(fn, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ClientError as e:
        _fail(e)


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _since(text: str) -> float:
    """24h, 7d, 30m, a date (2026-12-01), or Unix seconds."""
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text):
        return time.time() - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give 24h, 7d, 30m, a date such as 2026-12-01, or Unix seconds") from None


def register(app: typer.Typer) -> None:
    @app.command()
    def server(
        data_dir: Path = typer.Option(
            Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "phalanx",
            "--data-dir",
            help="the database (SQLite) and the jobs' files",
        ),
        database: str | None = typer.Option(
            None, "--db", help="a database URL (postgresql+psycopg://USER@HOST/DB); default: SQLite in --data-dir"
        ),
        host: str = typer.Option("127.0.0.1"),
        port: int = typer.Option(8470, min=1, max=65535),
        slots: int | None = typer.Option(
            None, min=1, help="CPU slots the local executor offers (default: this machine's GPUs, else its cores)"
        ),
        admin_token_file: Path | None = typer.Option(
            None, "--admin-token-file", help="on a new database, write the admin's token here instead of printing it"
        ),
        executor: str = typer.Option(
            "local", help="where jobs run: local (this machine) or slurm (sbatch; docs/clusters.md)"
        ),
        slurm_partition: str | None = typer.Option(
            None, help="the slurm executor's partition: its nodes are the capacity, and jobs go there"
        ),
        max_token_days: float = typer.Option(
            365.0, "--max-token-days", min=0.001, help="the longest any token may live, whoever makes it"
        ),
    ) -> None:
        """Serve the control plane: the REST API, the scheduler, and an executor (docs/platform.md)."""
        import logging

        from phalanx.control.executors.slurm import SlurmError
        from phalanx.control.server.main import Settings, serve
        from phalanx.control.store import StoreError

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        settings = Settings(
            data_dir,
            database,
            host,
            port,
            slots,
            admin_token_file,
            executor=executor,
            slurm_partition=slurm_partition,
            max_token_s=max_token_days * 86400,
        )
        try:
            serve(settings)
        except (StoreError, ValueError, SlurmError) as e:
            err.print(f"[bold red]cannot serve[/]: {e}", highlight=False)
            raise typer.Exit(2) from None

    @app.command()
    def login(
        url: str = typer.Argument(..., help="the server, e.g. http://127.0.0.1:8470"),
        token: str = typer.Option(..., prompt=True, hide_input=True, help="an API token (phx_...)"),
    ) -> None:
        """Check a token against the server and keep both for the other commands."""
        who = _call(Client(url, token).whoami)
        path = save_login(url, token)
        err.print(f"logged in to {url} as {who['user']} ({who['role']}, tenant {who['tenant']}); saved in {path}")

    @app.command()
    def submit(
        job: Path = typer.Argument(..., help="the job spec (YAML)", dir_okay=False),
        priority: int = typer.Option(0, help="higher runs first, and may preempt lower in its tenant"),
        tenant: str | None = typer.Option(None, help="the tenant to run under (default: yours)"),
    ) -> None:
        """Queue a job on the server; print its id."""
        try:
            text = job.read_text()
        except OSError as e:
            err.print(f"[bold red]cannot read[/] {job}: {e.strerror}")
            raise typer.Exit(2) from None
        created = _call(_client().submit, text, priority, tenant, str(Path.cwd()))
        err.print(f"submitted {created['id']} to tenant {created['tenant']}: {created['state']}", highlight=False)
        out.print(created["id"], highlight=False)

    @app.command()
    def jobs(
        state: list[str] = typer.Option([], help="only these states (repeat): PENDING, RUNNING, ..."),
        tenant: str | None = typer.Option(None),
        owner: str | None = typer.Option(None),
    ) -> None:
        """List jobs, oldest first, with why each pending one waits."""
        table = Table("id", "tenant", "owner", "state", "prio", "GPUs", "step", "submitted", "reason", box=None)
        for j in _call(_client().jobs, [s.upper() for s in state], tenant, owner):
            step = f"{j['steps_done']}/{j['total_steps'] or '?'}" if j["steps_done"] is not None else "-"
            table.add_row(
                j["id"], j["tenant"], j["owner"], j["state"], str(j["priority"]), str(j["gpus"]), step,
                _when(j["submitted_at"]), j["reason"],
            )  # fmt: skip
        out.print(table)

    @app.command()
    def status(job_id: str = typer.Argument(...)) -> None:
        """A job: its state and why, its progress, and every transition with its cause."""
        client = _client()
        j = _call(client.job, job_id)
        for key in ("id", "name", "tenant", "owner", "state", "reason", "priority", "gpus", "placement"):
            out.print(f"[bold]{key:>11}[/] {j[key]}", highlight=False)
        step = f"{j['steps_done']} of {j['total_steps'] or '?'}" if j["steps_done"] is not None else "-"
        out.print(f"[bold]{'steps':>11}[/] {step}   executions {j['attempt']}, preempted {j['preemptions']} time(s)")
        for t in _call(client.events, job_id)["transitions"]:
            out.print(f"  {_when(t['at'])}  {t['from_state'] or '':>9} -> {t['to_state']:<9} {t['cause']}")

    @app.command()
    def logs(
        job_id: str = typer.Argument(...),
        rank: int = typer.Option(0, min=0),
        follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
    ) -> None:
        """A rank's log (the latest execution's), or follow it as the job runs."""
        client = _client()
        if follow:
            try:
                for text in client.follow_logs(job_id, rank):
                    print(text, end="", flush=True)
            except ClientError as e:
                _fail(e)
            return
        offset = 0
        while chunk := _call(client.logs, job_id, rank, offset):
            print(chunk["text"], end="")
            if chunk["next_offset"] >= chunk["size"]:
                break
            offset = chunk["next_offset"]

    @app.command()
    def cancel(job_id: str = typer.Argument(...)) -> None:
        """Cancel a job: a queued one at once; a running one checkpoints and stops."""
        j = _call(_client().cancel, job_id)
        err.print(f"{j['id']}: {j['state']}{' (' + j['reason'] + ')' if j['state'] == 'RUNNING' else ''}")

    @app.command()
    def quota() -> None:
        """Each tenant you can see: its GPUs, what it uses now, its running and pending jobs."""
        table = Table("tenant", "quota", "in use", "cohort", "borrow limit", "running", "pending", box=None)
        for q in _call(_client().quota):
            table.add_row(
                q["tenant"], str(q["quota_gpus"]), str(q["gpus_in_use"]), q["cohort"] or "-",
                "-" if q["borrowing_limit"] is None else str(q["borrowing_limit"]), str(q["jobs_running"]),
                str(q["jobs_pending"]),
            )  # fmt: skip
        out.print(table)

    @app.command()
    def usage(
        since: str = typer.Option("30d", help="24h, 7d, a date (2026-12-01), or Unix seconds"),
        by_job: bool = typer.Option(False, "--by-job", help="one row per job too"),
    ) -> None:
        """GPU-hours per tenant (and per job): allocated, and productive by the goodput ledger."""
        report = _call(_client().usage, _since(since))
        table = Table("tenant", "job", "allocated GPU-h", "productive GPU-h", "goodput", box=None)
        for row in report["tenants"] + (report["jobs"] if by_job else []):
            alloc, prod = row["allocated_gpu_hours"], row["productive_gpu_hours"]
            table.add_row(
                row["tenant"],
                row["job"] or "(all)",
                f"{alloc:.3f}",
                f"{prod:.3f}",
                f"{prod / alloc:.0%}" if alloc else "-",
            )
        out.print(table)
        err.print(f"from {_when(report['since'])} to {_when(report['until'])}")

    tokens_app = typer.Typer(no_args_is_help=True, help="API tokens: create (shown once), list, revoke.")
    app.add_typer(tokens_app, name="tokens")

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
        created = _call(_client().create_token, name, user, expires_in_days * 86400, tenant)
        err.print(f"token {created['id']} for {created['user']}, expires {_when(created['expires_at'])}:")
        out.print(created["token"], highlight=False)

    @tokens_app.command("list")
    def tokens_list() -> None:
        table = Table("id", "user", "name", "created", "expires", "revoked", box=None)
        for t in _call(_client().tokens):
            table.add_row(
                t["id"], t["user"], t["name"], _when(t["created_at"]), _when(t["expires_at"]), _when(t["revoked_at"])
            )
        out.print(table)

    @tokens_app.command("revoke")
    def tokens_revoke(token_id: str = typer.Argument(..., help="the token's id (tokens list)")) -> None:
        t = _call(_client().revoke_token, token_id)
        err.print(f"token {t['id']} of {t['user']} revoked at {_when(t['revoked_at'])}")

    tenants_app = typer.Typer(no_args_is_help=True, help="Tenants and their quotas (creating them: admins).")
    app.add_typer(tenants_app, name="tenants")

    @tenants_app.command("list")
    def tenants_list() -> None:
        table = Table("tenant", "quota GPUs", "cohort", "borrowing limit", box=None)
        for t in _call(_client().tenants):
            limit = "-" if t["borrowing_limit"] is None else str(t["borrowing_limit"])
            table.add_row(t["name"], str(t["quota_gpus"]), t["cohort"] or "-", limit)
        out.print(table)

    @tenants_app.command("create")
    def tenants_create(
        name: str = typer.Argument(...),
        quota_gpus: int = typer.Option(..., "--quota", min=0, help="GPUs guaranteed"),
        cohort: str | None = typer.Option(None, help="share idle GPUs with this cohort's other tenants"),
        borrowing_limit: int | None = typer.Option(None, "--borrowing-limit", min=0),
    ) -> None:
        t = _call(_client().create_tenant, name, quota_gpus, cohort, borrowing_limit)
        err.print(f"tenant {t['name']}: {t['quota_gpus']} GPUs")

    @tenants_app.command("update")
    def tenants_update(
        name: str = typer.Argument(...),
        quota_gpus: int | None = typer.Option(None, "--quota", min=0),
        cohort: str | None = typer.Option(None),
        borrowing_limit: int | None = typer.Option(None, "--borrowing-limit", min=0),
    ) -> None:
        changes = {"quota_gpus": quota_gpus, "cohort": cohort, "borrowing_limit": borrowing_limit}
        t = _call(_client().update_tenant, name, **{k: v for k, v in changes.items() if v is not None})
        err.print(f"tenant {t['name']}: {t['quota_gpus']} GPUs, cohort {t['cohort']}, limit {t['borrowing_limit']}")

    users_app = typer.Typer(no_args_is_help=True, help="Users of your tenant (all: admins).")
    app.add_typer(users_app, name="users")

    @users_app.command("list")
    def users_list() -> None:
        table = Table("user", "tenant", "role", "created", box=None)
        for u in _call(_client().users):
            table.add_row(u["name"], u["tenant"] or "-", u["role"], _when(u["created_at"]))
        out.print(table)

    @users_app.command("create")
    def users_create(
        name: str = typer.Argument(...),
        role: str = typer.Option("member", help="admin | tenant-admin | member | viewer"),
        tenant: str | None = typer.Option(None, help="default: yours"),
    ) -> None:
        u = _call(_client().create_user, name, role, tenant)
        err.print(f"user {u['name']}: {u['role']} of {u['tenant'] or 'every tenant'}; `phalanx tokens create --user`")
