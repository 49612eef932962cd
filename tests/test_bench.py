"""The benchmarks' own machinery: the GPU script gone through on the CPU before any GPU sees it, and how a
ratio measured over repeated runs is judged against its goal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, unavailable

sys.path.insert(0, str(REPO / "bench"))
from _report import Ratio


def test_gpu_benchmark_runs_its_steps_on_the_cpu(tmp_path) -> None:
    """bench/gpu_dryrun.sh: the wheels (`make install` fetched them) installed beside the interpreter as on the
    GPU machine, phalanx's side trained through `phalanx run` (bf16, compile, final checkpoint), torchtitan's
    data written and its configuration built, the attention kernels probed, the report written."""
    wheels = Path(sys.prefix) / "gpu-wheels"
    if not any(wheels.glob("*.whl")):
        unavailable(f"no wheels in {wheels}: make install downloads them (bench/gpu_wheels.sh)")
    out = tmp_path / "gpu.md"
    result = subprocess.run(
        ["bash", "bench/gpu_dryrun.sh", "--out", str(out)],
        env={**os.environ, "PY": sys.executable, "WHEELS": str(wheels)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    assert re.search(r"^\| phalanx \| [\d,]+ \(", report, re.MULTILINE), report
    assert "| torchtitan 0.2.2 | n/a: its trainer needs CUDA" in report
    assert "phalanx `_scaled_dot_product_flash_attention_for_cpu`" in report


@pytest.mark.parametrize(
    "values, goal, met",
    [
        ([0.96, 0.98, 1.01], "<= 1.03", True),
        ([0.99, 1.01, 1.05], "<= 1.03", False),  # the median meets it, the range crosses it: not met
        ([1.2, 1.4], "> 1", True),
        ([0.9, 1.4], "> 1", False),
        ([0.5], "", None),  # no goal
    ],
)
def test_a_ratio_meets_its_goal_only_if_every_run_does(values: list[float], goal: str, met: bool | None) -> None:
    ratio = Ratio("phalanx / peer", values, goal)
    assert ratio.met() is met
    assert ("**not met**" in ratio.row()) == (met is False)
