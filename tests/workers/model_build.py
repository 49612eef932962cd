"""Build the recipe's llama-tiny, tied, over all ranks, both ways the trainer does (on the meta device then
materialised, as CUDA runs do; whole then sharded, as CPU runs do), in bf16, and write to OUT/rank-<r>.json
what the tests check: whether the embedding and the output projection are one parameter, the parameter
count, and the dtypes each block's attention receives in a forward pass (activations, rotary table)."""

import json
import os
import sys

import torch

import phalanx
from phalanx.spec import parse_spec
from phalanx.train.parallelize import build_mesh, build_model
from phalanx.train.recipe import model_config

out = sys.argv[1]
ctx = phalanx.init(device="cpu")
spec = parse_spec(
    f"name: t\nresources: {{procs_per_node: {ctx.world_size}}}\n"
    "train: {model: {preset: llama-tiny, tie_embeddings: true}, precision: bf16}\n"
)
cfg = model_config(spec)
mesh = build_mesh("cpu", spec.parallel)
seen = {}
for path, on_meta in (("meta", True), ("whole", False)):
    model, _ = build_model(cfg, mesh, spec.train, ctx.device, on_meta=on_meta)
    dtypes: list[list[str]] = []

    def note(_module, args, dtypes=dtypes):
        dtypes.append([str(args[0].dtype), str(args[1].dtype)])

    for block in model.layers.values():
        block.attention.register_forward_pre_hook(note)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ctx.world_size == 1):  # as the trainer on one rank
        model(torch.arange(16).view(1, 16))
    seen[path] = {
        "tied": model.output.weight is model.tok_embeddings.weight,
        "params": sum(getattr(p, "full_tensor", lambda p=p: p)().numel() for p in model.parameters()),
        "attention_inputs": dtypes,
    }
with open(os.path.join(out, f"rank-{ctx.rank}.json"), "w") as f:
    json.dump({"expected_params": cfg.num_params(), **seen}, f)
ctx.close()
