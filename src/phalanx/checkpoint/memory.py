"""In-memory checkpoints for in-process recovery: every few steps each rank serializes its own shard of the
training state into host memory and sends a copy to a neighbour rank, so that the state of a rank that dies
is still held by a live one and a recovery reads no storage (Gemini, SOSP '23, does this across machines).

Both the copy into host memory and the trade run in the background, beside the next step: training waits
only before its optimizer changes what is being copied (``copied()``), and the trade has a process group of
its own. A snapshot counts once its trade is done. Two snapshots are kept. A rank can finish snapshot s + 1
while a peer dies before finishing it (the ranks step together, so never further apart than that); the
recovery agrees on the newest step every survivor holds whole (``steps()``), and the rank that dies loses at
most the steps since its last snapshot.

State is a dict of Stateful objects: the model and its optimizer themselves (their native state dicts, which
neither gather nor reshard: the layout, world size and ranks are the same after a recovery), the LR schedule,
the RNG, the progress. A sharded tensor is kept as its local shard alone; on restore it becomes a shard of the
rebuilt model's matching parameter again, whose process group is new.
"""

from __future__ import annotations

import datetime
import math
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import MappingKey, tree_map_only, tree_map_with_path

from phalanx.obs.protocol import PeerLost, peer_lost

KEEP = 2
ALIGN = 64  # bytes: every tensor of a snapshot starts at a multiple, so it can be viewed as its dtype
WAIT_SLICE = datetime.timedelta(seconds=0.2)  # a trade looks this often whether a recovery has begun


# Trades given up on or broken, with their process groups. Gloo may never finish a transfer whose peer was
# killed in the middle of it, and a group's destructor waits for its transfers: were it collected (at any garbage
# collection after the recovery), the process would hang there; one whose connections broke mid-transfer, torn
# down at the interpreter's exit, aborted the process. They are kept for the life of the process instead, which
# then ends without destroying them (``abandoned()``).
_ABANDONED: list[tuple[dist.Work, Any]] = []


def abandoned() -> bool:
    """Whether this process holds a trade it gave up on (or one that broke): it must end with ``os._exit``,
    skipping destructors."""
    return bool(_ABANDONED)


