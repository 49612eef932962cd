"""Recovery from crashes: phalanx against torchrun --max-restarts with periodic DCP checkpoints, same job.

    .venv/bin/python bench/recovery.py [--steps 60] [--every 10] [--kill-at 25,45]

The job: llama-debug, FSDP2 over 2 CPU ranks, synthetic tokens, a checkpoint every ``--every`` steps.
Each side runs it twice: once clean, once with rank 1 killed by SIGKILL when the job has done each of the
``--kill-at`` steps. phalanx runs its recipe (async checkpoints, restart_backoff_s: 0 to match torchrun,
which waits for nothing); the peer is a hand-written FSDP2 loop under ``torchrun --max-restarts``, saving with
``dcp.save`` and resuming from its newest checkpoint, as one writes it with torch alone.

Printed per side: time from each kill to the first step completed after the restart, and goodput over the
faulty run (its clean run's time / its own time), then the ratios phalanx / torchrun.
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

REPO = Path(__file__).resolve().parent.parent
MODEL = (
    "train: {model: {preset: llama-debug}, steps: %d, global_batch: 8, micro_batch: 4, seq_len: 64,"
    " optimizer: {warmup_steps: 2}}"
)


def _steps(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _drive(proc: subprocess.Popen, steps_file: Path, pid_of_rank1, kill_at: list[int]) -> list[float]:
    """Kill rank 1 when the job has done each step in ``kill_at``; the seconds from each kill to the next
    step completed."""
    recoveries = []
    for target in kill_at:
        while not any(s["step"] + 1 >= target for s in _steps(steps_file)):
            assert proc.poll() is None, "the job ended before the kill"
            time.sleep(0.01)
        seen = len(_steps(steps_file))
        os.kill(pid_of_rank1(), signal.SIGKILL)
        killed = time.time()
        while len(_steps(steps_file)) <= seen:
            assert proc.poll() is None, "the job ended without recovering"
            time.sleep(0.01)
        recoveries.append(_steps(steps_file)[seen]["ts"] - killed)
    assert proc.wait() == 0, "the job failed"
    return recoveries


def run_phalanx(work: Path, args: argparse.Namespace, kill_at: list[int]) -> tuple[float, list[float]]:
    spec = work / "job.yaml"
    spec.write_text(
        f"name: bench\nresources: {{procs_per_node: 2, device: cpu}}\n{MODEL % args.steps}\n"
        f"checkpoint: {{dir: '{work / 'ckpt'}', every_steps: {args.every}, keep_last: 2}}\n"
        "resilience: {max_restarts: 10, restart_backoff_s: 0, stop_grace_s: 5}\n"
    )
    runs = work / "runs"
    started = time.time()
    cmd = [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(runs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    while not (runs / "bench").is_dir() or not list((runs / "bench").iterdir()):
        time.sleep(0.01)
    (run,) = (runs / "bench").iterdir()

    def pid_of_rank1() -> int:
        events = _steps(run / "events.jsonl")
        return int([e for e in events if e["kind"] == "attempt_started"][-1]["pids"]["1"])

    recoveries = _drive(proc, run / "metrics.jsonl", pid_of_rank1, kill_at)
    return time.time() - started, recoveries


def run_torchrun(work: Path, args: argparse.Namespace, kill_at: list[int]) -> tuple[float, list[float]]:
    env = {**os.environ, "BENCH_WORK": str(work), "BENCH_STEPS": str(args.steps), "BENCH_EVERY": str(args.every)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=10"]
    started = time.time()
    proc = subprocess.Popen(
        [*cmd, __file__, "--peer"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO
    )
    recoveries = _drive(proc, work / "steps.jsonl", lambda: int((work / "pid-1").read_text()), kill_at)
    return time.time() - started, recoveries


def peer() -> None:
    """The torchrun side: FSDP2 training of the same model and data, dcp.save every N steps, resume at start."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from phalanx.data.synthetic import SyntheticTokens
    from phalanx.train.models.llama import PRESETS, Llama

    work, steps, every = Path(os.environ["BENCH_WORK"]), int(os.environ["BENCH_STEPS"]), int(os.environ["BENCH_EVERY"])
    dist.init_process_group("gloo")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", default="25,45")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer()
        return
    kill_at = [int(s) for s in args.kill_at.split(",")]
    results = {}
    for name, side in (("phalanx", run_phalanx), ("torchrun", run_torchrun)):
        with tempfile.TemporaryDirectory() as clean, tempfile.TemporaryDirectory() as faulty:
            clean_s, _ = side(Path(clean), args, [])
            faulty_s, recoveries = side(Path(faulty), args, kill_at)
        results[name] = (clean_s, faulty_s, recoveries)
        print(
            f"  {name:<9} clean {clean_s:6.1f} s | with {len(kill_at)} kills {faulty_s:6.1f} s | "
            f"kill -> next step {', '.join(f'{r:.2f}' for r in recoveries)} s | goodput {clean_s / faulty_s:.1%}",
            flush=True,
        )
    (pc, pf, pr), (tc, tf, tr) = results["phalanx"], results["torchrun"]
    print(
        f"\nrecovery: llama-debug, FSDP2 over 2 CPU ranks, {args.steps} steps, checkpoint every {args.every}, "
        f"rank 1 killed at steps {args.kill_at}"
    )
    print(
        f"  time from kill to the next step, median: phalanx {statistics.median(pr):.2f} s, "
        f"torchrun {statistics.median(tr):.2f} s, ratio {statistics.median(pr) / statistics.median(tr):.2f}x"
    )
    print(f"  goodput with failures: phalanx {pc / pf:.1%}, torchrun {tc / tf:.1%}, ratio {(pc / pf) / (tc / tf):.2f}x")


if __name__ == "__main__":
    main()
