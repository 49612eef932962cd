"""The client commands for a user's work: log in, submit, list, follow and cancel jobs, and see the quota and
the GPU-hours used. Each goes through ``phalanx.client.Client``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from phalanx.cli.common import err, out
from phalanx.cli.remote import call, connect, fail, parse_since, when
from phalanx.client import Client, ClientError, save_login


def login(
    url: str = typer.Argument(..., help="the server, e.g. http://127.0.0.1:8470"),
    token: str = typer.Option(..., prompt=True, hide_input=True, help="an API token (phx_...)"),
) -> None:
    """Check a token against the server and keep both for the other commands."""
    who = call(Client(url, token).whoami)
    path = save_login(url, token)
    err.print(f"logged in to {url} as {who['user']} ({who['role']}, tenant {who['tenant']}); saved in {path}")


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
    created = call(connect().submit, text, priority, tenant, str(Path.cwd()))
    err.print(f"submitted {created['id']} to tenant {created['tenant']}: {created['state']}", highlight=False)
    out.print(created["id"], highlight=False)


def jobs(
    state: list[str] = typer.Option([], help="only these states (repeat): PENDING, RUNNING, ..."),
    tenant: str | None = typer.Option(None),
    owner: str | None = typer.Option(None),
) -> None:
    """List jobs, oldest first, with why each pending one waits."""
    table = Table("id", "tenant", "owner", "state", "prio", "GPUs", "step", "submitted", "reason", box=None)
    for j in call(connect().jobs, [s.upper() for s in state], tenant, owner):
        step = f"{j['steps_done']}/{j['total_steps'] or '?'}" if j["steps_done"] is not None else "-"
        table.add_row(
            j["id"], j["tenant"], j["owner"], j["state"], str(j["priority"]), str(j["gpus"]), step,
            when(j["submitted_at"]), j["reason"],
        )  # fmt: skip
    out.print(table)


def status(job_id: str = typer.Argument(...)) -> None:
    """A job: its state and why, its progress, and every transition with its cause."""
    client = connect()
    j = call(client.job, job_id)
    for key in ("id", "name", "tenant", "owner", "state", "reason", "priority", "gpus", "placement"):
        out.print(f"[bold]{key:>11}[/] {j[key]}", highlight=False)
    step = f"{j['steps_done']} of {j['total_steps'] or '?'}" if j["steps_done"] is not None else "-"
    out.print(f"[bold]{'steps':>11}[/] {step}   executions {j['attempt']}, preempted {j['preemptions']} time(s)")
    for t in call(client.events, job_id)["transitions"]:
        out.print(f"  {when(t['at'])}  {t['from_state'] or '':>9} -> {t['to_state']:<9} {t['cause']}")


def logs(
    job_id: str = typer.Argument(...),
    rank: int = typer.Option(0, min=0),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
) -> None:
    """A rank's log (the latest execution's), or follow it as the job runs."""
    client = connect()
    if follow:
        try:
            for text in client.follow_logs(job_id, rank):
                print(text, end="", flush=True)
        except ClientError as e:
            fail(e)
        return
    offset = 0
    while chunk := call(client.logs, job_id, rank, offset):
        print(chunk["text"], end="")
        if chunk["next_offset"] >= chunk["size"]:
            break
        offset = chunk["next_offset"]


def cancel(job_id: str = typer.Argument(...)) -> None:
    """Cancel a job: a queued one at once; a running one checkpoints and stops."""
    j = call(connect().cancel, job_id)
    err.print(f"{j['id']}: {j['state']}{' (' + j['reason'] + ')' if j['state'] == 'RUNNING' else ''}")


def quota() -> None:
    """Each tenant you can see: its GPUs, what it uses now, its running and pending jobs."""
    table = Table("tenant", "quota", "in use", "cohort", "borrow limit", "running", "pending", box=None)
    for q in call(connect().quota):
        table.add_row(
            q["tenant"], str(q["nominal_gpus"]), str(q["gpus_in_use"]), q["cohort"] or "-",
            "-" if q["borrowing_limit"] is None else str(q["borrowing_limit"]), str(q["jobs_running"]),
            str(q["jobs_pending"]),
        )  # fmt: skip
    out.print(table)


def usage(
    since: str = typer.Option("30d", help="24h, 7d, a date (2026-12-01), or Unix seconds"),
    by_job: bool = typer.Option(False, "--by-job", help="one row per job too"),
) -> None:
    """GPU-hours per tenant (and per job): allocated, and productive by the goodput ledger."""
    report = call(connect().usage, parse_since(since))
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
    err.print(f"from {when(report['since'])} to {when(report['until'])}")


def register(app: typer.Typer) -> None:
    app.command()(login)
    app.command()(submit)
    app.command()(jobs)
    app.command()(status)
    app.command()(logs)
    app.command()(cancel)
    app.command()(quota)
    app.command()(usage)
