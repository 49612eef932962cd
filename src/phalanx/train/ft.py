"""Fault tolerance on the worker's side, behind the few hooks the trainer calls (as torchtitan keeps torchft
behind its components/ft.py): in-process recovery from peers' memory, the warm-up of the spares' zygote, and
the loss faults `phalanx chaos` injects. The supervisor's side is launch/recovery.py; the store keys and the
exchanges between the two are obs/protocol.py; the snapshots and their trade are checkpoint/memory.py.

A rank whose collective failed because a peer died (``recovers``) keeps its process: it waits for the
supervisor's ``decision`` (a warm spare in the dead rank's place, a new generation of the process group),
and the trainer rebuilds on the new group; then every rank, the spare too, ``restore``s the newest snapshot
that every survivor holds whole."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.checkpoint.memory import PeerMemory, restore, serialize
from phalanx.obs import protocol
from phalanx.obs.events import Event
from phalanx.obs.metrics import resident_bytes
from phalanx.obs.protocol import PeerLost, peer_lost
from phalanx.spec import JobSpec
from phalanx.spec.parallel import Parallel
from phalanx.train.models.args import PRESETS
from phalanx.train.parallelize import build_mesh, build_model
from phalanx.train.recipe import model_config
from phalanx.train.sdk import WorkerContext
from phalanx.train.state import RNG

POISON = {"nan": float("nan"), "spike": 10.0}  # what `phalanx chaos` multiplies one rank's loss by
WATCH_S = 0.5  # how often a rank of a job of several nodes looks whether a recovery was decided


def loss_fault(ctx: WorkerContext, pipelined: bool) -> tuple[float, float]:
    """The loss fault `phalanx chaos nan|spike` asked for, as (the factor of this rank's loss, what to add to
    the step's reported loss, as a share of it): 1 and 0 but under chaos. Without a pipeline it poisons rank
    0's loss, and through its gradients the step's. With one, rank 0 may compute no loss (the last stage
    does): it scales the step's loss as reported, which the loss guard judges."""
    fault = POISON.get(ctx.requested_fault() or "", 1.0)
    return (fault, 0.0) if not pipelined else (1.0, fault - 1.0)


class Storage(Protocol):
    """What a recovery needs of the storage checkpoints: the newest valid step (the same on every rank), and
    loading it into the training state."""

    def newest(self) -> int | None: ...

    def load(self, step: int) -> int: ...


class InProcess:
    """This rank's part of in-process recovery: its snapshots in memory and a neighbour's, and the exchange
    with the supervisor and the other ranks when a peer dies."""

    def __init__(self, ctx: WorkerContext):
        assert ctx.spec is not None
        self.ctx, self.timeout_s = ctx, ctx.spec.resilience.recovery_timeout_s
        recovering = lambda: protocol.recovering(ctx.store, ctx.generation + 1)  # noqa: E731
        # On several nodes a rank's copy goes to the same local rank of the next node: a lost node's shards
        # are all held on others.
        stride = ctx.spec.resources.procs_per_node if ctx.spec.resources.nodes > 1 else 1
        self.memory = PeerMemory(ctx.spec.resilience.memory_every_steps, recovering, stride)
        self._lock = threading.Lock()
        self._rebuilding = False  # between leaving the broken group and joining the next
        if ctx.spec.resources.nodes > 1:  # a frozen node's ranks close nothing: see _cut_when_recovering
            threading.Thread(target=self._cut_when_recovering, name="recovery-watch", daemon=True).start()

    def _cut_when_recovering(self) -> None:
        """A node that froze (or vanished without a reset) closes none of its connections, and gloo cannot
        abort a collective: a survivor waiting on one of its ranks would wait for ever. Once the supervisor has
        decided a recovery this rank has not begun, shut down this process's connections to its peers (all but
        the store's): whatever collective it waits in then fails as if the peer had died, and it recovers."""
        port = int(os.environ.get("MASTER_PORT", "0"))
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                if not self._rebuilding and protocol.recovering(self.ctx.store, self.ctx.generation + 1):
                    _shut_connections(keep_port=port)

    @contextlib.contextmanager
    def rebuilding(self):
        """While the trainer leaves the broken group and joins the next: the watcher leaves it alone."""
        with self._lock:
            self._rebuilding = True
        try:
            yield
        finally:
            with self._lock:
                self._rebuilding = False

    def snapshot(self, step: int, state: dict[str, Any], first: bool = False) -> float:
        """Take a snapshot at ``step`` if one is due; ``first`` (as training begins): only if none is held yet, so
        that a rank lost before the first due one is recovered too (a spare that took a rank holds the restored
        one: a trade it alone entered would wait on ranks that are not taking one). The seconds it blocked
        training."""
        if self.memory.steps() if first else not self.memory.due(step):
            return 0.0
        began = time.perf_counter()
        self.memory.take(step, state)
        return time.perf_counter() - began

    def recovers(self, error: BaseException) -> bool:
        """Whether ``error`` is a peer lost in a collective, which in-process recovery may handle."""
        if not peer_lost(error):
            return False
        if isinstance(error, PeerLost):  # said in this rank's log: the process keeps the trade (memory.py)
            print(f"rank {self.ctx.rank}: {error}", flush=True)
        return True

    def decision(self, error: BaseException) -> dict[str, Any]:
        """The supervisor's recovery of the next generation ({ranks, reached}); NoRecovery (the worker exits and
        the job restarts from its checkpoint) when it does not recover in process."""
        try:
            decided = protocol.decision(self.ctx.store, self.ctx.generation + 1, self.timeout_s)
        except protocol.NoRecovery as e:
            raise protocol.NoRecovery(f"{e}, after: {error}") from error
        if self.ctx.rank in decided["ranks"]:  # this rank's node is replaced whole: a spare has its rank now
            raise protocol.NoRecovery(f"rank {self.ctx.rank}'s node was replaced by a spare node's warm spares")
        return decided

    def joining(self) -> dict[str, Any]:
        """A warm spare that took a failed rank's place: the decision that gave it the rank."""
        return protocol.decision(self.ctx.store, self.ctx.generation, self.timeout_s)

    def restore(
        self, state: dict[str, Any], joiners: list[int], reached: int, storage: Storage, began: float | None = None
    ) -> int:
        """Every rank of the new group: agree on the newest snapshot all survivors hold, hand each joiner its
        rank's copy, load it into ``state``, and give each joiner the copy it holds for its neighbour. Where no
        snapshot will do (a joiner's copy was held on a lost node too, or the storage checkpoint is newer), every
        rank loads the storage checkpoint instead (``storage``), in process all the same. The step restored."""
        ctx, memory = self.ctx, self.memory
        began = time.perf_counter() if began is None else began
        mine = memory.steps() if ctx.rank not in joiners else []
        held = protocol.agree(ctx.store, ctx.generation, ctx.rank, joiners, mine, self.timeout_s)
        if any(memory.holder_of(j) in joiners for j in joiners):
            held = None  # a lost rank's copy was lost with it
        saved = storage.newest()  # the same on every rank (rank 0's, broadcast)
        if held is None or (saved is not None and saved > held):
            if saved is None:
                raise protocol.NoRecovery("no snapshot in memory will do, and there is no checkpoint in storage")
            step, source = storage.load(saved), "storage"
            memory.forget()
            memory.take(step, state)  # the ring, whole again
        else:
            step, source = held, "memory"
            if ctx.rank in joiners:
                blob = memory.receive(memory.holder)
            else:
                if memory.held_for in joiners:
                    memory.hand_over(step, memory.held_for)
                blob = memory.own[step]
            restore(blob, state)
            memory.after_recovery(step, joiners, blob)
        ctx.store.set(protocol.done_key(ctx.generation, ctx.rank), "1")
        took = time.perf_counter() - began
        if ctx.is_main:
            who = f"rank {joiners[0]}" if len(joiners) == 1 else f"ranks {', '.join(map(str, joiners))}"
            where = "memory" if source == "memory" else "the storage checkpoint"
            print(
                f"recovered in process: {who} replaced by warm spares, state of step {step} restored from {where} "
                f"in {took:.2f} s (generation {ctx.generation})",
                flush=True,
            )
        ctx.event(
            Event.RECOVERED_IN_PROCESS,
            generation=ctx.generation,
            ranks=joiners,
            source=source,
            step=step,
            lost_steps=max(0, reached - step),
            took_s=took,
            memory_bytes=memory.bytes(),  # the snapshots this rank holds: its own and its neighbour's
            resident_bytes=resident_bytes(),  # with process_groups: what must stay flat over many recoveries
            process_groups=len(dist.distributed_c10d._world.pg_map),
        )
        return step


def _shut_connections(keep_port: int) -> None:
    """Shut down every TCP connection of this process but those to ``keep_port`` (the store's)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket
        try:
            tcp = sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
            if tcp and sock.getpeername()[1] != keep_port:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or closed meanwhile
        finally:
            sock.detach()  # the descriptor stays its owner's


def warm_up(spec: JobSpec) -> None:
    """The zygote of warm spares, before it forks them (train/main.py): run the recipe's code paths once (mesh, FSDP, a
    step of AdamW, a memory snapshot and its restore) on a miniature of the model, in a process group of its own.
    Taking a failed rank's place then costs the model's build without the first calls' overhead (lazy imports and
    initialisation, dispatch caches: about a second on a CPU), which the survivors would wait for."""
    assert spec.train is not None
    hook = sys.excepthook  # init_process_group prefixes it with this group's rank ("[rank0]"): not the spare's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        alone = Parallel(pp=1, dp_replicate=1, dp_shard=1, tp=1)
        cfg = dataclasses.replace(PRESETS["llama-tiny"], tie_embeddings=model_config(spec).tie_embeddings)
        model, _ = build_model(cfg, build_mesh("cpu", alone), spec.train, torch.device("cpu"), on_meta=False)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        tokens = torch.zeros(1, 9, dtype=torch.long)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        state = {"model": model, "optimizer": optimizer, "rng": RNG()}
        restore(serialize(state), state)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
