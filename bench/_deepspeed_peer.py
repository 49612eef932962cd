"""The DeepSpeed launcher's side of bench/frameworks.py: examples/deepspeed_zero.py's training (its model, data
and steps, imported from it) as a DeepSpeed user runs it without phalanx: under ``deepspeed``, with
``deepspeed.init_distributed``, DeepSpeed's own checkpoints (and their ``latest`` pointer) every BENCH_EVERY
steps, resumed from ``latest`` at start. Rank 0 appends each step's record to BENCH_WORK/steps.jsonl; each rank
writes its pid to BENCH_WORK/pid-<rank>."""

import json
import os
import runpy
import sys
import time
from pathlib import Path

import deepspeed
import torch.distributed as dist

example = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "deepspeed_zero.py"))
work, every = Path(os.environ["BENCH_WORK"]), int(os.environ["BENCH_EVERY"])
args, _ = example["arguments"]().parse_known_args(sys.argv[1:])  # the launcher adds --local_rank
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
(work / f"pid-{rank}").write_text(str(os.getpid()))
engine, cfg = example["engine_for"](args, world, cuda=False)
path, client = engine.load_checkpoint(str(work / "ckpt"))  # the tag `latest` names, if there is one
step = client["step"] if path is not None else 0
while step < args.steps:
    loss = example["train_step"](engine, step, args, cfg.vocab_size, rank, world)
    if rank == 0:
        with (work / "steps.jsonl").open("a") as steps:
            steps.write(json.dumps({"step": step, "ts": time.time(), "loss": loss}) + "\n")
    step += 1
    if step % every == 0 or step == args.steps:
        engine.save_checkpoint(str(work / "ckpt"), client_state={"step": step})
