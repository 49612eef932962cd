"""How long a checkpoint stops training: DCP's sync ``save``, DCP's ``async_save``, and phalanx's async save.

    .venv/bin/python bench/checkpoint.py [--procs 2] [--dim 512] [--layers 8] [--rounds 5]

Launches itself under torchrun; every worker builds the phalanx Trainer (FSDP2 over all ranks) and, round by
round, saves the same training state by each method in turn, with training steps between saves:

- sync DCP: ``dcp.save`` of the state; training waits for all of it.
- DCP async_save: ``dcp.async_save`` over a gloo group of its own; training waits while it returns (it
  stages the state into fresh CPU memory before returning).
- phalanx: ``CheckpointManager.save`` (async); training waits while it returns and, in the next step,
  while ``staged()`` waits for the copy into the reused buffers to finish before the optimizer step; the
  write, hashing and commit run behind.

Blocking time is what the training thread spends in those calls, rank 0's, median over the rounds after the
first (the first pays one-time costs: buffer allocation, plan caches; it is printed too). Each async save is
waited for before the next method's save, outside the timed region. Also printed: the median training step
while a background write runs (on a machine with few cores, the write competes with training for them).
Goal: phalanx blocking <= 5% of sync DCP and <= 0.5x DCP async_save.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import _torchrun
from _report import Report


def launch(args: argparse.Namespace) -> None:
    spec = (
        f"name: bench\nresources: {{procs_per_node: {args.procs}, device: {args.device}}}\n"
        f"train: {{model: {{preset: llama-debug, dim: {args.dim}, n_layers: {args.layers}}},"
        f" parallel: {{dp_shard: {args.procs}}}, steps: 100000, global_batch: {2 * args.procs},"
        f" micro_batch: 2, seq_len: 64, optimizer: {{warmup_steps: 10}}}}\n"
        "checkpoint: {every_steps: 1000000}\n"
    )
    _torchrun.launch(__file__, spec, args, [f"--rounds={args.rounds}", f"--steps-between={args.steps_between}"])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import phalanx
    from phalanx.checkpoint import CheckpointManager
    from phalanx.spec.model import Checkpoint
    from phalanx.train.trainer import Trainer

    ctx = phalanx.init()
    trainer = Trainer(ctx)
    root = tempfile.mkdtemp(prefix="phalanx-bench-ckpt-") if ctx.is_main else None
    shared = [root]
    dist.broadcast_object_list(shared, src=0)
    root = shared[0]
    committed: list[dict] = []
    manager = CheckpointManager(
        f"{root}/phalanx",
        Checkpoint(every_steps=1, keep_last=1),
        layout=trainer.parallel.model_dump(),
        spec_hash="bench",
        device=ctx.device,
        log=lambda _: None,
        event=lambda kind, **fields: committed.append(fields),
    )
    trainer.checkpoints.close()
    trainer.checkpoints = manager  # train_step calls its staged() before the optimizer step
    dcp_group = dist.new_group(backend="gloo")
    blocked: dict[str, list[float]] = {"sync DCP": [], "DCP async_save": [], "phalanx": []}
    overlapped: dict[str, list[float]] = {"DCP async_save": [], "phalanx": [], "no save": []}
    pending = None

    def steps(n: int, during: str | None) -> float:
        """Train n steps; the time this rank spent in them waiting for a save's staging."""
        waited = 0.0
        for i in range(n):
            before = manager.blocked_s
            started = time.perf_counter()
            trainer.train_step()
            if during is not None and i == 0:
                overlapped[during].append(time.perf_counter() - started)
            waited += manager.blocked_s - before
        return waited

    save_id = 0
    first: dict[str, float] = {}
    for r in range(args.rounds + 1):
        for method in blocked:
            save_id += 1
            where = f"{root}/{method.split()[0]}/save-{save_id}"
            dist.barrier()
            started = time.perf_counter()
            if method == "sync DCP":
                dcp.save(trainer.state, checkpoint_id=where)
            elif method == "DCP async_save":
                pending = dcp.async_save(trainer.state, checkpoint_id=where, process_group=dcp_group)
            else:
                manager.save(save_id, trainer.state)
            took = time.perf_counter() - started
            took += steps(args.steps_between, None if method == "sync DCP" else method)
            if pending is not None:
                pending.result()
                pending = None
            manager.wait()
            dist.barrier()
            if ctx.is_main and method != "phalanx":
                shutil.rmtree(where)
            if r > 0 or args.rounds == 0:
                blocked[method].append(took)
            else:
                first[method] = took
        dist.barrier()
        started = time.perf_counter()
        trainer.train_step()
        overlapped["no save"].append(time.perf_counter() - started)
    if ctx.is_main:
        med = {m: statistics.median(v) for m, v in blocked.items()}
        cfg = trainer.cfg
        report = Report(
            "Checkpoint blocking",
            "python bench/checkpoint.py",
            f"torch {torch.__version__}. llama-debug widened to dim {cfg.dim} x {cfg.n_layers} layers "
            f"({cfg.num_params() / 1e6:.1f}M params, {committed[-1]['bytes'] / 2**20:.0f} MiB per checkpoint with "
            f"the AdamW state), FSDP2 over {ctx.world_size} {ctx.device.type} rank(s), local disk. Each round saves "
            f"the same training state by each method in turn, {args.steps_between} training steps after each "
            f"save; {len(blocked['phalanx'])} timed rounds after one warm-up round, medians, rank 0.",
        )
        report.table(
            ["method", "training blocked per save (median)", "first save"],
            [[m, f"{med[m] * 1e3:.1f} ms", f"{first[m] * 1e3:.0f} ms" if m in first else "-"] for m in blocked],
        )
        report.ratio("phalanx / sync DCP, blocked per save", med["phalanx"] / med["sync DCP"], "<= 0.05")
        report.ratio("phalanx / DCP async_save, blocked per save", med["phalanx"] / med["DCP async_save"], "<= 0.5")
        steps_while = {m: f"{statistics.median(v) * 1e3:.0f} ms" for m, v in overlapped.items()}
        report.note(
            "Behind training: phalanx's write, sha256 of every file and commit took "
            f"{statistics.median(c['write_s'] for c in committed):.2f} s (median). The training step that overlaps "
            f"a background write took {steps_while['phalanx']} with phalanx and {steps_while['DCP async_save']} "
            f"with DCP async_save, against {steps_while['no save']} with no save running (the write competes "
            "with training for the CPU cores)."
        )
        report.finish(args.out)
    manager.close()
    dist.destroy_process_group(dcp_group)
    if ctx.is_main:
        shutil.rmtree(root)
    ctx.close()


if __name__ == "__main__":
    options = {"--dim": (int, 512), "--layers": (int, 8), "--rounds": (int, 5), "--steps-between": (int, 3)}
    _torchrun.main(__doc__, options, launch, worker)
