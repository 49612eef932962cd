"""Run a benchmark script's workers under torchrun with a phalanx job spec, as a real job's workers see it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def launch(script: str, spec_yaml: str, args: argparse.Namespace, worker_args: list[str]) -> None:
    """Run ``script --worker *worker_args`` on ``args.procs`` ranks, with PHALANX_SPEC / PHALANX_RUN_DIR set
    (and ``--out`` passed on, for rank 0's report); exit with torchrun's code."""
    if args.out is not None:
        worker_args = [*worker_args, f"--out={args.out.absolute()}"]
    with tempfile.TemporaryDirectory() as run_dir:
        spec = Path(run_dir) / "spec.yaml"
        spec.write_text(spec_yaml)
        env = {**os.environ, "PHALANX_RUN_DIR": run_dir, "PHALANX_SPEC": str(spec)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}"]
        sys.exit(subprocess.call([*cmd, script, "--worker", *worker_args], env=env))


def main(
    doc: str,
    options: dict[str, tuple[type, object]],
    launcher: Callable[[argparse.Namespace], None],
    worker: Callable[[argparse.Namespace], None],
) -> None:
    """Parse ``--procs``, ``--device`` and the script's ``options`` ({"--name": (type, default)}); run the
    launcher, or, under torchrun (``--worker``), the worker."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    for name, (kind, default) in options.items():
        parser.add_argument(name, type=kind, default=default)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    (worker if args.worker else launcher)(args)
