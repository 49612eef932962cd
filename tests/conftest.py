from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


class Job:
    """A job spec written to a temporary directory, run through the real `phalanx` command."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.runs = tmp / "runs"

    def spec(self, text: str) -> Path:
        path = self.tmp / "job.yaml"
        path.write_text(text)
        return path

    def command_spec(self, script: str, *args: str, procs: int = 2, extra: str = "") -> Path:
        argv = json.dumps(["python", str(WORKERS / script), *args])
        return self.spec(f"name: t\nresources: {{procs_per_node: {procs}, device: cpu}}\ncommand: {argv}\n{extra}")

    def argv(self, spec: Path) -> list[str]:
        return [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(self.runs)]

    def run(self, spec: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(spec), capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def run_dir(self) -> Path:
        (run,) = (self.runs / "t").iterdir()
        return run


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return Job(tmp_path)
