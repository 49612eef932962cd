"""A DeepSpeed ZeRO job under phalanx: a Llama-shaped model (phalanx's own, so `phalanx ckpt` reads its
checkpoints), any ZeRO stage, DeepSpeed's own checkpoints committed and verified by phalanx, a save on SIGTERM.

    phalanx run examples/deepspeed_zero.yaml        # 2 processes, ZeRO-3 (the spec's command: --zero 1, 2 or 3)

It is written to run unchanged on GPUs (NCCL, bf16) as on CPUs (gloo, fp32); so far it has run on CPUs only. A
restart resumes at the newest checkpoint that verifies, with the step's data: each step's batch is a function of
the step alone.
"""

import argparse
import dataclasses

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import phalanx
from phalanx.integrations.deepspeed import step_loop
from phalanx.train.models.args import PRESETS
from phalanx.train.models.llama import Llama


@record  # a rank's exception goes to the supervisor, which says it and classifies the failure
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--preset", default="llama-tiny", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    ctx = phalanx.init()  # the process group (NCCL on CUDA, gloo on CPU): DeepSpeed uses it as it is
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights()
    config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch // ctx.world_size,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": ctx.device.type == "cuda"},
        "steps_per_print": 10**9,  # phalanx's progress line says it
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    tokens = args.batch * args.seq_len
    architecture = {"preset": args.preset, **dataclasses.asdict(cfg)}  # in the manifest: `phalanx ckpt import` reads it
    loop = step_loop(ctx, engine, tokens, cfg.flops_per_token(args.seq_len), total_steps=args.steps, model=architecture)
    step, _ = loop.resume()
    per_rank = args.batch // ctx.world_size
    while step < args.steps:
        g = torch.Generator().manual_seed(step)  # the step's batch: a function of the step alone
        batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
        mine = batch[ctx.rank * per_rank : (ctx.rank + 1) * per_rank].to(ctx.device)
        logits = engine(mine[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loop.done(step, loss=mean.item() / ctx.world_size)
    ctx.close()


if __name__ == "__main__":
    main()
