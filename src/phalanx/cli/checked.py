"""A job spec read for a command that runs it (`phalanx run`, `agent`, `slurm`, `k8s`): checked in full, or
exit 2 with every issue, the same way for each."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from phalanx.spec import JobSpec, SpecError, load_spec

err = Console(stderr=True, soft_wrap=True)


def load_checked(path: Path) -> JobSpec:
    """The spec, checked in full (against the recipe's model, the datasets, the command: launch/preflight.py),
    or exit 2 with every issue."""
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
