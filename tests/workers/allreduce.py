"""Each rank contributes rank + 1 to a gloo all-reduce; writes what it saw to OUT/rank-<r>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist

from phalanx.launch.node import CONTRACT

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
keys = [*CONTRACT, "GROUP_WORLD_SIZE", "PHALANX_RUN_ID"]
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump({"sum": t.item(), "env": {k: os.environ.get(k) for k in keys}}, f)
print(f"all-reduce sum {t.item()}")
dist.destroy_process_group()
