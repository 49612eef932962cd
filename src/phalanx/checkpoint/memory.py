"""In-memory checkpoints for in-process recovery: every few steps each rank serializes its own shard of the
training state into host memory and sends a copy to a neighbour rank, so that the state of a rank that dies
is still held by a live one and a recovery reads no storage (Gemini, SOSP '23, does this across machines).

Two snapshots are kept. A rank can finish snapshot s + 1 while a peer dies before finishing it (the ranks
step together, so never further apart than that); the recovery agrees on the newest step every survivor
holds whole (``steps()``), and the rank that dies loses at most the steps since its last snapshot.

State is the trainer's DCP-ready dict (the same objects a storage checkpoint saves). A sharded tensor is kept
as its local shard alone; on restore it becomes a shard of the rebuilt model's matching parameter again,
whose process group is new but whose layout (world size, mesh, ranks) is the same.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import MappingKey, tree_map_only, tree_map_with_path

KEEP = 2


@dataclass(frozen=True)
class LocalShard:
    """This rank's shard of a DTensor, without its (process-group bound) mesh."""

    tensor: torch.Tensor


def serialize(state: dict[str, Any]) -> torch.Tensor:
    """``state``'s values (Stateful objects or plain values) as bytes in a uint8 tensor: a copy in host memory."""
    flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    flat = tree_map_only(DTensor, lambda t: LocalShard(t.to_local().detach().cpu()), flat)
    flat = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), flat)
    buffer = io.BytesIO()
    torch.save(flat, buffer)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def restore(blob: torch.Tensor, state: dict[str, Any], model: torch.nn.Module) -> None:
    """Load a snapshot made by ``serialize`` into ``state``. A local shard becomes a shard of the parameter of
    ``model`` that its path names: the parameter's own, or its optimizer moments (laid out as the parameter)."""
    flat = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=False)
    like = get_model_state_dict(model)

    def reshard(path: tuple[Any, ...], value: Any) -> Any:
        if not isinstance(value, LocalShard):
            return value
        name = next(k.key for k in path if isinstance(k, MappingKey) and k.key in like)
        template = like[name]
        return DTensor.from_local(
            value.tensor.to(template.device),
            template.device_mesh,
            template.placements,
            shape=template.shape,
            stride=template.stride(),
            run_check=False,
        )

    for key, value in tree_map_with_path(reshard, flat).items():
        if isinstance(state[key], Stateful):
            state[key].load_state_dict(value)
        else:
            state[key] = value


class PeerMemory:
    """This rank's snapshots and its ring neighbour's, taken together by every rank of the default group."""

    def __init__(self, every_steps: int, stride: int = 1):
        """``stride``: the neighbour holding this rank's copy is ``rank + stride`` (on several nodes, the same
        local rank of the next node, so that a node's loss leaves its copies on another)."""
        self.every_steps = every_steps
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.holder, self.held_for = rank, (rank + stride) % world, (rank - stride) % world
        self.own: dict[int, torch.Tensor] = {}
        self.held: dict[int, torch.Tensor] = {}  # the neighbour ``held_for``'s snapshots, by step

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def steps(self) -> list[int]:
        """Steps this rank holds whole: its own snapshot and its neighbour's."""
        return sorted(set(self.own) & set(self.held))

    def bytes(self) -> int:
        return sum(b.numel() for b in (*self.own.values(), *self.held.values()))

    def take(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as of ``step`` and trade copies with the neighbours (a collective of all ranks)."""
        mine = serialize(state)
        theirs = self._trade(mine)
        self.own[step], self.held[step] = mine, theirs
        for kept in (self.own, self.held):
            for old in sorted(kept)[:-KEEP]:
                del kept[old]

    def clear(self) -> None:
        self.own.clear()
        self.held.clear()

    def _trade(self, mine: torch.Tensor) -> torch.Tensor:
        size, their_size = torch.tensor([mine.numel()]), torch.zeros(1, dtype=torch.int64)
        _wait(dist.P2POp(dist.isend, size, self.holder), dist.P2POp(dist.irecv, their_size, self.held_for))
        theirs = torch.empty(int(their_size.item()), dtype=torch.uint8)
        _wait(dist.P2POp(dist.isend, mine, self.holder), dist.P2POp(dist.irecv, theirs, self.held_for))
        return theirs

    def hand_over(self, step: int, to: int) -> None:
        """Send the neighbour's snapshot of ``step`` to ``to``, the process that now has its rank."""
        blob = self.held[step]
        dist.send(torch.tensor([blob.numel()]), to)
        dist.send(blob, to)

    @staticmethod
    def receive(source: int) -> torch.Tensor:
        """A snapshot ``hand_over`` sends from ``source``."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, source)
        blob = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(blob, source)
        return blob


def _wait(*ops: dist.P2POp) -> None:
    for request in dist.batch_isend_irecv(list(ops)):
        request.wait()
