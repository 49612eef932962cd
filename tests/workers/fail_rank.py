"""Rank 1 fails: exit code 3, an exception under @record, or (report) exit 3 after reporting steps 0-6 through
the worker SDK. The other ranks wait until they are stopped."""

import os
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import phalanx


@record
def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    ctx = phalanx.init(device="cpu")
    with open(os.path.join(out, f"pid-{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    if mode == "report":
        for step in range(7):
            ctx.report(step, loss=1.0)
    dist.barrier()
    if ctx.rank == 1:
        print("rank 1 is about to fail", flush=True)
        if mode == "raise":
            raise RuntimeError("rank 1 lost its accelerator")
        sys.exit(3)
    time.sleep(600)


main()
