"""Each rank contributes rank + 1 to a gloo all-reduce; writes what it saw to OUT/rank-<r>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
keys = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "PHALANX_NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PHALANX_RUN_ID",
    "PHALANX_RUN_DIR",
    "TORCHELASTIC_RESTART_COUNT",
]
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"sum": t.item(), "env": {k: os.environ.get(k) for k in keys}}, f)
print(f"all-reduce sum {t.item()}")
dist.destroy_process_group()
