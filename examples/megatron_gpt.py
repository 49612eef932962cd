"""A Megatron-core job under phalanx: Megatron's GPTModel shaped as a Llama (one of phalanx's presets: RMSNorm,
SwiGLU, rotary embeddings, grouped-query attention) with tensor parallel (and data parallel over the rest of the
ranks), trained with torch's AdamW, checkpointed with Megatron's dist_checkpointing, committed and verified by
phalanx, saved on SIGTERM; `phalanx ckpt import` turns its checkpoints into the built-in recipe's.

    phalanx run examples/megatron_gpt.yaml              # 2 processes: tensor parallel 2

It is written to run on GPUs (NCCL) as it is; so far it has run on CPUs only. Megatron-core calls CUDA directly
(its RNG tracker among others): on a machine without one it needs a shim that points those calls at the CPU,
which phalanx's tests apply from their harness (tests/workers/megatron_cpu.py), never from here. Each step's
batch is a function of the step alone.
"""

import argparse
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed.elastic.multiprocessing.errors import record

import phalanx
from phalanx.integrations.megatron import step_loop
from phalanx.train.models.args import PRESETS, LlamaConfig


def llama_gpt(cfg: LlamaConfig, seq_len: int) -> GPTModel:
    """Megatron's GPTModel with the architecture of phalanx's Llama ``cfg`` (Meta's interleaved rotary pairs)."""
    config = TransformerConfig(
        num_layers=cfg.n_layers,
        hidden_size=cfg.dim,
        num_attention_heads=cfg.n_heads,
        num_query_groups=cfg.n_kv_heads,
        ffn_hidden_size=cfg.ffn_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        rotary_interleaved=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        cfg.vocab_size,
        max_sequence_length=seq_len,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=cfg.tie_embeddings,
    )


@record  # a rank's exception goes to the supervisor, which says it and classifies the failure
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (data parallel: the other ranks)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--preset", default="llama-tiny", choices=list(PRESETS))
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    ctx = phalanx.init()  # the process group (NCCL on CUDA, gloo on CPU): Megatron's groups are made on it
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the same weights at any tensor-parallel size
    cfg = PRESETS[args.preset]
    model = llama_gpt(cfg, args.seq_len).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    per_rank = args.batch // dp
    positions = torch.arange(args.seq_len, device=ctx.device).expand(per_rank, -1)
    causal = torch.ones(1, 1, args.seq_len, args.seq_len, device=ctx.device).triu(1).bool()  # True: masked out
    architecture = {"preset": args.preset, **dataclasses.asdict(cfg)}  # in the manifest: `phalanx ckpt import` reads it
    tokens, flops = args.batch * args.seq_len, cfg.flops_per_token(args.seq_len)
    loop = step_loop(ctx, model, optimizer, tokens, flops, total_steps=args.steps, model_config=architecture)
    step, _ = loop.resume()
    while step < args.steps:
        g = torch.Generator().manual_seed(step)  # the step's batch: a function of the step alone
        batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
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
