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
    tenant = f"tenant {who['tenant']}" if who["tenant"] else "no tenant"
    err.print(f"logged in to {url} as {who['user']} ({who['role']}, {tenant}); saved in {path}", highlight=False)


PRIORITY = typer.Option(0, help="higher runs first, and may preempt lower in its tenant")


def submit(
    job: Path = typer.Argument(..., help="the job spec (YAML)", dir_okay=False),
    priority: int = PRIORITY,
    tenant: str | None = typer.Option(None, help="the tenant to run under (default: yours)"),
    resume_from: str | None = typer.Option(
        None, "--resume-from", help="a job that ended: go on from its checkpoints (phalanx resume: with its spec)"
    ),
) -> None:
    """Queue a job on the server; print its id."""
    try:
        text = job.read_text()
    except OSError as e:
        err.print(f"[bold red]cannot read[/] {job}: {e.strerror}")
        raise typer.Exit(2) from None
    _queued(call(connect().submit, text, priority, tenant, str(Path.cwd()), resume_from))


def resume(
    job_id: str = typer.Argument(..., help="a job that ended (cancelled, failed, or succeeded and to go further)"),
    priority: int = PRIORITY,
) -> None:
    """Submit a job that ended again, with its spec and directory: it goes on from its newest checkpoint."""
    _queued(call(connect().submit, None, priority, None, None, job_id))


def _queued(created: dict) -> None:
    going_on = f", going on from {created['resumed_from']}'s checkpoints" if created["resumed_from"] else ""
    err.print(f"submitted {created['id']} to tenant {created['tenant']}{going_on}: {created['state']}",
              highlight=False)  # fmt: skip
    out.print(created["id"], highlight=False)


def jobs(
    state: list[str] = typer.Option([], help="only these states (repeat): PENDING, RUNNING, ..."),
    tenant: str | None = typer.Option(None),
    owner: str | None = typer.Option(None),
) -> None:
    """List jobs, oldest first, with why each pending one waits."""
    client = connect()
    unit = call(client.cluster)["unit"]
    table = Table("id", "tenant", "owner", "state", "prio", unit, "step", "submitted", "reason", box=None)
    for j in call(client.jobs, [s.upper() for s in state], tenant, owner):
        step = f"{j['steps_done']}/{j['total_steps'] or '?'}" if j["steps_done"] is not None else "-"
        table.add_row(
            j["id"], j["tenant"], j["owner"], j["state"], str(j["priority"]), f"{j['gpu_use']:g}", step,
            when(j["submitted_at"]), j["reason"],
        )  # fmt: skip
    out.print(table)


def status(job_id: str = typer.Argument(...)) -> None:
    """A job: its state and why, its progress, what happened to it (restarts and their causes, emergency
    checkpoints, resumptions, the last loss, goodput), and every transition with its cause."""
    client = connect()
    j, story = call(client.job, job_id), call(client.story, job_id)
    placement = ", ".join(f"{node}: {n}" for node, n in (j["placement"] or {}).items()) or "-"
    unit = call(client.cluster)["unit"]
    fields = {**{k: j[k] for k in ("id", "name", "tenant", "owner", "state", "reason", "priority")},
              unit.lower(): f"{j['gpu_use']:g}", "placement": placement}  # fmt: skip
    for key, value in fields.items():
        out.print(f"[bold]{key:>11}[/] {'-' if value in (None, '') else value}", highlight=False)
    step = f"{j['steps_done']} of {j['total_steps'] or '?'}" if j["steps_done"] is not None else "-"
    out.print(f"[bold]{'steps':>11}[/] {step}   executions {j['attempt']}, preempted {j['preemptions']} time(s)")
    if story["last_loss"] is not None:
        out.print(f"[bold]{'loss':>11}[/] {story['last_loss']:.4g} at step {story['steps_done']}", highlight=False)
    if story["goodput"] is not None:
        out.print(f"[bold]{'goodput':>11}[/] {story['goodput']:.1%} of the executions' time", highlight=False)
    for line in story_lines(story):
        out.print(f"  {line}", highlight=False)
    for t in call(client.events, job_id)["transitions"]:
        out.print(f"  {when(t['at'])}  {t['from_state'] or '':>9} -> {t['to_state']:<9} {t['cause']}")


def story_lines(story: dict) -> list[str]:
    """Restarts, emergency checkpoints and resumptions, in time order, a sentence each."""
    lines = []
    for r in story["restarts"]:
        how = "recovered in process (a warm spare)" if r["in_process"] else "restarted every rank"
        went_on = f", went on from step {r['resumed_from']}" if r["resumed_from"] is not None else ""
        lines.append((r["at"], f"execution {r['execution']}: {r['category']}: {r['cause']}; {how}{went_on}"))
    for s in story["stops"]:
        lines.append((s["at"], f"execution {s['execution']}: asked to stop; emergency checkpoint of step "
                               f"{s['checkpoint_step']} committed"))  # fmt: skip
    resumed = [f"execution {n} began from step {step}" for n, step in story["resumed"].items()]
    return [f"{when(at)}  {text}" for at, text in sorted(lines)] + resumed


