"""What the command modules share: the consoles, the arguments every runner takes, and the checked spec load.
Nothing here imports torch: `phalanx --help` and the client commands start without it."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from phalanx.spec import JobSpec, SpecError, load_spec

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 10_000)  # piped: one row a line, unwrapped

JOB = typer.Argument(..., help="the job spec (YAML)", dir_okay=False)
RUNS_DIR = typer.Option(
    Path("runs"), help="where run directories are created: <runs-dir>/<name>/<run id> (multi-node: a shared path)"
)


def load_checked(path: Path) -> JobSpec:
    """The spec, checked in full (against the recipe's model, the datasets, the command: launch/preflight.py),
    or exit 2 with every issue, the same way for every command that runs a job."""
    from phalanx.launch.preflight import preflight

    try:
        spec = load_spec(path)
        preflight(spec)
        return spec
    except SpecError as e:
        err.print(f"[bold red]invalid job spec[/] {e.source}:")
        for issue in e.issues:
            err.print(f"  [red]-[/] [bold]{issue.path or '(file)'}[/]: {issue.message}", highlight=False)
        raise typer.Exit(2) from None
