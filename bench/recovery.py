"""Recovery from crashes: phalanx against torchrun --max-restarts with periodic DCP checkpoints, and against
torchft's per-step fault tolerance, on the same model and data. Over 400 lines on purpose: the three sides'
harnesses must run in one process tree and one report, side by side.

    .venv/bin/python bench/recovery.py [--steps 60] [--every 10] [--kill-at 25,45] [--repeats 3] [--torchft-python PY]

The job: llama-debug on 2 CPU processes, synthetic tokens, global batch 8. Each side runs it twice: once
clean, once with its second process killed by SIGKILL when the job has done each of the ``--kill-at`` steps.

- phalanx runs its recipe (FSDP2, async checkpoints every ``--every`` steps, restart_backoff_s: 0 to match
  torchrun, which waits for nothing);
- torchrun: a hand-written FSDP2 loop under ``torchrun --max-restarts``, saving with ``dcp.save`` and resuming
  from its newest checkpoint, as one writes it with torch alone;
- torchft (where it is installed, as in ``make bench-env``): DDP over two replica groups of one process, each
  under its own torchrun, with a lighthouse; the survivor trains on, the restarted group heals from it.

Every process of every side runs with the same number of threads (OMP_NUM_THREADS: the cores shared
between the two processes a side runs at a time). Reported per side: time from each kill to the next step
the job completed, and goodput over the faulty run (its clean run's time / its own time), then phalanx's
ratios to each peer; the sides take turns, ``--repeats`` times, and each figure is the median with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import Report, spread

from phalanx.obs import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers import descendants, free_port, signal_all

REPO = Path(__file__).resolve().parent.parent
THREADS = str(max(1, (os.cpu_count() or 1) // 2))  # per process: two processes of a side run at a time
STALL_S = 300  # a side that makes no step for this long is stopped


class RoundLost(RuntimeError):
    """A side's run stalled (and was stopped) or failed: its round is reported, not measured."""


IN_PROCESS = "phalanx in process (warm spare, state from memory)"
MODEL = (
    "train: {model: {preset: llama-debug}, steps: %d, global_batch: 8, micro_batch: 4, seq_len: 64,"
    " optimizer: {warmup_steps: 2}}"
)


def _steps(path: Path) -> list[dict]:
    """The records of a JSON-lines file being written (a half-written last line is left out)."""
    return list(read_jsonl(path)) if path.is_file() else []


def _drive(proc: subprocess.Popen, steps_file: Path, pid_of_rank1, kill_at: list[int]) -> list[float]:
    """Kill rank 1 when the job has done each step in ``kill_at``; the seconds from each kill to the next
    step completed. A job that makes no step for STALL_S is stopped (it and every process below it), and it or
    a job that fails is given up (RoundLost), naming where it stood, rather than ending the benchmark."""
    recoveries: list[float] = []
    progress = [time.monotonic(), 0]  # when the number of steps last changed, and that number

    def wait_until(done, what: str) -> None:
        while not done():
            if proc.poll() is not None and not done():
                raise RoundLost(f"the job ended {what} (exit code {proc.returncode})")
            if (count := len(_steps(steps_file))) != progress[1]:
                progress[:] = [time.monotonic(), count]
            elif time.monotonic() - progress[0] > STALL_S:
                signal_all(descendants(proc.pid), signal.SIGKILL)
                raise RoundLost(f"no step for {STALL_S} s after {count} steps, {what}; stopped")
            time.sleep(0.01)

    for target in kill_at:
        wait_until(lambda t=target: any(s["step"] + 1 >= t for s in _steps(steps_file)), "before the kill")
        seen = len(_steps(steps_file))
        os.kill(pid_of_rank1(), signal.SIGKILL)
        killed = time.time()
        wait_until(lambda n=seen: len(_steps(steps_file)) > n, "without recovering")
        recoveries.append(_steps(steps_file)[seen]["ts"] - killed)
    wait_until(lambda: proc.poll() is not None, "before finishing")
    if proc.wait() != 0:
        raise RoundLost(f"the job failed (exit code {proc.returncode})")
    return recoveries


Round = tuple[float, float, list[float]]  # a side's clean seconds, its faulty seconds, its kill-to-next-step seconds


