"""Apply the spec's parallelism to a model: device mesh, tensor parallel, activation checkpointing,
torch.compile, the pipeline split, FSDP2 / HSDP: in that order, the order torchtitan established (TP before
FSDP so that FSDP shards DTensors over the data-parallel dims; checkpoint and compile per block, inside the
FSDP units; FSDP per pipeline stage, each stage its own root).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from phalanx.spec.model import Train
from phalanx.spec.parallel import Parallel
from phalanx.train import pipeline
from phalanx.train.models.args import LlamaConfig
from phalanx.train.models.llama import Llama

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # torchtitan's order: pp outermost, tp innermost


@dataclass(frozen=True)
class Mesh:
    """The device mesh and where this rank sits in it."""

    mesh: DeviceMesh
    parallel: Parallel

    @property
    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas: which slice of the global batch it reads."""
        return (
            self.mesh["dp_replicate"].get_local_rank() * self.parallel.dp_shard + self.mesh["dp_shard"].get_local_rank()
        )


def build_mesh(device_type: str, parallel: Parallel) -> Mesh:
    shape = (parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.tp)
    return Mesh(init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS), parallel)


def build_model(
    cfg: LlamaConfig, mesh: Mesh, train: Train, device: torch.device, on_meta: bool, weights: bool = True
) -> tuple[Llama, list[Llama]]:
    """The parallelized model with its initial weights, the same for every seed-identical rank, and the
    pipeline stages this rank runs. Without a pipeline the one stage is the model; with one, the model keeps
    only the modules of this rank's stages (its state dict is the whole model's, restricted) and each stage
    is a model made of some of them.

    ``on_meta``: build on the meta device, parallelize, then materialise only this rank's shards, so that an
    8B or 70B model never exists whole on one device; on CUDA, DTensor's RNG tracker makes the sharded init
    equal to the whole-model init (but a pipeline stage's init draws its own numbers). Off (CPU, where
    DTensor random ops lack that support): build whole on the device, then shard: every layout starts from
    the same weights. ``weights`` off: the shards are left uninitialised (the state is about to be loaded
    into them: an in-process recovery), which skips the init's cost.
    """
    if on_meta or not weights:
        with torch.device("meta"):
            model = Llama(cfg)
            stages = parallelize(model, mesh, train)
        for stage in stages:  # through the FSDP roots, which must see their parameters replaced
            stage.to_empty(device=device)
        model.tie_weights()  # to_empty gives every module a tensor of its own, which unties unsharded weights
        model.init_buffers(device)  # a pipeline rank's model is no stage: its own buffer is still on meta
        if weights:
            torch.manual_seed(train.seed)
            model.init_weights()
    else:
        model = Llama(cfg).to(device)
        torch.manual_seed(train.seed)  # right before the init that counts, so both paths draw the same numbers
        model.init_weights()
        stages = parallelize(model, mesh, train)
    for stage in stages:
        stage.rope = model.rope  # a stage's own reference, made before the buffer was materialised
    return model, stages


def parallelize(model: Llama, mesh: Mesh, train: Train) -> list[Llama]:
    """Parallelize ``model`` in place; the pipeline stages this rank runs (``[model]`` without a pipeline)."""
    p = mesh.parallel
    if p.tp > 1:
        _apply_tp(model, mesh.mesh["tp"])
        model.tie_weights()  # TP gave each module a DTensor of its own; both are the matrix sharded by vocabulary
    if train.activation_checkpoint != "off":
        _apply_activation_checkpointing(model, selective=train.activation_checkpoint == "selective")
    if train.compile:
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block))
    stages = pipeline.split(model, p, mesh.mesh["pp"].get_local_rank()) if p.pp > 1 else [model]
    if p.dp > 1:
        for stage in stages:
            _apply_fsdp(stage, mesh, bf16=train.precision == "bf16")
    return stages


def _apply_tp(model: Llama, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallel: activations between blocks are sharded on the sequence dim."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


_SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and attention outputs (expensive to recompute), recompute the cheap pointwise ops."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _apply_activation_checkpointing(model: Llama, selective: bool) -> None:
    context = partial(create_selective_checkpoint_contexts, _selective_policy) if selective else None
    wrap = partial(checkpoint_wrapper, context_fn=context) if context else checkpoint_wrapper
    for name, block in model.layers.named_children():
        model.layers.register_module(name, wrap(block, preserve_rng_state=False))


def _apply_fsdp(model: Llama, mesh: Mesh, bf16: bool) -> None:
    """FSDP2 per block and at the root; with dp_replicate > 1 the 2-D mesh makes it HSDP.

    Blocks do not cast their forward inputs: one of them is the rotary table, which must stay fp32 (in bf16
    the angles of late positions lose most of their precision), and the activations need no cast, since
    they come out of the embedding, whose parameters are already in the compute dtype. The root casts its
    own inputs, token ids, which a cast leaves alone.
    """
    dp_mesh = mesh.mesh["dp_replicate", "dp_shard"] if mesh.parallel.dp_replicate > 1 else mesh.mesh["dp_shard"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=replace(mp, cast_forward_inputs=False))
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
