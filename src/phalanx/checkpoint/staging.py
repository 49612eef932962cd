"""A reusable CPU copy of the training state, so an async save can write while training goes on.

The buffers are allocated at the first save (pinned when CUDA is present, so device-to-host copies run at
full speed and without blocking) and refilled in place by every later save: no allocation, page faults or
pinning on the training path after the first. DCP's own ``async_save`` stages into fresh memory each time.
The copy itself runs on the checkpoint's background thread (on CUDA, on a stream of its own after the
training stream's work so far); the trainer waits for it only before the optimizer next changes the state.

Built on torch's state-dict copy helpers (the ones its BlockingAsyncStager uses), which understand DTensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.utils._pytree import tree_flatten


def _signature(state: dict[str, Any]) -> tuple[Any, ...]:
    leaves, spec = tree_flatten(state)
    return spec, tuple((t.shape, t.dtype) for t in leaves if isinstance(t, torch.Tensor))


class Staging:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._buffers: dict[str, Any] | None = None
        self._signature: tuple[Any, ...] | None = None

    def ready_event(self) -> torch.cuda.Event | None:
        """Mark, on the training stream, the point the copy must start after (call on the training thread)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def copy(self, state: dict[str, Any], after: torch.cuda.Event | None = None) -> dict[str, Any]:
        """``state`` with every tensor replaced by its CPU copy in the reused buffers; returns once copied."""
        signature = _signature(state)
        if self._buffers is None or signature != self._signature:
            self._buffers = _create_cpu_state_dict(state, pin_memory=self.cuda)
            self._signature = signature
        if self._stream is None:
            return _copy_state_dict(state, self._buffers)
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            staged = _copy_state_dict(state, self._buffers, non_blocking=True)
        self._stream.synchronize()
        return staged
