"""Your own training script under phalanx, with the worker SDK: FSDP2 over every rank, heartbeats for the hang
detector, metrics for the progress line and the loss curve, and checkpoints to restart from.

    phalanx run examples/own_script.yaml          # or plain `python examples/own_script.py`, one process

A restart (after a crash, a hang, a preemption) resumes from the newest valid checkpoint, with the same
model, optimizer and step as if it had never stopped.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

import phalanx
from phalanx.checkpoint import CheckpointManager
from phalanx.spec.model import Checkpoint
from phalanx.train.state import ModelAndOptimizer, Progress


@record  # a rank's exception goes to the supervisor, which says it and classifies the failure
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    args = parser.parse_args()

    ctx = phalanx.init()  # process group (NCCL on CUDA, gloo on CPU), device, rank, the job's spec and run dir
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(ctx.device)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    progress = Progress()
    state = {"train": ModelAndOptimizer(model, optimizer), "progress": progress}  # DCP Stateful objects

    policy = ctx.spec.checkpoint if ctx.spec else Checkpoint(every_steps=20)
    where = policy.dir or (str(ctx.run_dir.checkpoints) if ctx.run_dir else "checkpoints")
    checkpoints = CheckpointManager(where, policy, layout={"fsdp": ctx.world_size}, spec_hash="own-script")
    if (latest := checkpoints.latest_valid()) is not None:
        checkpoints.load(latest, state)  # DCP reshards: it loads at any world size
        print(f"rank {ctx.rank}: resumed at step {progress.step}", flush=True)

    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    per_rank = args.batch // ctx.world_size
    while progress.step < args.steps:
        g = torch.Generator().manual_seed(progress.step)  # the step's data: a function of the step alone
        x = torch.randn(args.batch, 32, generator=g)[ctx.rank * per_rank : (ctx.rank + 1) * per_rank].to(ctx.device)
        loss = F.mse_loss(model(x), torch.sin(x @ target / 4))
        loss.backward()
        checkpoints.staged()  # an async save in flight may still be copying the weights the step changes
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        # Heartbeat, and rank 0's line in metrics.jsonl; total_steps gives the progress line its ETA.
        ctx.report(progress.step - 1, loss=mean.item() / ctx.world_size, total_steps=args.steps)
        if checkpoints.due(progress.step) or progress.step == args.steps:
            checkpoints.save(progress.step, state)  # async: written, hashed and committed behind training
    checkpoints.close()  # waits for the last save to commit
    ctx.close()


if __name__ == "__main__":
    main()
