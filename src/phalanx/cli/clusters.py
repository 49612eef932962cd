"""``phalanx slurm`` and ``phalanx k8s``: a job spec as a cluster manager's job, printed or submitted."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from phalanx.cli.common import JOB, RUNS_DIR, err, load_checked

slurm_app = typer.Typer(
    no_args_is_help=True, help="Run jobs on a Slurm cluster: one agent per node (docs/clusters.md)."
)
k8s_app = typer.Typer(no_args_is_help=True, help="Run jobs on Kubernetes as a JobSet (docs/clusters.md).")
PARTITION = typer.Option(None, help="the partition, when the spec's slurm.partition names none")


@slurm_app.command("render")
def slurm_render(job: Path = JOB, runs_dir: Path = RUNS_DIR, partition: str | None = PARTITION) -> None:
    """Print the sbatch script that runs JOB (from this directory; its runs go under --runs-dir)."""
    from phalanx.control.executors.slurm import render

    spec = load_checked(job)
    log = runs_dir.absolute() / ".slurm" / f"{spec.name}-%j.out"
    print(render(spec, job.absolute(), runs_dir.absolute(), Path.cwd(), log, partition), end="")


@slurm_app.command("submit")
def slurm_submit(job: Path = JOB, runs_dir: Path = RUNS_DIR, partition: str | None = PARTITION) -> None:
    """sbatch JOB; its spec, script and log are kept in <runs-dir>/.slurm/<name>-<time>/ (on the shared
    filesystem, found again from any directory)."""
    from phalanx.control.executors.slurm import SlurmError, submit

    spec = load_checked(job)
    where = runs_dir.absolute() / ".slurm" / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        done = submit(job.read_text(), where, Path.cwd(), runs_dir, partition, source=str(job))
    except SlurmError as e:
        err.print(f"[bold red]cannot submit[/] {spec.name}: {e}", highlight=False)
        raise typer.Exit(1) from None
    print(done.job_id)
    err.print(
        f"submitted {spec.name} as Slurm job {done.job_id}\n  log: {done.log}\n"
        f"  each node's agent: {done.log.with_suffix('')}.<node>.out\n"
        f"  run directory: {done.runs_dir / spec.name}/<run id>, once it starts\n"
        f"  cancel: scancel {done.job_id} (the job checkpoints first)",
        highlight=False,
    )


@k8s_app.command("render")
def k8s_render(job: Path = JOB) -> None:
    """Print the job as Kubernetes manifests: a ConfigMap with its spec and a JobSet."""
    from phalanx.control.executors.kubernetes import KubernetesError, render, to_yaml

    spec = load_checked(job)
    try:
        print(to_yaml(render(spec, job.read_text())), end="")
    except KubernetesError as e:
        err.print(f"[bold red]cannot render[/] {spec.name}: {e}", highlight=False)
        raise typer.Exit(2) from None


@k8s_app.command("submit")
def k8s_submit(
    job: Path = JOB,
    context: str | None = typer.Option(None, help="the kubeconfig context (default: the current one)"),
) -> None:
    """Create the ConfigMap and the JobSet through the Kubernetes API (kubeconfig, or in-cluster)."""
    from phalanx.control.executors.kubernetes import KubernetesError, render, submit

    spec = load_checked(job)
    try:
        names = submit(render(spec, job.read_text()), context)
    except KubernetesError as e:
        err.print(f"[bold red]cannot submit[/] {spec.name}: {e}", highlight=False)
        raise typer.Exit(1) from None
    for name in names:
        err.print(f"created {name}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(slurm_app, name="slurm")
    app.add_typer(k8s_app, name="k8s")
