"""The CheckpointManager: sharded saves through torch.distributed.checkpoint (DCP), committed atomically.

A save becomes visible only once every rank's shards and DCP's metadata are written (DCP's save returns
on every rank after its final collective) and hashed (each rank's shards as it writes them, ``writer``),
and rank 0 has written the manifest and then the commit marker (see ``directory``). ``latest_valid()``
walks back from the newest step and skips, saying why, any checkpoint without a marker or whose files do
not match its manifest. Loading goes through DCP, which reshards: a checkpoint saved with one layout (FSDP over 4,
TP 2, ...) loads into any other.

Async saves (the default) copy the state into reused CPU buffers and write it, on a background thread whose
collectives run over a process group of their own, while training goes on; the trainer calls ``staged()``
before its optimizer changes the weights. The thread keeps the worker's priority: at nice 19 it held Python's
GIL while the scheduler kept it off the cores, and training waited for it (bench/checkpoint.py, side by side:
a save's whole cost 424 ms at nice 19 against 286 ms at nice 0). At most one save is in flight: the next one
waits for it, so a checkpoint is never overwritten or half replaced. Sync saves do the same work on the
calling thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from phalanx.checkpoint.directory import CheckpointDir
from phalanx.checkpoint.interval import FIRST_EVERY_STEPS
from phalanx.checkpoint.staging import Staging
from phalanx.checkpoint.writer import storage_writer
from phalanx.obs.events import Event
from phalanx.obs.protocol import NoRecovery
from phalanx.spec.model import Checkpoint


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str


class CheckpointManager:
    def __init__(
        self,
        root: str,
        policy: Checkpoint,
        *,
        layout: dict[str, Any],
        spec_hash: str,
        model: dict[str, Any] | None = None,
        device: torch.device = torch.device("cpu"),
        log: Callable[[str], None] = print,
        event: Callable[..., None] = lambda kind, **fields: None,
    ):
        self.dir, self.policy, self.log, self.event = CheckpointDir(root), policy, log, event
        # Recorded in each manifest: the layout that wrote it, which job (spec) and which model (for export).
        self._about = {"layout": layout, "spec_hash": spec_hash, "model": model}
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Saves run their collectives on a group of their own, so a background save never interleaves with
        # training's collectives.
        self._group = dist.new_group(backend="gloo")
        self._staging = Staging(device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="phalanx-checkpoint")
        self._staged: Future[None] | None = None
        self._pending: tuple[int, Future[None]] | None = None
        self._blocked_s = 0.0
        self.last_saved = 0  # the step of the newest save or load: an automatic interval counts from it
        self.every = policy.every_steps if policy.every_steps != "auto" else FIRST_EVERY_STEPS

    @property
    def blocked_s(self) -> float:
        """Training time the latest save has cost so far: in ``save()``, then in ``staged()``."""
        return self._blocked_s

    @property
    def writing(self) -> bool:
        """A background save is in flight: training runs beside its copy, write and hashing."""
        return self._pending is not None and not self._pending[1].done()

    def due(self, step: int) -> bool:
        """A fixed interval saves at its multiples; an automatic one (``every``) that long after the last save."""
        if self.policy.every_steps == "auto":
            return step - self.last_saved >= self.every
        return step % self.policy.every_steps == 0

    def save(self, step: int, state: dict[str, Any], *, sync: bool | None = None) -> None:
        """Save ``state`` (DCP state: Stateful objects and tensors) as the checkpoint of ``step``. Async unless
        the policy or ``sync`` says otherwise; a sync save returns once the checkpoint is committed."""
        started = time.perf_counter()
        self.last_saved = step
        busy = self._pending is not None and not self._pending[1].done()
        self.wait()  # at most one in flight
        if busy:
            waited = time.perf_counter() - started
            self.log(
                f"checkpoint of step {step} waited {waited:.2f} s for the previous save to commit "
                f"(saving takes longer than checkpoint.every_steps = {self.every} steps)"
            )
            if self.rank == 0:
                self.event(Event.CHECKPOINT_WAITED, step=step, waited_s=waited)
        flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        if sync if sync is not None else not self.policy.async_save:
            self._write(step, flat, started)  # DCP writes straight from the live state: no copy needed
            return
        after = self._staging.ready_event()
        staged: Future[dict[str, Any]] = self._thread.submit(self._staging.copy, flat, after)
        self._staged = staged
        self._pending = (step, self._thread.submit(lambda: self._write(step, staged.result(), None)))
        self._blocked_s = time.perf_counter() - started

    def staged(self) -> None:
        """Return once the save in flight no longer reads the live state: call before changing it."""
        if self._staged is not None:
            started = time.perf_counter()
            self._staged.result()
            self._staged = None
            self._blocked_s += time.perf_counter() - started

    def wait(self) -> None:
        """Finish (and commit) the save in flight, if any; raise what it raised."""
        if self._pending is not None:
            _, future = self._pending
            self._pending = self._staged = None
            future.result()

    def abandon(self, timeout_s: float) -> None:
        """After a peer died: let the save in flight end (its collectives fail without the peer; it never
        commits) and stop the writer. Its process group is left to whoever destroys the broken groups."""
        if self._pending is not None:
            _, future = self._pending
            self._pending = self._staged = None
            try:
                future.exception(timeout=timeout_s)
            except TimeoutError:
                raise NoRecovery(f"a checkpoint save still waits on the dead peer after {timeout_s:g} s") from None
        self._thread.shutdown()

    def _write(self, step: int, state: dict[str, Any], started: float | None) -> None:
        """Write ``state`` as step ``step``'s checkpoint and commit it (all ranks, on the save group)."""
        began = time.perf_counter()
        if self.rank == 0:
            self.dir.remove(step)  # leftovers of an earlier attempt at this step, never half-mixed with ours
        dist.barrier(group=self._group)
        writer, written = storage_writer(self.dir.location(step), self.dir.local)
        dcp.save(state, storage_writer=writer, process_group=self._group)
        files = self._describe_files(step, written)
        if self.rank == 0:
            size = sum(f["size"] for f in files.values())
            self.dir.commit(step, {"step": step, "world_size": self.world_size, **self._about, "files": files})
            blocked = time.perf_counter() - started if started is not None else self._blocked_s
            wrote = time.perf_counter() - began
            self.log(
                f"checkpoint step {step} committed: {size / 2**20:.1f} MiB to {self.dir.location(step)}, "
                f"training blocked {blocked * 1e3:.0f} ms, written in {wrote:.2f} s"
            )
            self.event(Event.CHECKPOINT_COMMITTED, step=step, bytes=size, blocked_s=blocked, write_s=wrote)
            self.dir.retire(self.policy.keep_last, self.policy.keep_every)
        dist.barrier(group=self._group)  # no rank moves on (or looks for the latest) before the commit is visible

    def _describe_files(self, step: int, written: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Size and checksum of every file of the step, for rank 0: each rank's shards as it wrote them
        (``writer``), any other file (DCP's .metadata) read back. (The directory was emptied before the save.)"""
        gathered: list[dict[str, Any]] | None = [{} for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather_object(written, gathered, dst=0, group=self._group)
        if gathered is None:
            return {}
        known = {name: meta for part in gathered for name, meta in part.items()}
        return {name: known.get(name) or self.dir.describe_file(step, name) for name in self.dir.files(step)}

    def latest_valid(self) -> CheckpointInfo | None:
        """The newest checkpoint that verifies; older ones are tried in turn, and each skip is said.
        Rank 0 decides and tells the others, so every rank loads the same one."""
        found: list[int | None] = [None]
        if self.rank == 0:
            found[0] = self.dir.latest_valid(
                lambda step, why: self.log(f"checkpoint {self.dir.location(step)} skipped: {why}")
            )
        dist.broadcast_object_list(found, src=0)
        return None if found[0] is None else CheckpointInfo(found[0], self.dir.location(found[0]))

    def newest_committed(self) -> int | None:
        """The newest committed checkpoint's step, read by rank 0 (no checkpoint is read) and told to the others."""
        found = [self.dir.newest_committed() if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def load(self, info: CheckpointInfo, state: dict[str, Any]) -> None:
        dcp.load(state, checkpoint_id=self.dir.location(info.step))
        self.last_saved = info.step

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._thread.shutdown()
            dist.destroy_process_group(self._group)
