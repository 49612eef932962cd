"""``phalanx ckpt``: list, verify, export and import checkpoints, local or in object storage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from phalanx.cli.common import err, out

if TYPE_CHECKING:
    from phalanx.checkpoint import CheckpointDir

ckpt_app = typer.Typer(no_args_is_help=True, help="List, verify, export and import checkpoints.")
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
        out.print(table)
    else:
        err.print(f"no checkpoints in {path}")


@ckpt_app.command("verify")
def ckpt_verify(path: str = CKPT) -> None:
    """Verify every checkpoint against its manifest (commit marker, sizes, checksums); exit 1 if any is invalid."""
    table, bad = _checkpoint_table(path)
    out.print(table)
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


@ckpt_app.command("import")
def ckpt_import(
    source: Path = typer.Argument(
        ...,
        help="a DeepSpeed or Megatron checkpoint: its step directory, a directory or run directory of them (the "
        "newest valid one), or a directory the framework wrote by itself",
    ),
    out: str = typer.Option(..., "--out", "-o", help="the checkpoint root to write in: a recipe job's checkpoint.dir"),
    preset: str | None = typer.Option(None, help="the model's preset, where the checkpoint's manifest records none"),
) -> None:
    """Import a DeepSpeed (ZeRO 1-3) or Megatron (dist_checkpointing) checkpoint of a Llama-shaped model as one of the
    built-in recipe: its weights, AdamW's moments and its step, which the recipe continues from at any layout."""
    from phalanx.train.convert import ConvertError, import_checkpoint

    try:
        framework, step, where = import_checkpoint(source, out, preset, lambda line: err.print(line, highlight=False))
    except ConvertError as e:
        err.print(f"[bold red]cannot import[/]: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(f"imported step {step} of {source} ({framework}) to {where}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(ckpt_app, name="ckpt")
