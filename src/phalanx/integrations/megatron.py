"""Megatron-core under phalanx (``pip install phalanx[megatron]``): a model of Megatron's (GPTModel, with tensor
parallel) trained with a torch optimizer, checkpointed with Megatron's ``dist_checkpointing`` (the model's and
the optimizer's sharded state, which it reshards across tensor-parallel sizes), committed and verified by
phalanx, saved on SIGTERM, and each step reported. A script opts in with a few lines
(examples/megatron_gpt.py, docs/frameworks.md):

    loop = phalanx.integrations.megatron.step_loop(ctx, model, optimizer, tokens_per_step=...)
    step, _ = loop.resume()
    while step < steps:
        ...; optimizer.step(); step += 1
        loop.done(step, loss=mean_loss)
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.integrations.loop import StepLoop
from phalanx.train.sdk import WorkerContext

SKIPPED = ("step",)  # AdamW's step count is one number, not a tensor shaped as its parameter: kept as common state


def step_loop(
    ctx: WorkerContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens_per_step: int,
    flops_per_token: float | None = None, total_steps: int | None = None, model_config: dict[str, Any] | None = None,
) -> StepLoop:  # fmt: skip
    """The loop of a Megatron ``model`` (one with ``sharded_state_dict()``) and its torch ``optimizer`` (Adam-like:
    its state per parameter is tensors shaped as the parameter, and a step count). ``model_config``: the
    architecture, recorded in each checkpoint's manifest (a Llama's: `phalanx ckpt import` then reads it)."""
    from megatron.core import dist_checkpointing, parallel_state

    def sharded(step: int) -> dict[str, Any]:
        """The sharded state to save, or the template to load into (the optimizer's state made first)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        model_state = model.sharded_state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:  # before the first step AdamW has no state: a template needs one
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        optim_state = optimizer.state_dict()
        optim_state_to_sharding_state(optim_state, get_param_id_to_sharded_param_map(model_state, params), SKIPPED)
        return {"model": model_state, "optimizer": optim_state, "optimizer_step": step}

    def write(root: str, name: str) -> None:
        step = int(optimizer.state[optimizer.param_groups[0]["params"][0]]["step"]) if optimizer.state else 0
        dist_checkpointing.save(sharded(step), f"{root}/{name}")

    def read(root: str, name: str) -> dict[str, Any]:
        loaded = dist_checkpointing.load(sharded(0), f"{root}/{name}")
        model.load_state_dict(loaded["model"])
        state = loaded["optimizer"]
        for entry in state["state"].values():
            entry["step"] = torch.tensor(float(loaded["optimizer_step"]))
        optimizer.load_state_dict(state)
        return {}

    tp = parallel_state.get_tensor_model_parallel_world_size()
    about = {"framework": "megatron", "tensor_parallel": tp, "model": model_config}
    return StepLoop(ctx, write, read, about, tokens_per_step, flops_per_token, total_steps)
