"""A Megatron-core job under phalanx: Megatron's GPTModel with tensor parallel (and data parallel over the rest of
the ranks), trained with torch's AdamW, checkpointed with Megatron's dist_checkpointing, committed and verified by
phalanx, saved on SIGTERM.

    phalanx run examples/megatron_gpt.yaml              # 2 processes: tensor parallel 2

It runs on GPUs (NCCL) as it is. Megatron-core calls CUDA directly (its RNG tracker among others): on a machine
without one it needs a shim that points those calls at the CPU, which phalanx's tests apply from their harness
(tests/workers/megatron_cpu.py), never from here. Each step's batch is a function of the step alone.
"""

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed.elastic.multiprocessing.errors import record

import phalanx
from phalanx.integrations.megatron import step_loop


@record  # a rank's exception goes to the supervisor, which says it and classifies the failure
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (data parallel: the other ranks)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    ctx = phalanx.init()  # the process group (NCCL on CUDA, gloo on CPU): Megatron's groups are made on it
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the same weights at any tensor-parallel size
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), args.vocab, max_sequence_length=args.seq_len).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    per_rank = args.batch // dp
    positions = torch.arange(args.seq_len, device=ctx.device).expand(per_rank, -1)
    causal = torch.ones(1, 1, args.seq_len, args.seq_len, device=ctx.device).triu(1).bool()  # True: masked out
    flops = 6 * sum(p.numel() for p in model.parameters()) * args.tp  # per token, forward and backward
    loop = step_loop(ctx, model, optimizer, args.batch * args.seq_len, flops, total_steps=args.steps)
    step, _ = loop.resume()
    while step < args.steps:
        g = torch.Generator().manual_seed(step)  # the step's batch: a function of the step alone
        batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(ctx.device)
        loss = model(mine[:, :-1], positions, causal, labels=mine[:, 1:]).float().mean()
        loss.backward()
        for p in model.parameters():  # data parallel: the mean gradient over the data-parallel ranks
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        loop.done(step, loss=mean.item() / dp)
    ctx.close()


if __name__ == "__main__":
    main()
