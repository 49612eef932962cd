"""``phalanx sim``: replay a cluster trace through the scheduler and its baselines, and the goodput of a long
job against its size for each recovery strategy."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from phalanx.cli.common import err, out
from phalanx.control.scheduler.costs import PreemptionCost
from phalanx.obs.rates import LLAMA3_GPU_HOURS_PER_FAILURE
from phalanx.resilience.simulate import STRATEGIES, RecoveryCosts, goodput_table, scope_shares

COST = PreemptionCost()  # the defaults

sim_app = typer.Typer(no_args_is_help=True, help="Simulate: a cluster's scheduling on a trace, a long job's goodput.")


@sim_app.command("trace")
def sim_trace(
    trace: Path = typer.Argument(..., help="a Philly job table (philly_pollux_jobs.csv: timestamp, duration, ...)"),
    start: str = typer.Option("2017-10-01", help="replay jobs submitted from this date ..."),
    end: str = typer.Option("2017-11-01", help="... until this date (exclusive)"),
    racks: int = typer.Option(10, min=1),
    nodes_per_rack: int = typer.Option(8, "--nodes-per-rack", min=1),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1),
    policies: str = typer.Option("phalanx,fifo,kueue-like,tiresias-like", help="comma-separated"),
    seed: int = typer.Option(0, help="draws submit-time jitter (up to 60 s) and checkpoint phases"),
    borrowing: bool = typer.Option(True, help="tenants in one cohort may borrow idle quota"),
    checkpoint_every_s: float = typer.Option(1800.0, "--checkpoint-every-s", min=1),
    restart_s: float = typer.Option(COST.restart_s, "--restart-s", min=0),
    commit_s: float = typer.Option(COST.commit_s, "--commit-s", help="a victim's save commits in this ...", min=0),
    commit_s_per_gpu: float = typer.Option(
        COST.commit_s_per_gpu, "--commit-s-per-gpu", help="... plus this per GPU", min=0
    ),
    limit: int | None = typer.Option(None, help="replay only the first N jobs (a quick look)", min=1),
    workers: int = typer.Option(2, help="processes to replay policies and tenants in", min=1),
    fleet: bool = typer.Option(
        False,
        "--fleet-gavel",
        help="the same GPUs as equal thirds of V100, P100 and K80 nodes, at Gavel's measured rates",
    ),
) -> None:
    """Replay a GPU-cluster trace through phalanx's scheduler and the baselines on the same simulated cluster;
    print one row per policy (docs/scheduling.md explains the columns)."""
    import time

    from phalanx.control.sim.fleet import gavel_fleet
    from phalanx.control.sim.report import COLUMNS, metrics, rows
    from phalanx.control.sim.scenario import Scenario, replay
    from phalanx.control.sim.simulator import ReplayCosts
    from phalanx.control.sim.trace import TraceError

    names = [p.strip() for p in policies.split(",") if p.strip()]
    scenario = Scenario(
        trace, start, end, racks, nodes_per_rack, gpus_per_node, borrowing,
        ReplayCosts(restart_s, commit_s, commit_s_per_gpu, checkpoint_every_s), seed, limit,
        gavel_fleet(racks * nodes_per_rack * gpus_per_node, gpus_per_node) if fleet else None,
    )  # fmt: skip
    began = time.monotonic()
    try:
        results = replay(scenario, names, workers)
    except (TraceError, ValueError) as e:
        err.print(f"[bold red]cannot replay[/]: {e}", highlight=False)
        raise typer.Exit(2) from None
    table = Table(title=f"{trace.name} {start}..{end} on {scenario.gpus} GPUs, seed {seed}")
    for heading, _, _ in COLUMNS:
        table.add_column(heading, justify="left" if heading == "policy" else "right")
    for row in rows([metrics(r, results.get("fifo")) for r in results.values()]):
        table.add_row(*row)
    out.print(table)
    err.print(f"replayed in {time.monotonic() - began:.0f} s", highlight=False)


@sim_app.command("goodput")
def sim_goodput(
    gpus: str = typer.Option("1024,4096,16384,65536", help="job sizes, comma-separated"),
    days: float = typer.Option(30.0, help="days of training work each simulated job does", min=0.01),
    seeds: int = typer.Option(5, help="simulated jobs per strategy and size (the mean is shown)", min=1),
    step_s: float = typer.Option(RecoveryCosts.step_s, "--step-s", help="seconds per training step", min=1e-6),
    save_s: float = typer.Option(
        RecoveryCosts.save_s, "--save-s", help="training time a storage checkpoint costs", min=0
    ),
    restart_s: float = typer.Option(
        RecoveryCosts.restart_s, "--restart-s", help="a restart's failure-to-next-step", min=0
    ),
    in_process_s: float = typer.Option(
        RecoveryCosts.in_process_s, "--in-process-s", help="an in-process recovery", min=0
    ),
    spare_s: float = typer.Option(
        RecoveryCosts.spare_s, "--spare-s", help="a spare node's takeover, in process", min=0
    ),
    snapshot_s: float = typer.Option(RecoveryCosts.snapshot_s, "--snapshot-s", help="one in-memory snapshot", min=0),
    hang_detect_s: float = typer.Option(
        RecoveryCosts.hang_detect_s, "--hang-detect-s", help="until a hang is found", min=0
    ),
    replace_s: float = typer.Option(
        RecoveryCosts.replace_s, "--replace-s", help="a restart's wait for a new node", min=0
    ),
) -> None:
    """Expected goodput of one long training job against its size, for each recovery strategy: failures drawn
    from the Llama 3 report's interruption causes and rate, costs measured on this machine (docs/failures.md)."""
    try:
        sizes = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        err.print(f"[bold red]--gpus {gpus}[/]: give GPU counts, e.g. 1024,16384", highlight=False)
        raise typer.Exit(2)
    costs = RecoveryCosts(
        step_s=step_s, save_s=save_s, restart_s=restart_s, in_process_s=in_process_s, spare_s=spare_s,
        snapshot_s=snapshot_s, hang_detect_s=hang_detect_s, replace_s=replace_s,
    )  # fmt: skip
    rows = goodput_table(sizes, costs, days, seeds)
    table = Table(title=f"goodput of a {days:g}-day job, mean of {seeds} simulated runs")
    table.add_column("strategy")
    for size in sizes:
        table.add_column(f"{size:,} GPUs", justify="right")
    for strategy in STRATEGIES:
        mine = [r for r in rows if r.strategy == strategy.name]
        table.add_row(strategy.name, *(f"{r.goodput:.2%}" for r in mine))
    out.print(table)
    shares = ", ".join(f"{scope} {share:.1%}" for scope, share in scope_shares().items())
    err.print(
        f"failures: one per {LLAMA3_GPU_HOURS_PER_FAILURE:,.0f} GPU-hours (Llama 3), by scope {shares}; costs: "
        f"step {step_s:g} s, save {save_s:g} s, restart {restart_s:g} s, in process {in_process_s:g} s, "
        f"spare node {spare_s:g} s, snapshot {snapshot_s:g} s, hang detection {hang_detect_s:g} s, "
        f"new node {replace_s:g} s",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(sim_app, name="sim")