@dataclass(frozen=True)
class LocalShard:
    """This rank's shard of a DTensor, without its (process-group bound) mesh."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class _Stored:
    """Where a tensor's bytes lie in a snapshot."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: bool  # a DTensor's local shard

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, blob: torch.Tensor) -> torch.Tensor:
        return blob[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def serialize(state: dict[str, Any]) -> torch.Tensor:
    """``state``'s values (Stateful objects or plain values) as bytes in a uint8 tensor, a copy in host memory:
    every tensor's bytes one after another (each copied once, aligned so it can be viewed in place), then the
    rest of the state, pickled with the tensors' places, then that pickle's length."""
    return _pack(_state_dicts(state))


def _state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """What ``state`` is now: its objects' state dicts, which hold its very tensors (no copy yet)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _pack(flat: dict[str, Any]) -> torch.Tensor:
    tensors: list[tuple[_Stored, torch.Tensor]] = []
    end = 0

    def place(t: torch.Tensor) -> _Stored:
        nonlocal end
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        stored = _Stored(end, local.dtype, tuple(local.shape), isinstance(t, DTensor))
        tensors.append((stored, local))
        end += -(-stored.nbytes // ALIGN) * ALIGN
        return stored

    skeleton = pickle.dumps(tree_map_only(torch.Tensor, place, flat))
    blob = torch.empty(end + len(skeleton) + 8, dtype=torch.uint8)
    for stored, tensor in tensors:
        stored.view(blob).copy_(tensor)
    blob[end:-8] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    blob[-8:] = torch.tensor([len(skeleton)], dtype=torch.int64).view(torch.uint8)
    return blob


def restore(blob: torch.Tensor, state: dict[str, Any]) -> None:
    """Load a snapshot made by ``serialize`` into ``state``, whose ``model`` and ``optimizer`` entries are the
    rebuilt module and optimizer (native state dicts: loading them runs no collective). A local shard becomes
    a shard of the parameter its path names: by name for the model, by index for optimizer moments (laid out
    as their parameter). Tensors are copied out of ``blob``, which stays a snapshot."""
    length = int(blob[-8:].clone().view(torch.int64))
    skeleton = pickle.loads(blob[-8 - length : -8].numpy().tobytes())
    flat = tree_map_only(
        _Stored, lambda s: LocalShard(s.view(blob).clone()) if s.shard else s.view(blob).clone(), skeleton
    )
    named = state["model"].state_dict()
    params = [p for group in state["optimizer"].param_groups for p in group["params"]]

    def reshard(path: tuple[Any, ...], value: Any) -> Any:
        if not isinstance(value, LocalShard):
            return value
        keys = [k.key for k in path if isinstance(k, MappingKey)]
        template = named[keys[1]] if keys[0] == "model" else params[keys[2]]  # optimizer/state/<index>/<moment>
        return DTensor.from_local(
            value.tensor.to(template.device),
            template.device_mesh,
            template.placements,
            shape=template.shape,
            stride=template.stride(),
            run_check=False,
        )

    for key, value in tree_map_with_path(reshard, flat).items():
        state[key].load_state_dict(value)


def _keep_newest(snapshots: dict[int, torch.Tensor]) -> None:
    for old in sorted(snapshots)[:-KEEP]:
        del snapshots[old]


class PeerMemory:
    """This rank's snapshots and its ring neighbour's, taken together by every rank of the default group."""

    def __init__(self, every_steps: int, interrupted: Callable[[], bool], stride: int = 1):
        """``interrupted``: whether a recovery has begun. ``stride``: the neighbour holding this rank's copy is
        ``rank + stride`` (on several nodes, the same local rank of the next node, so that a node's loss
        leaves its copies on another)."""
        self.every_steps, self.interrupted, self.stride = every_steps, interrupted, stride
        self.own: dict[int, torch.Tensor] = {}
        self.held: dict[int, torch.Tensor] = {}  # the neighbour ``held_for``'s snapshots, by step
        self._copied: Future[None] | None = None  # the snapshot in flight has read the state
        self._trade_done: Future[None] | None = None
        self._group: dist.ProcessGroup | None = None
        self.bind()

    def bind(self) -> None:
        """Take this process's places in the default group, and make the trades' own group on it: every rank
        calls this after the group is (re)made, at the same point among the groups it makes."""
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.holder, self.held_for = rank, (rank + self.stride) % world, (rank - self.stride) % world
        self._group = dist.new_group(backend="gloo")

    def holder_of(self, rank: int) -> int:
        """The rank that holds ``rank``'s copy."""
        return (rank + self.stride) % dist.get_world_size()

    def forget(self) -> None:
        """Drop every snapshot (the state came from elsewhere: the ring is made again by the next one)."""
        self.settle()
        self.own, self.held = {}, {}

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def steps(self) -> list[int]:
        """Steps this rank holds whole: its own snapshot and its neighbour's, traded (the trade in flight
        settled first: done, or given up on once a recovery began)."""
        self.settle()
        return sorted(set(self.own) & set(self.held))

    def bytes(self) -> int:
        return sum(b.numel() for b in (*self.own.values(), *self.held.values()))

    def take(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as of ``step`` and trade copies with the neighbours (a collective of all ranks, on
        the trades' group), both in the background: nothing may change the state before ``copied()``. The
        previous snapshot is settled first."""
        self.settle()
        flat = _state_dicts(state)
        self._copied, self._trade_done = copied, done = Future(), Future()

        def work() -> None:  # a daemon: a process that fails is not held at its exit by a trade
            try:
                mine = _pack(flat)
                copied.set_result(None)
                self.own[step] = mine
                _keep_newest(self.own)
                self.held[step] = self._trade(mine)
                _keep_newest(self.held)
                done.set_result(None)
            except BaseException as e:
                for future in (copied, done):
                    if not future.done():
                        future.set_exception(e)

        threading.Thread(target=work, name="phalanx-memory-snapshot", daemon=True).start()

    def copied(self) -> float:
        """Wait until the snapshot in flight has copied the state, which may then change; the seconds waited."""
        began = time.perf_counter()
        if self._copied is not None:
            self._copied.result()
        return time.perf_counter() - began

    def settle(self) -> None:
        """Wait for the trade in flight. One a dead peer broke (or given up on: a recovery began) leaves its
        step not whole; any other error is raised."""
        done, self._trade_done, self._copied = self._trade_done, None, None
        if done is None:
            return
        try:
            done.result()
        except RuntimeError as e:
            if not peer_lost(e):
                raise

    def after_recovery(self, step: int, joiners: list[int], restored: torch.Tensor) -> None:
        """Make the ring whole again at ``step`` without a new snapshot: each joiner's copy is already with its
        holder (it was handed over from there), and each joiner gets the copy it must hold from its neighbour
        (a survivor: with the holders a node away, a lost node's ranks hold none of each other's)."""
        if self.rank in joiners:
            self.own, self.held = {step: restored}, {step: self.receive(self.held_for)}
            return
        self.own, self.held = {step: self.own[step]}, {step: self.held[step]}
        if self.holder in joiners:
            self._send(self.own[step], self.holder)

    def close(self) -> None:
        """The last trade settled and the trades' group destroyed, while the default group lives: one left to
        the interpreter's exit is torn down in an order that can abort the process."""
        self.settle()
        if self._group is not None and not any(group is self._group for _, group in _ABANDONED):
            dist.destroy_process_group(self._group)  # (None would be the default group)
        self._group = None

    def _trade(self, mine: torch.Tensor) -> torch.Tensor:
        """Send ``mine`` to the holder and receive the neighbour's: all-to-all collectives (sizes, then the bytes)
        in which every other pair trades nothing."""
        world = dist.get_world_size(self._group)
        sizes, their_sizes = torch.zeros(world, dtype=torch.int64), torch.empty(world, dtype=torch.int64)
        sizes[self.holder] = mine.numel()
        self._wait(dist.all_to_all_single(their_sizes, sizes, group=self._group, async_op=True))
        theirs = torch.empty(int(their_sizes[self.held_for]), dtype=torch.uint8)
        send, receive = [0] * world, [0] * world
        send[self.holder], receive[self.held_for] = mine.numel(), theirs.numel()
        self._wait(dist.all_to_all_single(theirs, mine, receive, send, group=self._group, async_op=True))
        return theirs

    def _wait(self, work: dist.Work) -> None:
        """Wait in slices: a peer killed in the middle of a trade can leave it waiting for ever; once a recovery
        has begun, give it up."""
        while True:
            try:
                work.wait(timeout=WAIT_SLICE)
                return
            except RuntimeError as e:
                if "timed out" not in str(e):
                    _ABANDONED.append((work, self._group))
                    raise
            if self.interrupted():
                _ABANDONED.append((work, self._group))
                raise PeerLost("a peer died during a memory snapshot's trade (a recovery has begun)")

    def hand_over(self, step: int, to: int) -> None:
        """Send the neighbour's snapshot of ``step`` to ``to``, the process that now has its rank."""
        self._send(self.held[step], to)

    @staticmethod
    def _send(blob: torch.Tensor, to: int) -> None:
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
