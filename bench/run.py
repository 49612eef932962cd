"""Run every benchmark in one go and write bench/RESULTS.md from what they measured.

    make bench      # builds .venv and .venv-bench (the peers' environment) first, then runs this

Each benchmark script measures phalanx and its peer in the same run and writes its own section (``--out``);
this script adds what the figures depend on (the command, the machine, the torch versions, the date), says
which peers could not run here and why, and keeps a failed benchmark's error in place of its figures.
Scripts whose peers need the benchmark environment run under its interpreter; the others under this one.
How to read each section: docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# (script, the environment it runs in): "bench" when its peers are installed only in .venv-bench.
BENCHMARKS = (
    ("step_overhead.py", "main"),
    ("data_loader.py", "bench"),
    ("checkpoint.py", "main"),
    ("recovery.py", "main"),  # its torchft side runs under .venv-bench's interpreter
    ("scheduler.py", "main"),  # reads ../shared/traces in place
    ("control_plane.py", "main"),  # starts its own servers: phalanx server, PostgreSQL
    ("cli_startup.py", "main"),  # against an earlier commit, in a git worktree
    ("node_loss.py", "main"),  # against an earlier commit, in a git worktree
    ("frameworks.py", "main"),  # DeepSpeed's own launcher as the peer
)
TORCHTITAN_ON_CPU = (
    "torchtitan (in .venv-bench) is not run on this machine: its Trainer needs a CUDA device (it calls "
    "`torch.cuda.set_device` as it starts, and stops with 'Found no NVIDIA driver' without one). On a CUDA "
    "machine `bench/gpu.sh` measures MFU and tokens/s of phalanx's 1B preset against torchtitan's Llama 3 trainer "
    "on the same shape and GPU, and this script includes it; on the lent GPU machine, which has no package "
    "registry, it runs alone (docs/benchmarks/gpu.md). `bench/gpu_dryrun.sh`, run by the tests, goes through its "
    "steps on the CPU."
)


def describe(python: str) -> dict:
    """The torch an interpreter has, and the GPUs it sees."""
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, 'gpus': "
        "[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor() or "unknown CPU",
    )
    kib = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line))
    return f"{os.cpu_count()} cores ({cpu}), {kib / 2**20:.0f} GiB memory, {platform.system()} {platform.release()}"


def run_one(script: str, interpreter: str, out: Path, log: Path, env: dict[str, str]) -> tuple[bool, float]:
    started = time.monotonic()
    with log.open("w") as f:
        code = subprocess.call(
            [interpreter, str(BENCH / script), "--out", str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **env},
        )
    return code == 0 and out.is_file(), time.monotonic() - started


def failed_section(script: str, log: Path) -> str:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    return (
        f"## {script}: failed\n\nNo figures: the benchmark did not finish. The end of its output:\n\n```\n{tail}\n```\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-python", default=str(REPO / ".venv-bench" / "bin" / "python"))
    parser.add_argument("--results", type=Path, default=BENCH / "RESULTS.md")
    args = parser.parse_args()
    pythons = {"main": sys.executable, "bench": args.bench_python}
    if not Path(args.bench_python).is_file():
        sys.exit(f"{args.bench_python} not found: `make bench-env` builds the benchmark environment")
    envs = {name: describe(python) for name, python in pythons.items()}
    gpus = envs["bench"]["gpus"]
    sections, took = [], []
    with tempfile.TemporaryDirectory() as tmp:
        plan = [(script, pythons[env], {}) for script, env in BENCHMARKS]
        if gpus:  # gpu.sh in the benchmark environment, which has its torchtitan: no wheels to add
            plan.append(("gpu.sh", "bash", {"PY": args.bench_python, "WHEELS": ""}))
        for script, interpreter, env in plan:
            out, log = Path(tmp) / f"{script}.md", Path(tmp) / f"{script}.log"
            print(f"[bench] {script} ...", flush=True)
            ok, seconds = run_one(script, interpreter, out, log, env)
            print(f"[bench] {script} {'done' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
            sections.append(out.read_text() if ok else failed_section(script, log))
            took.append(f"{script} {seconds:.0f} s")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        "# Benchmark results",
        f"Written by `make bench` (`bench/run.py`) on {when}. Machine: {machine()}; "
        + (f"GPUs: {', '.join(gpus)}." if gpus else "no GPU.")
        + f" Python {platform.python_version()}; torch {envs['main']['torch']} in `.venv` (step overhead, checkpoint,"
        f" recovery), torch {envs['bench']['torch']} in `.venv-bench`, the peers' environment (data loader,"
        " recovery's torchft side, torchtitan).",
        "Each ratio is against a peer measured in the same run of the same script; each section names its own "
        "command. How to read them: `docs/benchmarks/`. Time per benchmark: " + ", ".join(took) + ".",
    ]
    if not gpus:
        header.append(TORCHTITAN_ON_CPU)
    text = "\n\n".join(header) + "\n\n" + "\n".join(sections)
    args.results.write_text(text)
    print(f"[bench] wrote {args.results}")


if __name__ == "__main__":
    main()
