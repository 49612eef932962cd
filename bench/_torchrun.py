"""Run a benchmark script's workers under torchrun with a phalanx job spec, as a real job's workers see it,
as many times as ``--repeats`` says: each run's rank 0 hands back its figures (``write_result``), and the
launcher reports their medians and ranges."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_workers(script: str, spec_yaml: str, args: argparse.Namespace, worker_args: list[str]) -> dict[str, Any]:
    """Run ``script --worker *worker_args`` on ``args.procs`` ranks, with PHALANX_SPEC / PHALANX_RUN_DIR set;
    return the figures its rank 0 wrote with ``write_result``."""
    with tempfile.TemporaryDirectory() as run_dir:
        spec, result = Path(run_dir) / "spec.yaml", Path(run_dir) / "result.json"
        spec.write_text(spec_yaml)
        env = {**os.environ, "PHALANX_RUN_DIR": run_dir, "PHALANX_SPEC": str(spec), "BENCH_RESULT": str(result)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}"]
        subprocess.run([*cmd, script, "--worker", *worker_args], env=env, check=True)
        return json.loads(result.read_text())


def write_result(figures: dict[str, Any]) -> None:
    """In a worker (rank 0): hand this run's figures back to the launcher."""
    Path(os.environ["BENCH_RESULT"]).write_text(json.dumps(figures))


def main(
    doc: str,
    options: dict[str, tuple[type, object]],
    launcher: Callable[[argparse.Namespace], None],
    worker: Callable[[argparse.Namespace], None],
) -> None:
    """Parse ``--procs``, ``--device``, ``--repeats`` and the script's ``options`` ({"--name": (type, default)});
    run the launcher, or, under torchrun (``--worker``), the worker."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="separate runs, for the median and the range")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    for name, (kind, default) in options.items():
        parser.add_argument(name, type=kind, default=default)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    (worker if args.worker else launcher)(args)