def logs(
    job_id: str = typer.Argument(...),
    rank: int = typer.Option(0, min=0),
    supervisor: bool = typer.Option(
        False, "--supervisor", help="the supervisor's log instead: restarts, progress lines, the end summary"
    ),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
) -> None:
    """A rank's log (the latest execution's), or follow it as the job runs; then one line on how it ended."""
    client = connect()
    if follow:
        try:
            for text in client.follow_logs(job_id, rank, supervisor=supervisor):
                print(text, end="", flush=True)
        except ClientError as e:
            fail(e)
        j = call(client.job, job_id)
        err.print(f"{job_id} {j['state']}: {j['reason']}", highlight=False)
        return
    offset = 0
    while chunk := call(client.logs, job_id, rank, offset, supervisor=supervisor):
        print(chunk["text"], end="")
        if chunk["next_offset"] >= chunk["size"]:
            break
        offset = chunk["next_offset"]


def cancel(job_id: str = typer.Argument(...)) -> None:
    """Cancel a job: a queued one at once; a running one checkpoints and stops."""
    j = call(connect().cancel, job_id)
    err.print(f"{j['id']}: {j['state']}{' (' + j['reason'] + ')' if j['state'] == 'RUNNING' else ''}")


def quota() -> None:
    """Each tenant you can see: its GPUs (or CPU slots), what it uses now, its running and pending jobs."""
    client = connect()
    unit = call(client.cluster)["unit"]
    table = Table("tenant", f"quota {unit}", "in use", "cohort", "borrow limit", "running", "pending", box=None)
    for q in call(client.quota):
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
    """GPU-hours (or CPU slot-hours) per tenant (and per job), allocated and productive by the goodput ledger;
    what they cost, and per million tokens trained on."""
    client = connect()
    report, unit = call(client.usage, parse_since(since)), call(client.cluster)["unit"].removesuffix("s")
    # not the run's goodput (status, the dashboard): that divides by the run's time, this by the GPUs' held time
    table = Table(
        "tenant", "job", f"allocated {unit}-h", f"productive {unit}-h", "productive/allocated", "$", "$/M tokens",
        box=None,
    )  # fmt: skip
    for row in report["tenants"] + (report["jobs"] if by_job else []):
        alloc, prod, per_m = row["allocated_gpu_hours"], row["productive_gpu_hours"], row["dollars_per_million_tokens"]
        table.add_row(
            row["tenant"],
            row["job"] or "(all)",
            f"{alloc:.3f}",
            f"{prod:.3f}",
            f"{prod / alloc:.0%}" if alloc else "-",
            f"{row['dollars']:,.2f}",
            "-" if per_m is None else f"{per_m:,.4f}",
        )
    out.print(table)
    err.print(f"from {when(report['since'])} to {when(report['until'])}")


def spend() -> None:
    """This month's dollars per tenant against its monthly budget, and the fleet's spend."""
    report = call(connect().spend)
    table = Table("tenant", "spent $", "monthly budget $", "left $", "$/h now", box=None)
    for t in report["tenants"]:
        budget, left = t["monthly_budget"], t["left"]
        table.add_row(
            t["tenant"] + (" (over budget: new jobs wait)" if t["over_budget"] else ""),
            f"{t['dollars']:,.2f}",
            "-" if budget is None else f"{budget:,.2f}",
            "-" if left is None else f"{left:,.2f}",
            f"{t['dollars_per_h']:,.2f}",
        )
    fleet = (report["dollars"], report["budgets"], report["dollars_per_h"])
    table.add_row("(fleet)", f"{fleet[0]:,.2f}", f"{fleet[1]:,.2f}", "", f"{fleet[2]:,.2f}")
    out.print(table)
    err.print(f"from {when(report['month_start'])} to {when(report['until'])}")


def speeds() -> None:
    """How fast each kind of your jobs runs on each GPU type, in tokens/s per GPU: measured (*) where its runs
    ran, estimated elsewhere; a kind not yet measured, as a share of its fastest type. The scheduler puts each
    job where it runs fastest."""
    table_of = call(connect().speeds)
    table = Table("kind", *table_of["types"], box=None)
    for k in table_of["kinds"]:
        rates, relative = k["tokens_per_gpu_s"], k["relative"]
        table.add_row(k["kind"], *(
            (f"{rates[t]:,.1f}" if rates else f"{relative[t]:.2f}x") + ("*" if t in k["measured"] else "")
            for t in table_of["types"]
        ))  # fmt: skip
    out.print(table)
    err.print("tokens/s per GPU (* measured on its runs); 0.50x: half as fast as on its fastest type, estimated from "
              "how the types compare, or their peak FLOP/s")  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command()(login)
    app.command()(submit)
    app.command()(resume)
    app.command()(jobs)
    app.command()(status)
    app.command()(logs)
    app.command()(cancel)
    app.command()(quota)
    app.command()(usage)
    app.command()(spend)
    app.command()(speeds)
