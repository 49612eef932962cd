"""phalanx's training step against a hand-written plain-PyTorch loop: same model, data, parallelism, machine.

    .venv/bin/python bench/step_overhead.py [--procs 2] [--preset llama-debug] [--rounds 6] [--repeats 3]

Launches itself under torchrun (so both loops see the same launcher), builds both loops in every worker and
times them interleaved, round by round, so that machine noise falls on both alike; the whole run is repeated
``--repeats`` times. phalanx's step includes everything it does per step (metrics to the run directory,
heartbeat, the progress line); the plain loop does what a careful hand-written loop does (accumulation,
clipping, AdamW, LR schedule, the loss all-reduced and read back, the next batch prepared in a background
thread while the step runs, as phalanx's prefetcher does). Prints the median step times and their ratio with
its range over the runs (markdown; also to ``--out``); the goal is <= 1.03x.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import _torchrun
from _report import Report, spread


def launch(args: argparse.Namespace) -> None:
    spec = (
        f"name: bench\nresources: {{procs_per_node: {args.procs}, device: {args.device}}}\n"
        f"train: {{model: {{preset: {args.preset}}}, parallel: {{dp_shard: {args.procs}}}, steps: 100000,"
        f" global_batch: {args.global_batch}, micro_batch: {args.micro_batch}, seq_len: {args.seq_len},"
        f" optimizer: {{warmup_steps: 10}}}}\ncheckpoint: {{every_steps: 1000000}}\n"
    )
    worker_args = [f"--rounds={args.rounds}", f"--steps-per-round={args.steps_per_round}"]
    runs = [_torchrun.run_workers(__file__, spec, args, worker_args) for _ in range(args.repeats)]
    first = runs[0]
    report = Report(
        "Step overhead",
        "python bench/step_overhead.py",
        f"torch {first['torch']}. {args.preset} ({first['params'] / 1e6:.1f}M params), FSDP2 over {args.procs} "
        f"{args.device} rank(s), global batch {args.global_batch} x {args.seq_len} tokens, micro-batch "
        f"{args.micro_batch}. Per run: {first['steps']} timed steps per side after 3 warm-up steps, interleaved in "
        f"rounds of {args.steps_per_round}; medians. {args.repeats} separate runs: each figure is the median over "
        "the runs, with their range. The peer is a hand-written plain PyTorch FSDP2 loop (accumulation, clipping, "
        "AdamW, LR schedule, the loss all-reduced and read back); both sides read their next batch from a "
        "background thread while the step runs (phalanx's prefetcher; the plain loop's one-thread executor).",
    )
    loops = {"plain": "plain PyTorch FSDP2 loop", "phalanx": "phalanx Trainer (metrics, heartbeat, step line)"}
    report.table(
        ["loop", "median step, ms (range over runs)"],
        [[name, spread([r[side] for r in runs], 1e3)] for side, name in loops.items()],
    )
    report.ratio("phalanx / plain loop, step time", [r["phalanx"] / r["plain"] for r in runs], "<= 1.03")
    report.finish(args.out)


def plain_loop(ctx, spec):
    """The hand-written peer: what one writes with torch alone for FSDP2 training of the same model."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from phalanx.data.synthetic import SyntheticTokens
    from phalanx.train.models.llama import Llama
    from phalanx.train.recipe import model_config

    t = spec.train
    cfg = model_config(spec)
    torch.manual_seed(t.seed)
    model = Llama(cfg).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    o = t.optimizer
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / o.warmup_steps))
    data = SyntheticTokens(cfg.vocab_size, t.seq_len, t.seed)
    accum = t.global_batch // (t.micro_batch * ctx.world_size)
    reader = ThreadPoolExecutor(1)  # reads the next batch while the step runs

    def read(step: int):
        return reader.submit(data.local_batch, step, t.global_batch, ctx.rank, ctx.world_size)

    step, upcoming = 0, read(0)

    def one_step() -> float:
        nonlocal step, upcoming
        batch = upcoming.result().to(ctx.device)
        upcoming = read(step + 1)
        total = torch.zeros((), device=ctx.device)
        for micro in batch.split(t.micro_batch):
            loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1).float(), micro[:, 1:].flatten())
            (loss / accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or math.inf).full_tensor().item()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        step += 1
        return total.item()

    return one_step


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import phalanx
    from phalanx.train.trainer import Trainer

    ctx = phalanx.init()
    trainer = Trainer(ctx)
    plain = plain_loop(ctx, ctx.spec)
    sides = {"phalanx": lambda: trainer.report(trainer.train_step()), "plain": plain}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():  # warm-up: allocator, gloo buffers, first-step costs
        for _ in range(3):
            fn()
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            for _ in range(args.steps_per_round):
                dist.barrier()
                started = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - started)
    if ctx.is_main:
        _torchrun.write_result(
            {
                "phalanx": statistics.median(times["phalanx"]),
                "plain": statistics.median(times["plain"]),
                "steps": len(times["plain"]),
                "params": trainer.cfg.num_params(),
                "torch": torch.__version__,
            }
        )
    ctx.close()


if __name__ == "__main__":
    _torchrun.main(
        __doc__,
        {
            "--preset": (str, "llama-debug"),
            "--global-batch": (int, 8),
            "--micro-batch": (int, 2),
            "--seq-len": (int, 128),
            "--rounds": (int, 6),
            "--steps-per-round": (int, 5),
        },
        launch,
        worker,
    )