def take_turns(
    sides: dict, args: argparse.Namespace, kill_at: list[int]
) -> tuple[dict[str, list[Round | None]], list[str]]:
    """Each side runs the job clean, then with ``kill_at``'s kills, taking turns for ``args.repeats`` rounds: per
    side one entry per round (None where a run stalled or failed), and what each lost round said."""
    results: dict[str, list[Round | None]] = {name: [] for name in sides}
    lost: list[str] = []
    for r in range(args.repeats):
        for name, side in sides.items():
            with tempfile.TemporaryDirectory() as clean, tempfile.TemporaryDirectory() as faulty:
                try:
                    clean_s, _ = side(Path(clean), args, [])
                    faulty_s, recoveries = side(Path(faulty), args, kill_at)
                except RoundLost as e:
                    lost.append(f"{name}, round {r + 1}: {e}")
                    results[name].append(None)
                    print(f"  {name}: {e}", flush=True)
                    continue
            results[name].append((clean_s, faulty_s, recoveries))
            print(f"  {name}: clean {clean_s:.1f} s, faulty {faulty_s:.1f} s, recoveries {recoveries}", flush=True)
    return results, lost


def run_phalanx(
    work: Path, args: argparse.Namespace, kill_at: list[int], in_process: bool = False
) -> tuple[float, list[float]]:
    spec = work / "job.yaml"
    spec.write_text(
        f"name: bench\nresources: {{procs_per_node: 2, device: cpu}}\n{MODEL % args.steps}\n"
        f"checkpoint: {{dir: '{work / 'ckpt'}', every_steps: {args.every}, keep_last: 2}}\n"
        "resilience: {max_restarts: 10, restart_backoff_s: 0, stop_grace_s: 5"
        + (f", in_process: true, memory_every_steps: {args.memory_every}}}\n" if in_process else "}\n")
    )
    return drive_phalanx(spec, work, kill_at)


def drive_phalanx(spec: Path, work: Path, kill_at: list[int]) -> tuple[float, list[float]]:
    """`phalanx run` of ``spec`` (a job named bench) with its runs under ``work``, its rank 1 killed at each of
    ``kill_at``'s steps (``_drive``): its wall seconds and the seconds from each kill to the next step."""
    runs = work / "runs"
    started = time.time()
    cmd = [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(runs)]
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    while not (runs / "bench").is_dir() or not list((runs / "bench").iterdir()):
        time.sleep(0.01)
    (run,) = (runs / "bench").iterdir()

    def pid_of_rank1() -> int:  # in-process recoveries put spares in ranks' places: the newest pids
        events = _steps(run / "events.jsonl")
        return int([e for e in events if e["kind"] in ("attempt_started", "recovery_started")][-1]["pids"]["1"])

    recoveries = _drive(proc, run / "metrics.jsonl", pid_of_rank1, kill_at)
    return time.time() - started, recoveries


