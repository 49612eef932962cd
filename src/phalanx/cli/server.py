"""``phalanx server``: the control plane, its API, scheduler and executor, in one process; several over one
PostgreSQL database share the API, and one of them at a time runs the scheduler (its lease)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from phalanx.cli.common import err
from phalanx.control.scheduler.costs import PreemptionCost

COST = PreemptionCost()  # the defaults


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
    gpu_types: str | None = typer.Option(
        None,
        "--gpu-types",
        help="the local executor's slots by GPU type, TYPE:COUNT,... (H100:4,A100:4: devices in that order); "
        "default: all of this machine's GPU model",
    ),
    cluster_config: Path | None = typer.Option(
        None, "--cluster-config", help="a YAML file of the GPU types' prices per GPU-hour (docs/platform.md)"
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
    restart_s: float = typer.Option(
        COST.restart_s, "--restart-s", min=0, help="what a preemption's restart costs here (the scheduler's budget)"
    ),
    commit_s: float = typer.Option(
        COST.commit_s, "--commit-s", min=0, help="a victim's checkpoint commits in this ..."
    ),
    commit_s_per_gpu: float = typer.Option(
        COST.commit_s_per_gpu, "--commit-s-per-gpu", min=0, help="... plus this per GPU"
    ),
    workers: int = typer.Option(
        1, "--workers", min=1, max=64, help="processes serving the API over the same database (PostgreSQL: --db)"
    ),
    lease_s: float = typer.Option(
        4.0,  # store.lease.LEASE_S, not imported: every command would load SQLAlchemy to start
        "--lease-s",
        min=1.0,
        max=600.0,
        help="servers sharing a database: the control loop's holder renews its lease within this, or another "
        "process takes the loop over",
    ),
) -> None:
    """Serve the control plane: the REST API, the scheduler, and an executor (docs/platform.md)."""
    from phalanx.control.executors.slurm import SlurmError
    from phalanx.control.server import cluster_config as config
    from phalanx.control.server.main import Settings, log_to_stderr, serve
    from phalanx.control.store import StoreError

    log_to_stderr()
    try:
        declared = _gpu_types(gpu_types) if gpu_types is not None else None
    except ValueError as e:
        err.print(f"[bold red]cannot serve[/]: --gpu-types {gpu_types!r}: {e}", highlight=False)
        raise typer.Exit(2) from None
    try:
        priced = config.load(cluster_config) if cluster_config is not None else ()
    except ValueError as e:
        err.print(f"[bold red]cannot serve[/]: {e}", highlight=False)
        raise typer.Exit(2) from None
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
        cost=PreemptionCost(restart_s, commit_s, commit_s_per_gpu),
        gpu_types=declared,
        priced=priced,
        lease_s=lease_s,
        workers=workers,
    )
    try:
        serve(settings)
    except (StoreError, ValueError, SlurmError) as e:
        err.print(f"[bold red]cannot serve[/]: {e}", highlight=False)
        raise typer.Exit(2) from None


def _gpu_types(text: str) -> dict[str, int]:
    """ "H100:4,A100:2" -> {"H100": 4, "A100": 2}."""
    import re

    types: dict[str, int] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]{0,62}):([1-9][0-9]{0,5})\s*", part)
        if match is None:
            raise ValueError(f"{part!r} is not TYPE:COUNT (a name, and 1 or more)")
        if match[1] in types:
            raise ValueError(f"{match[1]} is listed twice")
        types[match[1]] = int(match[2])
    return types


def register(app: typer.Typer) -> None:
    app.command()(server)
