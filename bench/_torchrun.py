"""Run a benchmark script's workers under torchrun with a phalanx job spec, as a real job's workers see it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def launch(script: str, spec_yaml: str, procs: int, worker_args: list[str]) -> None:
    """Run ``script --worker *worker_args`` on ``procs`` ranks, with PHALANX_SPEC / PHALANX_RUN_DIR set; exit
    with torchrun's code."""
    with tempfile.TemporaryDirectory() as run_dir:
        spec = Path(run_dir) / "spec.yaml"
        spec.write_text(spec_yaml)
        env = {**os.environ, "PHALANX_RUN_DIR": run_dir, "PHALANX_SPEC": str(spec)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        sys.exit(subprocess.call([*cmd, script, "--worker", *worker_args], env=env))
