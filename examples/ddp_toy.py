"""A plain torchrun DDP script, nothing phalanx-specific: `torchrun --nproc-per-node 2 ddp_toy.py` runs it,
and so does `phalanx run` with `command: [python, examples/ddp_toy.py]`.

Trains a small MLP on a fixed synthetic regression task; rank 0 prints the loss and can save the weights.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--out", default=None, help="where rank 0 saves the final weights")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// — RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    per_rank = args.batch // world
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(args.batch, 16, generator=g)[rank * per_rank : (rank + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(model(x), torch.sin(x @ target / 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {reported.item() / world:.5f}  (local rank {os.environ['LOCAL_RANK']})")
    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    dist.barrier()  # tear down together: a gloo group destroyed while its peer still talks can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
