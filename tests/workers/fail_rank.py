"""Rank 1 fails (exit code 3, or an exception under @record); the others wait forever until stopped."""

import os
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(out, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    if rank == 1:
        print("rank 1 is about to fail", flush=True)
        if mode == "exit":
            sys.exit(3)
        raise RuntimeError("rank 1 lost its accelerator")
    time.sleep(600)


main()
