"""The ``phalanx`` command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from phalanx.cli import clusters, platform
from phalanx.cli.checked import load_checked
from phalanx.obs.rates import LLAMA3_GPU_HOURS_PER_FAILURE
from phalanx.resilience.simulate import STRATEGIES, Costs, goodput_table, scope_shares
from phalanx.spec import dump_spec

if TYPE_CHECKING:
    from phalanx.checkpoint import CheckpointDir

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Run PyTorch training jobs and keep them running.")
err = Console(stderr=True, soft_wrap=True)
stdout = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 10_000)  # piped: one row a line, unwrapped

JOB = typer.Argument(..., help="the job spec (YAML)", exists=False, dir_okay=False)


@app.command()
def validate(job: Path = JOB) -> None:
    """Print the resolved spec (defaults filled in), or every error in it; exit 2 on errors."""
    spec = load_checked(job)
    stdout.print(Syntax(dump_spec(spec), "yaml", background_color="default"))
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


RUNS_DIR = typer.Option(
    Path("runs"), help="where run directories are created: <runs-dir>/<name>/<run id> (multi-node: a shared path)"
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


data_app = typer.Typer(no_args_is_help=True, help="Prepare and check tokenized datasets.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    sources: list[Path] = typer.Argument(..., help="text files, .jsonl, .parquet, or directories of them"),
    out: Path = typer.Option(..., "--out", help="the dataset directory to write"),
    tokenizer: str = typer.Option("byte", help="byte | bpe:VOCAB (trained on the inputs) | path to tokenizer.json"),
    field: str = typer.Option("text", help="the text field of JSON lines / column of Parquet"),
    shard_tokens: int = typer.Option(1 << 26, help="tokens per shard (shards hold whole documents)"),
    eos_token: str = typer.Option(None, help="end-of-document token of a tokenizer.json (default: detected)"),
    dtype: str = typer.Option(None, help="uint16 | uint32 (default: the smallest that holds the vocabulary)"),
) -> None:
    """Tokenize documents into memory-mapped shards with a checksummed index; rerun to resume if interrupted."""
    from phalanx.data.prepare import prepare

    try:
        ds = prepare(
            sources, out, tokenizer=tokenizer, field=field, shard_tokens=shard_tokens, eos_token=eos_token, dtype=dtype
        )
    except ValueError as e:
        err.print(f"[bold red]cannot prepare[/] {out}: {e}", highlight=False)
        raise typer.Exit(2) from None
    err.print(
        f"{out}: {ds.index['documents']:,} documents, {ds.total_tokens:,} tokens in {len(ds.shards)} "
        f"shard(s), {ds.dtype.name}, vocabulary {ds.vocab_size:,}",
        highlight=False,
    )


@data_app.command("verify")
def data_verify(dataset: Path = typer.Argument(..., help="a prepared dataset directory")) -> None:
    """Check every shard against the index (size and sha256); exit 1 naming the first bad file."""
    from phalanx.data.shards import DatasetError, TokenDataset

    try:
        ds = TokenDataset(dataset, verify="full")
    except DatasetError as e:
        err.print(f"[bold red]bad dataset[/]: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(f"{dataset}: ok, {len(ds.shards)} shard(s), {ds.total_tokens:,} tokens", highlight=False)


ckpt_app = typer.Typer(no_args_is_help=True, help="List, verify and export checkpoints.")
app.add_typer(ckpt_app, name="ckpt")
CKPT = typer.Argument(
    ..., help="a run directory (its checkpoints/), or a checkpoint directory: a path or a URL such as s3://bucket/run"
)


def _checkpoints(where: str) -> CheckpointDir:
    from phalanx.checkpoint import CheckpointDir

    run = Path(where) / "checkpoints"
    return CheckpointDir(run if "://" not in where and run.is_dir() else where)


def _checkpoint_table(where: str) -> tuple[Table, int]:
    """Every checkpoint under ``where`` with its step, size and status, and how many are not valid."""
    checkpoints = _checkpoints(where)
    table = Table("step", "size", "status", "path", box=None, header_style="bold")
    bad = 0
    for step in checkpoints.steps():
        problem = checkpoints.verify(step)
        bad += problem is not None
        status = "[green]valid[/]" if problem is None else f"[red]invalid[/]: {problem}"
        table.add_row(str(step), f"{checkpoints.size(step) / 2**20:.1f} MiB", status, checkpoints.location(step))
    return table, bad


@ckpt_app.command("ls")
def ckpt_ls(path: str = CKPT) -> None:
    """List checkpoints with step, size and status (valid, or why not)."""
    table, _ = _checkpoint_table(path)
    if table.row_count:
        stdout.print(table)
    else:
        err.print(f"no checkpoints in {path}")


@ckpt_app.command("verify")
def ckpt_verify(path: str = CKPT) -> None:
    """Verify every checkpoint against its manifest (commit marker, sizes, checksums); exit 1 if any is invalid."""
    table, bad = _checkpoint_table(path)
    stdout.print(table)
    if bad or not table.row_count:
        err.print(f"{bad} invalid checkpoint(s)" if table.row_count else f"no checkpoints in {path}")
        raise typer.Exit(1)


@ckpt_app.command("export")
def ckpt_export(
    path: str = CKPT,
    out: Path = typer.Option(..., "--out", "-o", help="directory for model.safetensors and config.json"),
    step: int | None = typer.Option(None, help="the checkpoint's step (default: the latest valid one)"),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16"),
) -> None:
    """Export a checkpoint's model in Hugging Face Llama layout (safetensors + config.json) for transformers."""
    from phalanx.checkpoint.export import ExportError, export_hf

    checkpoints = _checkpoints(path)
    try:
        step, files = export_hf(checkpoints, step, out, dtype)
    except ExportError as e:
        err.print(f"[bold red]cannot export[/]: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(f"exported step {step} of {checkpoints} to {', '.join(map(str, files))}", highlight=False)


@app.command()
def chaos(
    run: Path = typer.Argument(
        ..., help="a running job's run directory (runs/<name>/<run id>), or runs/<name>: its newest running run"
    ),
    fault: str = typer.Argument(..., help="kill | hang | slow | nan | spike | corrupt"),
    rank: int | None = typer.Option(None, help="the rank to strike (default: one at random)"),
    at_step: str | None = typer.Option(
        None, "--at-step", help="wait until the job has done this many steps; A-B: a step drawn from A to B"
    ),
    seed: int | None = typer.Option(None, help="seed of the random rank, to repeat a chaos run"),
    slow_s: float = typer.Option(10.0, "--slow-s", help="how long `slow` keeps the rank slow"),
    slow_speed: float = typer.Option(0.5, "--slow-speed", help="the share of its speed `slow` leaves the rank"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="how long to wait for the run and for --at-step"),
) -> None:
    """Inject a fault into a running job: kill or hang a rank, slow it down, poison a step with NaN or a loss
    spike, or corrupt the newest checkpoint. Recovery is the job's: watch it in the run's output and events."""
    import random

    from phalanx.resilience.chaos import (
        FAULTS,
        RANK_FAULTS,
        ChaosError,
        check_slow_speed,
        current_attempt,
        inject,
        running_run,
        wait_for_step,
    )

    if fault not in FAULTS:
        err.print(f"[bold red]unknown fault[/] {fault!r}; faults: {', '.join(FAULTS)}", highlight=False)
        raise typer.Exit(2)
    draw = random.Random(seed)
    try:
        check_slow_speed(slow_speed)
        target = running_run(run, timeout_s)
        if at_step is not None:
            low, _, high = at_step.partition("-")
            if not (low.isdigit() and (high.isdigit() or not high)):
                err.print(f"[bold red]--at-step {at_step}[/]: give a step (20) or a range (10-30)", highlight=False)
                raise typer.Exit(2)
            wait_for_step(target, draw.randint(int(low), int(high or low)), timeout_s)
        if rank is None and fault in RANK_FAULTS:
            rank = draw.randrange(len(current_attempt(target).pids))
        done = inject(target, fault, rank if rank is not None else 0, slow_s, slow_speed)
    except ChaosError as e:
        err.print(f"[bold red]cannot inject[/]: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(done, highlight=False)


sim_app = typer.Typer(no_args_is_help=True, help="Simulate: a cluster's scheduling on a trace, a long job's goodput.")
app.add_typer(sim_app, name="sim")


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
    restart_s: float = typer.Option(60.0, "--restart-s", min=0),
    commit_s: float = typer.Option(20.0, "--commit-s", help="a victim's save commits in this ...", min=0),
    commit_s_per_gpu: float = typer.Option(1.25, "--commit-s-per-gpu", help="... plus this per GPU", min=0),
    limit: int | None = typer.Option(None, help="replay only the first N jobs (a quick look)", min=1),
    workers: int = typer.Option(2, help="processes to replay policies and tenants in", min=1),
) -> None:
    """Replay a GPU-cluster trace through phalanx's scheduler and the baselines on the same simulated cluster;
    print one row per policy (docs/scheduling.md explains the columns)."""
    import time

    from phalanx.control.sim.report import COLUMNS, metrics, rows
    from phalanx.control.sim.scenario import Scenario, replay
    from phalanx.control.sim.simulator import Costs
    from phalanx.control.sim.trace import TraceError

    names = [p.strip() for p in policies.split(",") if p.strip()]
    scenario = Scenario(
        trace, start, end, racks, nodes_per_rack, gpus_per_node, borrowing,
        Costs(checkpoint_every_s, restart_s, commit_s, commit_s_per_gpu), seed, limit,
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
    stdout.print(table)
    err.print(f"replayed in {time.monotonic() - began:.0f} s", highlight=False)


@sim_app.command("goodput")
def sim_goodput(
    gpus: str = typer.Option("1024,4096,16384,65536", help="job sizes, comma-separated"),
    days: float = typer.Option(30.0, help="days of training work each simulated job does", min=0.01),
    seeds: int = typer.Option(5, help="simulated jobs per strategy and size (the mean is shown)", min=1),
    step_s: float = typer.Option(Costs.step_s, "--step-s", help="seconds per training step", min=1e-6),
    save_s: float = typer.Option(Costs.save_s, "--save-s", help="training time a storage checkpoint costs", min=0),
    restart_s: float = typer.Option(Costs.restart_s, "--restart-s", help="a restart's failure-to-next-step", min=0),
    in_process_s: float = typer.Option(Costs.in_process_s, "--in-process-s", help="an in-process recovery", min=0),
    spare_s: float = typer.Option(Costs.spare_s, "--spare-s", help="a spare node's takeover, in process", min=0),
    snapshot_s: float = typer.Option(Costs.snapshot_s, "--snapshot-s", help="one in-memory snapshot", min=0),
    hang_detect_s: float = typer.Option(Costs.hang_detect_s, "--hang-detect-s", help="until a hang is found", min=0),
    replace_s: float = typer.Option(Costs.replace_s, "--replace-s", help="a restart's wait for a new node", min=0),
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
    costs = Costs(
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
    stdout.print(table)
    shares = ", ".join(f"{scope} {share:.1%}" for scope, share in scope_shares().items())
    err.print(
        f"failures: one per {LLAMA3_GPU_HOURS_PER_FAILURE:,.0f} GPU-hours (Llama 3), by scope {shares}; costs: "
        f"step {step_s:g} s, save {save_s:g} s, restart {restart_s:g} s, in process {in_process_s:g} s, "
        f"spare node {spare_s:g} s, snapshot {snapshot_s:g} s, hang detection {hang_detect_s:g} s, "
        f"new node {replace_s:g} s",
        highlight=False,
    )


platform.register(app)
clusters.register(app)


def main() -> None:
    app()