def run_torchrun(work: Path, args: argparse.Namespace, kill_at: list[int]) -> tuple[float, list[float]]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": THREADS,
        "BENCH_WORK": str(work),
        "BENCH_STEPS": str(args.steps),
        "BENCH_EVERY": str(args.every),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=10"]
    started = time.time()
    proc = subprocess.Popen(
        [*cmd, __file__, "--peer"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    recoveries = _drive(proc, work / "steps.jsonl", lambda: int((work / "pid-1").read_text()), kill_at)
    return time.time() - started, recoveries


def peer() -> None:
    """The torchrun side: FSDP2 training of the same model and data, dcp.save every N steps, resume at start."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from phalanx.data.synthetic import SyntheticTokens
    from phalanx.train.models.args import PRESETS
    from phalanx.train.models.llama import Llama

    work, steps, every = Path(os.environ["BENCH_WORK"]), int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_EVERY"])
    # torch's default gloo timeout is 30 minutes; a careful user sets a short one, so that a restarted pair
    # that cannot connect (seen here: both ranks stuck in ProcessGroupGloo's set-up for 10 minutes) fails
    # and torchrun restarts it again, instead of the job waiting half an hour.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    (work / f"pid-{rank}").write_text(str(os.getpid()))
    torch.manual_seed(1234)
    model = Llama(PRESETS["llama-debug"])
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    data = SyntheticTokens(PRESETS["llama-debug"].vocab_size, 64, 1234)
    step = 0
    saved = sorted(int(p.name) for p in (work / "ckpt").glob("*") if (p / ".metadata").is_file())
    if saved:
        m, o = get_state_dict(model, opt)
        state = {"model": m, "optim": o}
        dcp.load(state, checkpoint_id=str(work / "ckpt" / str(saved[-1])))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = saved[-1]
    while step < steps:
        batch = data.local_batch(step, 8, rank, world)
        total = torch.zeros(())
        for micro in batch.split(4):
            loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten())
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        step += 1
        if rank == 0:
            with (work / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"step": step - 1, "ts": time.time(), "loss": total.item() / world}) + "\n")
        if step % every == 0 or step == steps:
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o}, checkpoint_id=str(work / "ckpt" / str(step)))
    dist.barrier()
    dist.destroy_process_group()


def run_torchft(work: Path, args: argparse.Namespace, kill_at: list[int]) -> tuple[float, list[float]]:
    """Two replica groups of one process each, each under its own ``torchrun --max-restarts``, coordinated
    by a torchft lighthouse: the survivor of a kill trains on while the killed group restarts and heals from it."""
    port = free_port()
    lighthouse_cmd = [str(Path(args.torchft_python).with_name("torchft_lighthouse")), "--min_replicas", "1"]
    lighthouse = subprocess.Popen(
        [*lighthouse_cmd, "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cmd = [args.torchft_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd.append("--max-restarts=10")
    env = {
        **os.environ,
        "BENCH_WORK": str(work),
        "BENCH_STEPS": str(args.steps),
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
        "OMP_NUM_THREADS": THREADS,  # each replica group is one process, as each rank of the other sides
    }
    started = time.time()
    groups: list[subprocess.Popen] = []
    try:
        groups += [
            subprocess.Popen(
                [*cmd, __file__, "--torchft-peer"],
                env={**env, "REPLICA_GROUP_ID": str(r)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=REPO,
            )
            for r in range(2)
        ]
        recoveries = _drive(groups[0], work / "steps.jsonl", lambda: int((work / "pid-1").read_text()), kill_at)
        assert groups[1].wait(timeout=120) == 0, "replica group 1 failed"
    finally:
        for group in groups:
            signal_all(descendants(group.pid), signal.SIGKILL)
        lighthouse.kill()
        lighthouse.wait()
    return time.time() - started, recoveries


def torchft_peer() -> None:
    """One torchft replica group: the same model and data as the other sides, DDP across the replica groups
    through torchft's Manager; replica 0 logs each committed step."""
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from phalanx.data.synthetic import SyntheticTokens
    from phalanx.train.models.args import PRESETS
    from phalanx.train.models.llama import Llama

    work, steps = Path(os.environ["BENCH_WORK"]), int(os.environ["BENCH_STEPS"])
    replica = int(os.environ["REPLICA_GROUP_ID"])
    (work / f"pid-{replica}").write_text(str(os.getpid()))
    torch.manual_seed(1234)
    model = Llama(PRESETS["llama-debug"])
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"bench_{replica}",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    data = SyntheticTokens(PRESETS["llama-debug"].vocab_size, 64, 1234)
    while (step := manager.current_step()) < steps:
        optimizer.zero_grad()  # starts the step's quorum; a restarted group heals from a live peer here
        batch = data.local_batch(step, 8, replica, 2)
        loss = F.cross_entropy(ddp(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # commits only if every member of the quorum finished the step
        if replica == 0 and manager.current_step() > step:
            with (work / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "ts": time.time(), "replicas": manager.num_participants()}) + "\n")
    manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", default="25,45")
    parser.add_argument("--memory-every", type=int, default=1, help="in-process side: memory snapshot every N steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--torchft-python",
        default=str(REPO / ".venv-bench" / "bin" / "python"),
        help="an interpreter with torchft (its torch is newer than phalanx's; `make bench-env`)",
    )
    parser.add_argument("--torchft-peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer()
        return
    if args.torchft_peer:
        torchft_peer()
        return
    kill_at = [int(s) for s in args.kill_at.split(",")]
    sides = {
        "phalanx": run_phalanx,
        IN_PROCESS: lambda work, args, kill_at: run_phalanx(work, args, kill_at, in_process=True),
        "torchrun --max-restarts + DCP": run_torchrun,
    }
    missing = []
    probe = [args.torchft_python, "-c", "import torchft, torch; print(torch.__version__)"]
    found = subprocess.run(probe, capture_output=True, text=True) if Path(args.torchft_python).is_file() else None
    torchft_torch = found.stdout.strip() if found is not None and found.returncode == 0 else None
    if torchft_torch is not None:
        sides["torchft (2 replica groups, live healing)"] = run_torchft
    else:
        missing.append(f"torchft: {args.torchft_python} has no torchft (`make bench-env` installs it)")
    results, lost = take_turns(sides, args, kill_at)
    import torch

    report = Report(
        "Recovery from crashes",
        "python bench/recovery.py",
        f"torch {torch.__version__}. llama-debug (4.2M params) on 2 CPU processes, synthetic tokens, global batch "
        f"8 x 64 tokens, {args.steps} steps. Each side runs the job clean, then again with its second process "
        f"killed by SIGKILL when the job has done steps {args.kill_at}. phalanx: its recipe (FSDP2, async "
        f"checkpoints every {args.every} steps, `restart_backoff_s: 0`); in process: the same with "
        f"`resilience.in_process: true` (one warm spare, a memory snapshot every {args.memory_every} step(s)), "
        "the goodput against its own clean run, which pays for the snapshots. torchrun: a hand-written FSDP2 loop "
        f"under `torchrun --standalone --max-restarts=10`, `dcp.save` every {args.every} steps and a resume from "
        "the newest at start. torchft: the same model as DDP over 2 replica groups of one process, each under "
        "its own torchrun, coordinated by a torchft lighthouse; no checkpoints (a restarted group heals from "
        "the live one, and until it is back the survivor trains on its own half of the batch)"
        + (f", with the benchmark environment's torch {torchft_torch}" if torchft_torch else "")
        + f". Every process runs with OMP_NUM_THREADS={THREADS}. The sides take turns, {args.repeats} rounds: "
        "medians, with the range.",
    )

    def column(runs: list[tuple[float, float, list[float]]], pick, fmt: str, scale: float = 1.0) -> str:
        return spread([pick(*run) for run in runs], scale, fmt) if runs else "-"

    rows = []
    for name, rounds in results.items():
        runs, stalled = [run for run in rounds if run is not None], rounds.count(None)
        rows.append(
            [
                name + (f" ({stalled} of {len(rounds)} rounds stalled or failed)" if stalled else ""),
                column(runs, lambda c, f, r: c, "{:.1f}"),
                column(runs, lambda c, f, r: f, "{:.1f}"),
                spread([x for _, _, rec in runs for x in rec], fmt="{:.2f}") if runs else "-",
                column(runs, lambda c, f, r: c / f, "{:.1f}%", 100),
            ]
        )
    header = ["side", "clean run, s", f"with {len(kill_at)} kills, s", "kill -> next step completed, s", "goodput"]
    report.table(header, rows)
    goals = {  # (kill -> next step, goodput) against torchrun, for each phalanx side
        "phalanx": ("< 1", "> 1"),
        IN_PROCESS: ("<= 0.3", "> 1"),
    }
    for ours in goals:
        for name, runs in results.items():
            if name.startswith("phalanx"):
                continue
            paired = [(a, b) for a, b in zip(results[ours], runs, strict=True) if a is not None and b is not None]
            if not paired:
                continue
            goal = goals[ours] if name.startswith("torchrun") else ("", "")
            recovery = [statistics.median(pr) / statistics.median(rec) for (_, _, pr), (_, _, rec) in paired]
            goodput = [(pc / pf) / (c / f) for (pc, pf, _), (c, f, _) in paired]
            report.ratio(f"{ours} / {name}, kill -> next step (median of the kills)", recovery, goal[0])
            report.ratio(f"{ours} / {name}, goodput with failures", goodput, goal[1])
    both = [(a, b) for a, b in zip(results["phalanx"], results[IN_PROCESS], strict=True) if a and b]
    if both:  # what the memory snapshots cost a run without failures
        report.ratio(f"{IN_PROCESS} / phalanx, clean run time", [b[0] / a[0] for a, b in both], "")
    for why in lost:
        report.note(f"Not measured: {why}. Its round is left out of the figures and of the ratios to that side.")
    for why in missing:
        report.note(f"Not measured: {why}.")
    report.finish(args.out)


if __name__ == "__main__":
    main()
