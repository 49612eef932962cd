"""A DeepSpeed job's recovery from crashes: examples/deepspeed_zero.py under phalanx against the same training
under DeepSpeed's own launcher with the restart loop its users write (bench/_deepspeed_peer.py), on the same
model, data, ZeRO stage and checkpoint interval (bench/RESULTS.md, "DeepSpeed under phalanx").

    .venv/bin/python bench/frameworks.py [--zero 3] [--preset llama-debug] [--steps 60] [--every 10]
                                         [--kill-at 25,45] [--repeats 3] [--out section.md]

Each side runs the job clean, then again with its second process killed by SIGKILL when the job has done each of
the ``--kill-at`` steps: phalanx restarts the attempt (`restart_backoff_s: 0`, as the loop waits for nothing) and
the script resumes from the newest checkpoint that verifies; DeepSpeed's launcher stops the other rank and
exits, and ``until deepspeed ...; do :; done`` starts it again, resuming from DeepSpeed's ``latest``. Reported
per side, as bench/recovery.py does: the seconds from each kill to the next step completed, and goodput (the
clean run's wall time over the faulty run's).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import Report, spread
from recovery import THREADS, _drive, drive_phalanx, take_turns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import free_port

REPO = Path(__file__).resolve().parent.parent
PHALANX, DEEPSPEED = "phalanx run", "deepspeed launcher + restart loop"


def _script_args(args: argparse.Namespace) -> list[str]:
    return ["--zero", str(args.zero), "--preset", args.preset, "--steps", str(args.steps)]


def run_phalanx(work: Path, args: argparse.Namespace, kill_at: list[int]) -> tuple[float, list[float]]:
    spec = work / "job.yaml"
    command = ["python", str(REPO / "examples" / "deepspeed_zero.py"), *_script_args(args)]
    spec.write_text(
        "name: bench\nresources: {procs_per_node: 2, device: cpu}\n"
        f"command: {command}\n"
        f"checkpoint: {{dir: '{work / 'ckpt'}', every_steps: {args.every}, keep_last: 2}}\n"
        "resilience: {max_restarts: 10, restart_backoff_s: 0}\n"
    )
    return drive_phalanx(spec, work, kill_at)


def run_deepspeed(work: Path, args: argparse.Namespace, kill_at: list[int]) -> tuple[float, list[float]]:
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    launch = shlex.join([*launcher, str(REPO / "bench" / "_deepspeed_peer.py"), *_script_args(args)])
    env = {**os.environ, "OMP_NUM_THREADS": THREADS, "BENCH_WORK": str(work), "BENCH_EVERY": str(args.every)}
    started = time.time()
    loop = f"until {launch}; do :; done"  # the restart loop a DeepSpeed user writes around its launcher
    proc = subprocess.Popen(
        ["bash", "-c", loop], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work
    )
    recoveries = _drive(proc, work / "steps.jsonl", lambda: int((work / "pid-1").read_text()), kill_at)
    return time.time() - started, recoveries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--preset", default="llama-debug")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", default="25,45")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = parser.parse_args()
    kill_at = [int(s) for s in args.kill_at.split(",")]
    sides = {PHALANX: run_phalanx, DEEPSPEED: run_deepspeed}
    taken, lost = take_turns(sides, args, kill_at)
    results = {name: [r for r in rounds if r is not None] for name, rounds in taken.items()}
    import deepspeed
    import torch

    report = Report(
        "DeepSpeed under phalanx: recovery from crashes",
        "python bench/frameworks.py",
        f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}. examples/deepspeed_zero.py: {args.preset} "
        f"at ZeRO-{args.zero} on 2 CPU processes (gloo), global batch 8 x 32 tokens, {args.steps} steps, DeepSpeed's "
        f"own checkpoints every {args.every} steps. Each side runs the job clean, then again with its second process "
        f"killed by SIGKILL when the job has done steps {args.kill_at}. phalanx: `phalanx run` of the example (its "
        "checkpoints committed and verified by phalanx), `restart_backoff_s: 0`. DeepSpeed: the same training "
        "(bench/_deepspeed_peer.py imports the example's model, data and step) under `deepspeed --num_gpus 2`, "
        "DeepSpeed's checkpoints with its `latest` pointer, resumed from it, inside `until deepspeed ...; do :; "
        f"done`. Every process runs with OMP_NUM_THREADS={THREADS}. The sides take turns, {args.repeats} rounds: "
        "medians, with the range. Goodput: the side's clean wall time over its faulty one.",
    )
    rows = []
    for name, runs in results.items():
        if not runs:
            rows.append([name, "-", "-", "-", "-"])
            continue
        kills = [[rec[i] for *_, rec in runs] for i in range(len(kill_at))]
        rows.append(
            [name, spread([c for c, _, _ in runs]), spread([f for _, f, _ in runs]),
             spread([c / f for c, f, _ in runs], 100, "{:.1f}%"), " / ".join(spread(k, fmt="{:.2f}") for k in kills)]
        )  # fmt: skip
    report.table(["side", "clean s", "with kills s", "goodput", "kill to next step s (each kill)"], rows)
    if results[PHALANX] and results[DEEPSPEED]:
        pairs = list(zip(results[PHALANX], results[DEEPSPEED], strict=False))
        report.ratio(
            "goodput, phalanx / DeepSpeed's launcher",
            [(c / f) / (c2 / f2) for (c, f, _), (c2, f2, _) in pairs],
            unit="x",
        )
        kill_to_step = [statistics.mean(a[2]) / statistics.mean(b[2]) for a, b in pairs]
        report.ratio("kill to next step (mean of the kills), phalanx / DeepSpeed's launcher", kill_to_step)
    for line in lost:
        report.note(f"Round lost: {line}")
    report.finish(args.out)


if __name__ == "__main__":
    main()
