"""The ``phalanx`` command: the runtime's commands here (validate, run, agent); each other group in a module of
its own (data, ckpt, chaos, sim, server, the client commands, slurm and k8s). No module imports torch before a
command that needs it runs, so `phalanx --help` and the client commands start at once."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.syntax import Syntax

from phalanx.cli import admin, chaos, ckpt, clusters, data, db, jobs, server, sim
from phalanx.cli.common import JOB, RUNS_DIR, err, load_checked, out
from phalanx.spec import dump_spec

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Run PyTorch training jobs and keep them running.")


@app.command()
def validate(job: Path = JOB) -> None:
    """Print the resolved spec (defaults filled in), or every error in it; exit 2 on errors."""
    spec = load_checked(job)
    out.print(Syntax(dump_spec(spec), "yaml", background_color="default"))
    if spec.parallel:
        p = spec.parallel
        err.print(
            f"mesh: pp={p.pp} dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} "
            f"(world size {spec.resources.world_size})"
        )
        if p.pp > 1:
            from phalanx.train.pipeline import bubble_fraction

            m = spec.microbatches
            assert m is not None
            err.print(
                f"pipeline: {p.pp_schedule}, {p.stages} stages, {m} micro-batches a step, "
                f"bubble {bubble_fraction(p, m):.1%} in theory"
            )


@app.command()
def run(
    job: Path = JOB,
    runs_dir: Path = RUNS_DIR,
    local_nodes: bool = typer.Option(
        False, "--local-nodes", help="a multi-node job on this machine: an agent process per node, 127.0.0.2, .3, ..."
    ),
) -> None:
    """Run a job on this machine under a supervisor; the exit code says how it ended (0 succeeded)."""
    from phalanx.launch import LaunchError, Supervisor

    spec = load_checked(job)
    if local_nodes:
        from phalanx.launch.local_nodes import run_local_nodes

        raise typer.Exit(run_local_nodes(job, spec, runs_dir))
    try:
        supervisor = Supervisor(spec, runs_dir)
    except LaunchError as e:
        err.print(f"[bold red]cannot start[/] {spec.name}: {e}", highlight=False)
        raise typer.Exit(2) from None
    result = supervisor.run()
    raise typer.Exit(result.exit_code)


@app.command()
def agent(
    job: Path = JOB,
    rdzv: str = typer.Option(..., "--rdzv", help="HOST:PORT of the rendezvous, which node 0's agent hosts"),
    node_rank: int = typer.Option(
        ..., "--node-rank", min=0, help="this agent's node: 0 hosts the rendezvous; nodes, nodes + 1, ... are spares"
    ),
    addr: str | None = typer.Option(
        None, help="this node's address as the others reach it (default: node 0 the rendezvous host, else the hostname)"
    ),
    runs_dir: Path = RUNS_DIR,
    join_timeout_s: float = typer.Option(600.0, "--join-timeout-s", help="how long to wait for the other nodes"),
    on_node0_lost: str | None = typer.Option(
        None,
        "--on-node0-lost",
        help="a shell command a surviving agent runs once node 0 is lost, to have the cluster manager start the job "
        "again (the Slurm batch script gives scontrol requeue)",
    ),
) -> None:
    """Run this machine's part of a multi-node job: one agent per node, like torchrun's (docs/multinode.md)."""
    import os
    import socket

    from phalanx.launch import HostedRendezvous, LaunchError, NodeAgent, Supervisor
    from phalanx.launch.rendezvous import host_store
    from phalanx.launch.supervisor import STORE_TIMEOUT_S

    spec = load_checked(job)
    host, _, port = rdzv.rpartition(":")
    if not host or not port.isdigit():
        err.print(f"[bold red]--rdzv {rdzv}[/]: give HOST:PORT, e.g. 10.0.0.1:29400", highlight=False)
        raise typer.Exit(2)
    try:
        if node_rank == 0:
            store = host_store(host, int(port), STORE_TIMEOUT_S)
            hosted = HostedRendezvous(store, addr or host, join_timeout_s)
            raise typer.Exit(Supervisor(spec, runs_dir, rendezvous=hosted).run().exit_code)
        node = NodeAgent(
            spec, (host, int(port)), node_rank, addr or socket.gethostname(), join_timeout_s, on_lost=on_node0_lost
        )
        code = node.run()
    except (LaunchError, OSError) as e:
        err.print(f"[bold red]cannot start[/] {spec.name} node {node_rank}: {e}", highlight=False)
        if node_rank == 0:
            raise typer.Exit(2) from None
        code = 2
    # A store call abandoned past its bound (node 0 frozen) may still be inside torch on a thread of its own;
    # the interpreter's teardown would run into it and abort. Nothing is left to clean up: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for group in (data, ckpt, chaos, sim, server, db, jobs, admin, clusters):
    group.register(app)


def main() -> None:
    app()
