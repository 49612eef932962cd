"""Everything a training job checkpoints, as DCP-ready state: model and optimizer through the sharded
state-dict API (so DCP can reshard them), the LR schedule, the RNG, and the progress (step = data position)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class ModelAndOptimizer(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


class Progress(Stateful):
    """The step reached; it is also the data loader's whole state."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class RNG(Stateful):
    """The CPU generator (the recipe draws no random numbers on the device: no dropout)."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
