"""A DeepSpeed ZeRO job under phalanx: a Llama-shaped model (phalanx's own, so `phalanx ckpt` reads its
checkpoints), any ZeRO stage, DeepSpeed's own checkpoints committed and verified by phalanx, a save on SIGTERM.

    phalanx run examples/deepspeed_zero.yaml        # 2 processes, ZeRO-3 (the spec's command: --zero 1, 2 or 3)

It is written to run unchanged on GPUs (NCCL, bf16) as on CPUs (gloo, fp32); so far it has run on CPUs only. A
restart resumes at the newest checkpoint that verifies, with the step's data: each step's batch is a function of
the step alone.
"""

import argparse
import dataclasses
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import phalanx
from phalanx.integrations.deepspeed import step_loop
from phalanx.train.models.args import PRESETS, LlamaConfig
from phalanx.train.models.llama import Llama


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--preset", default="llama-tiny", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser


def engine_for(args: argparse.Namespace, world_size: int, cuda: bool) -> tuple[Any, LlamaConfig]:
    """DeepSpeed's engine of the model ``args`` name (the same initial weights on every rank), and its config."""
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights()
    config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch // world_size,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": cuda},
        "steps_per_print": 10**9,  # phalanx's progress line says it
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, cfg


def train_step(engine: Any, step: int, args: argparse.Namespace, vocab: int, rank: int, world_size: int) -> float:
    """Train on step ``step``'s batch (a function of the step alone: a restart replays none and skips none); the
    loss, as the mean over all ranks."""
    per_rank = args.batch // world_size
    batch = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(step))
    mine = batch[rank * per_rank : (rank + 1) * per_rank].to(engine.device)
    logits = engine(mine[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world_size


@record  # a rank's exception goes to the supervisor, which says it and classifies the failure
def main() -> None:
    args = arguments().parse_args()
    ctx = phalanx.init()  # the process group (NCCL on CUDA, gloo on CPU): DeepSpeed uses it as it is
    engine, cfg = engine_for(args, ctx.world_size, ctx.device.type == "cuda")
    tokens = args.batch * args.seq_len
    architecture = {"preset": args.preset, **dataclasses.asdict(cfg)}  # in the manifest: `phalanx ckpt import` reads it
    loop = step_loop(ctx, engine, tokens, cfg.flops_per_token(args.seq_len), total_steps=args.steps, model=architecture)
    step, _ = loop.resume()
    while step < args.steps:
        loss = train_step(engine, step, args, cfg.vocab_size, ctx.rank, ctx.world_size)
        step += 1
        loop.done(step, loss=loss)
    ctx.close()


if __name__ == "__main__":
    main()
