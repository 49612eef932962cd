"""A job that fails in a chosen way, reporting steps through the worker SDK:

user          rank 1 raises ValueError at start (an error in the code: not worth a retry)
crash-once    rank 1 exits 3 after step 2 of the first attempt (steps counted from 1); later attempts succeed
crash-always  rank 1 exits 3 after step 2 of every attempt
hang-once     rank 1 stops making progress after step 2 of the first attempt (blocked in `stuck`);
              the other ranks wait for it in a barrier
"""

import os
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import phalanx


def stuck() -> None:
    while True:
        time.sleep(1)


@record
def main() -> None:
    mode = sys.argv[1]
    ctx = phalanx.init(device="cpu")
    first = ctx.attempt == 0
    if mode == "user" and ctx.rank == 1:
        raise ValueError("train.lr must be positive")
    for step in range(6):
        if step == 2 and ctx.rank == 1 and (mode == "crash-always" or (mode == "crash-once" and first)):
            print(f"rank 1 exits in attempt {ctx.attempt}", flush=True)
            os._exit(3)
        if step == 2 and ctx.rank == 1 and mode == "hang-once" and first:
            stuck()
        ctx.report(step, loss=1.0)
        dist.barrier()
        time.sleep(0.05)
    print(f"attempt {ctx.attempt} done", flush=True)
    ctx.close()


main()
