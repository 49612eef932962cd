"""Build the recipe's llama-tiny with 4 blocks in 2 pipeline stages over 2 ranks, both ways the trainer does
(on the meta device then materialised, as CUDA runs do; whole then split, as CPU runs do), and write to
OUT/rank-<r>.json what the tests check: the names in each rank's state dict, whether anything is left on
the meta device, and whether every stage's rotary table is the model's."""

import json
import os
import sys

import torch

import phalanx
from phalanx.spec import parse_spec
from phalanx.train.models.llama import rope_tables
from phalanx.train.parallelize import build_mesh, build_model
from phalanx.train.recipe import model_config

out = sys.argv[1]
ctx = phalanx.init(device="cpu")
spec = parse_spec(
    f"name: t\nresources: {{procs_per_node: {ctx.world_size}}}\n"
    "train: {model: {preset: llama-tiny, n_layers: 4}, parallel: {pp: 2}, global_batch: 4, micro_batch: 2}\n"
)
cfg = model_config(spec)
mesh = build_mesh("cpu", spec.parallel)
rope = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
seen = {}
for path, on_meta in (("meta", True), ("whole", False)):
    model, stages = build_model(cfg, mesh, spec.train, ctx.device, on_meta=on_meta)
    tensors = [*model.state_dict().values(), model.rope, *(s.rope for s in stages)]
    seen[path] = {
        "names": sorted(model.state_dict()),
        "on_meta": any(t.is_meta for t in tensors),
        "rope": all(torch.equal(s.rope, rope) for s in stages),
    }
with open(os.path.join(out, f"rank-{ctx.rank}.json"), "w") as f:
    json.dump(seen, f)
ctx.close()
