"""What a checkpoint costs training: DCP's sync ``save``, DCP's ``async_save`` with its async stager, and
phalanx's async save; the time training is blocked, and the whole cost (blocked plus the extra time of the
training steps that run beside the background write).

    .venv/bin/python bench/checkpoint.py [--procs 2] [--dim 512] [--layers 8] [--rounds 6] [--gap 8] [--repeats 3]

Launches itself under torchrun; every worker builds the phalanx Trainer (FSDP2 over all ranks) and, round by
round, saves the same training state by each method in turn, training between saves:

- sync DCP: ``dcp.save`` of the state; training waits for all of it.
- DCP async_save, set up as its docs recommend: one ``DefaultStager`` kept across saves (asynchronous
  staging into CPU buffers it caches and reuses; pinned memory and non-blocking copies on CUDA), the write
  on DCP's background thread over a gloo group of its own. ``FileSystemWriter(cache_staged_state_dict=True)``
  pins its buffers unconditionally and fails without CUDA ("Cannot access accelerator device"), and the
  process-based writer (``AsyncCheckpointerType.PROCESS``) hung on CPU here, so neither is used. Training
  waits for the staging to finish before its optimizer changes the weights, as phalanx's does.
- phalanx: ``CheckpointManager.save`` (async): the copy into reused buffers, then the write (each file
  hashed as it is written) and commit, behind training; the trainer waits in ``staged()`` before its
  optimizer step.
- phalanx's memory snapshot (in-process recovery's state, ``checkpoint/memory.py``): each rank serializes its
  shard into host memory and trades a copy with its ring neighbour; both run beside training, but here it is
  waited for at once, so its whole cost is the time it blocks (an upper bound of what training waits for).

Blocked: what the training thread spends in those calls (the save call, then the wait for staging inside the
next step). Whole cost: the wall time the save added to training, that is blocked plus, over the steps that
ran while the write was still going, their time less as many steps with no save in flight (the median of
those). Signed, not each step's excess clipped at 0 as the goodput ledger splits a step: clipping adds the
steps' own noise, and more of it to a write that spans more steps. After an async save training goes on until
its write is done; after every save, ``--gap`` steps with no save in flight (the baseline) come before the
next method's save: a job saves every few minutes, not back to back, and on a host that gives freed memory
back (this machine's VM hands it to its host within seconds) a write after a pause pays to map fresh pages for
the page cache, which saves one after another did not show. The methods take turns in an order that rotates
from round to round, so none always follows the same one. Each method's saves are deleted by the benchmark
between saves, outside the timings (phalanx's keep_last retirement would otherwise delete behind training,
which DCP leaves to its user). Rank 0's figures; medians over the rounds after the first (which pays one-time
costs: buffer allocation, plan caches), then the median and range over ``--repeats`` separate runs. Goals:
phalanx blocking <= 5% of sync DCP and <= 0.5x DCP async_save; whole cost below DCP async_save's (issue 17).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _torchrun
from _report import Report, spread

MAX_STEPS_BESIDE_A_WRITE = 50
MEMORY = "phalanx memory snapshot"


def launch(args: argparse.Namespace) -> None:
    spec = (
        f"name: bench\nresources: {{procs_per_node: {args.procs}, device: {args.device}}}\n"
        f"train: {{model: {{preset: llama-debug, dim: {args.dim}, n_layers: {args.layers}}},"
        f" parallel: {{dp_shard: {args.procs}}}, steps: 100000, global_batch: {2 * args.procs},"
        f" micro_batch: 2, seq_len: 64, optimizer: {{warmup_steps: 10}}}}\n"
        "checkpoint: {every_steps: 1000000}\n"
    )
    worker_args = [f"--rounds={args.rounds}", f"--gap={args.gap}"]
    runs = [_torchrun.run_workers(__file__, spec, args, worker_args) for _ in range(args.repeats)]
    first, methods = runs[0], list(runs[0]["blocked"])
    report = Report(
        "Checkpoint cost",
        "python bench/checkpoint.py",
        f"torch {first['torch']}. llama-debug widened to dim {args.dim} x {args.layers} layers "
        f"({first['params'] / 1e6:.1f}M params, {first['bytes'] / 2**20:.0f} MiB per checkpoint with the AdamW "
        f"state), FSDP2 over {args.procs} {args.device} rank(s), local disk. Each round saves the same training "
        "state by each method in turn, in an order that rotates from round to round; after an async save training "
        f"goes on until its write is done; after each save, {args.gap} steps with no save in flight. Whole cost: the "
        "wall time a save added to training (blocked, plus the steps beside the write less as many quiet steps). "
        f"{args.rounds} timed rounds after one warm-up round, medians, rank 0; {args.repeats} separate runs: "
        "each figure is the median over the runs, with their range. DCP async_save runs with a kept "
        "`DefaultStager` (async staging into cached buffers), the setting its docs recommend that works on CPU. "
        "The memory snapshot is in-process recovery's: each rank's shard serialized into host memory and a copy "
        "traded with its ring neighbour, waited for at once (in training both run beside the next step).",
    )
    report.table(
        ["method", "blocked per save, ms", "whole cost per save, ms", "steps beside the write", "first save, ms"],
        [
            [
                m,
                spread([r["blocked"][m] for r in runs], 1e3),
                spread([r["cost"][m] for r in runs], 1e3),
                spread([r["beside"][m] for r in runs], fmt="{:.0f}"),
                spread([r["first"][m] for r in runs], 1e3, "{:.0f}"),
            ]
            for m in methods
        ],
    )

    def ratios(figure: str, a: str, b: str) -> list[float]:
        return [r[figure][a] / r[figure][b] for r in runs]

    report.ratio("phalanx / sync DCP, blocked per save", ratios("blocked", "phalanx", "sync DCP"), "<= 0.05")
    report.ratio("phalanx / DCP async_save, blocked per save", ratios("blocked", "phalanx", "DCP async_save"), "<= 0.5")
    report.ratio("phalanx / DCP async_save, whole cost per save", ratios("cost", "phalanx", "DCP async_save"), "< 1")
    report.ratio(f"{MEMORY} / phalanx, whole cost per save", ratios("cost", MEMORY, "phalanx"), "")
    report.note(
        "Behind training: phalanx's write, checksum of every file and commit took "
        f"{spread([r['write_s'] for r in runs], fmt='{:.2f}')} s per save. A training step with no save in flight "
        f"took {spread([r['quiet'] for r in runs], 1e3, '{:.0f}')} ms; steps beside a write are slower, because "
        "the write competes with training for the CPU cores and for Python's GIL."
    )
    report.finish(args.out)


class DcpAsync:
    """DCP's async_save behind the calls the trainer makes of its checkpointer: ``staged()`` before the
    optimizer step, ``writing`` (and ``blocked_s``, ``wait()`` for this benchmark)."""

    def __init__(self, group, cuda: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.group = group
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
        self.stager = DefaultStager(options)
        self.response = None
        self.blocked_s = 0.0

    def save(self, state, where: str) -> None:
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        self.response = dcp.async_save(state, checkpoint_id=where, process_group=self.group, async_stager=self.stager)
        self.blocked_s = time.perf_counter() - started

    def staged(self) -> None:
        if self.response is not None and not self.response.staging_completion.done():
            started = time.perf_counter()
            self.response.staging_completion.result()
            self.blocked_s += time.perf_counter() - started

    @property
    def writing(self) -> bool:
        return self.response is not None and not self.response.upload_completion.done()

    def wait(self) -> None:
        if self.response is not None:
            self.response.upload_completion.result()

    def close(self) -> None:
        self.stager.close()


def worker(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import phalanx
    from phalanx.checkpoint import CheckpointManager
    from phalanx.checkpoint.memory import PeerMemory
    from phalanx.spec.model import Checkpoint
    from phalanx.train.trainer import Trainer

    ctx = phalanx.init()
    trainer = Trainer(ctx)
    shared = [tempfile.mkdtemp(prefix="phalanx-bench-ckpt-") if ctx.is_main else None]
    dist.broadcast_object_list(shared, src=0)
    root = shared[0]
    committed: list[dict] = []
    ours = CheckpointManager(
        f"{root}/phalanx",
        Checkpoint(every_steps=1, keep_last=10**6),  # the benchmark deletes each save, as it does DCP's
        layout=trainer.parallel.model_dump(),
        spec_hash="bench",
        device=ctx.device,
        log=lambda _: None,
        event=lambda kind, **fields: committed.append(fields),
    )
    trainer.checkpoints.close()
    dcp_group = dist.new_group(backend="gloo")
    theirs = DcpAsync(dcp_group, ctx.device.type == "cuda")
    memory = PeerMemory(1, lambda: False)
    methods = ("sync DCP", "DCP async_save", "phalanx", MEMORY)
    blocked: dict[str, list[float]] = {m: [] for m in methods}
    cost: dict[str, list[float]] = {m: [] for m in methods}
    beside: dict[str, list[int]] = {m: [] for m in methods}
    first: dict[str, float] = {}
    quiet: list[float] = []  # step times with no save in flight
    pending: list[tuple[str, float, list[float]]] = []  # per async save: (method, blocked, its steps' work)

    def anyone(flag: bool) -> bool:
        """``flag`` on any rank: every rank must take the same steps, though a write may end on one rank
        just before and on another just after a step begins."""
        agreed = torch.tensor([float(flag)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return bool(agreed.item())

    def step(checkpointer) -> tuple[float, bool]:
        """One training step with ``checkpointer`` as the trainer's (its staged() runs before the optimizer
        step); the step's time less its staging wait, and whether the write was still going at its start on
        any rank."""
        trainer.checkpoints = checkpointer
        before, writing = checkpointer.blocked_s, anyone(checkpointer.writing)
        started = time.perf_counter()
        trainer.train_step()
        return time.perf_counter() - started - (checkpointer.blocked_s - before), writing

    save_id = 0
    for r in range(args.rounds + 1):
        for method in methods[r % len(methods) :] + methods[: r % len(methods)]:
            save_id += 1
            where = f"{root}/{method.split()[0]}/save-{save_id}"
            dist.barrier()
            if method in ("sync DCP", MEMORY):
                started = time.perf_counter()
                if method == MEMORY:
                    memory.take(save_id, trainer.in_memory)
                    memory.settle()
                else:
                    dcp.save(trainer.state, checkpoint_id=where)
                took, work = time.perf_counter() - started, []
            else:
                checkpointer = ours if method == "phalanx" else theirs
                if method == "phalanx":
                    ours.save(save_id, trainer.state)
                else:
                    theirs.save(trainer.state, where)
                work = []
                while len(work) < MAX_STEPS_BESIDE_A_WRITE:
                    spent, writing = step(checkpointer)
                    if not writing:  # the write ended before this step began
                        break
                    work.append(spent)
                checkpointer.wait()
                took = checkpointer.blocked_s
            dist.barrier()
            if ctx.is_main and method != MEMORY:
                shutil.rmtree(ours.dir.location(save_id) if method == "phalanx" else where)
            if r == 0:
                first[method] = took
            else:
                blocked[method].append(took)
                beside[method].append(len(work))
                pending.append((method, took, work))
            for _ in range(args.gap):
                spent = step(ours)[0]  # no save in flight
                if r > 0:
                    quiet.append(spent)
    usual = statistics.median(quiet)
    for method, took, work in pending:
        cost[method].append(took + sum(work) - usual * len(work))
    if ctx.is_main:
        _torchrun.write_result(
            {
                "blocked": {m: statistics.median(v) for m, v in blocked.items()},
                "cost": {m: statistics.median(v) for m, v in cost.items()},
                "beside": {m: statistics.median(v) for m, v in beside.items()},
                "first": first,
                "quiet": statistics.median(quiet),
                "write_s": statistics.median(c["write_s"] for c in committed),
                "bytes": committed[-1]["bytes"],
                "params": trainer.cfg.num_params(),
                "torch": torch.__version__,
            }
        )
    ours.close()
    theirs.close()
    dist.destroy_process_group(dcp_group)
    if ctx.is_main:
        shutil.rmtree(root)
    ctx.close()


if __name__ == "__main__":
    options = {"--dim": (int, 512), "--layers": (int, 8), "--rounds": (int, 6), "--gap": (int, 8)}
    _torchrun.main(__doc__, options, launch, worker)
