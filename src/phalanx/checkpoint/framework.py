"""Checkpoints a framework writes in its own format (DeepSpeed's ZeRO files, Megatron's dist_checkpointing),
committed and verified as phalanx's own are (checkpoint/directory.py). A framework writes its files in place and
marks its newest checkpoint with a pointer (DeepSpeed's ``latest``) that rank 0 writes without waiting for the
other ranks: a kill during a save can leave the pointer on a torn checkpoint, which every restart then fails to
load. Here the framework writes into the step's directory of a ``CheckpointDir``, with no pointer of its own;
once every rank has written, the files are checksummed (each rank a share of them) and rank 0 commits the
manifest. A restart loads the newest checkpoint that verifies, skipping torn or corrupt ones.

The framework writes local files (torch.save): the root is a local path."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from phalanx.checkpoint.directory import CheckpointDir
from phalanx.obs.events import Event
from phalanx.spec.model import Checkpoint

Write = Callable[[str, str], None]  # (the root, the step's directory name): write the framework's files there
Read = Callable[[str, str], dict[str, Any]]  # (the root, the step's directory name): load them; the client state


class FrameworkCheckpoints:
    """Saves and loads through a framework's own ``write`` and ``read``, committed and verified by phalanx; every
    rank of the default group calls each method together."""

    def __init__(
        self, root: str | Path, policy: Checkpoint, about: dict[str, Any], log: Callable[[str], None] = print,
        event: Callable[..., None] = lambda kind, **fields: None,
    ):  # fmt: skip
        """``about``: what the manifest says of the checkpoints besides their files (the framework, the layout);
        ``log`` says each commit and skip, ``event`` records each commit in the run's events."""
        self.dir = CheckpointDir(root)
        if not self.dir.local:
            raise ValueError(
                f"checkpoint.dir {root}: a framework's own checkpoints are written as local files; give a local path"
            )
        self.policy, self.about, self.log, self.event = policy, about, log, event
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def name(self, step: int) -> str:
        """The step's directory name under the root: the framework's tag for it."""
        return Path(self.dir.path(step)).name

    def save(self, step: int, write: Write) -> float:
        """Write ``step``'s checkpoint with ``write`` and commit it; the seconds it took (training waits)."""
        began = time.perf_counter()
        if self.rank == 0:
            self.dir.remove(step)  # an earlier attempt's files of this step are never mixed with ours
        dist.barrier()
        Path(self.dir.path(step)).mkdir(parents=True, exist_ok=True)
        write(self.dir.root, self.name(step))
        dist.barrier()  # every rank's files are written
        names = self.dir.files(step) if self.rank == 0 else None
        shared = [names]
        dist.broadcast_object_list(shared, src=0)
        mine = {name: self.dir.describe_file(step, name) for name in shared[0][self.rank :: self.world_size]}
        described: list[dict[str, Any]] | None = [{} for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather_object(mine, described, dst=0)
        took = time.perf_counter() - began
        if described is not None:
            files = {name: meta for part in described for name, meta in part.items()}
            self.dir.commit(step, {"step": step, "world_size": self.world_size, **self.about, "files": files})
            size = sum(f["size"] for f in files.values())
            where = self.dir.path(step)
            self.log(f"checkpoint step {step} committed: {size / 2**20:.1f} MiB to {where}, written in {took:.2f} s")
            self.event(Event.CHECKPOINT_COMMITTED, step=step, bytes=size, blocked_s=took, write_s=took)
            self.dir.retire(self.policy.keep_last, self.policy.keep_every)
        dist.barrier()  # no rank goes on (or looks for the newest) before the commit is there
        return took

    def load_newest(self, read: Read) -> tuple[int, dict[str, Any]] | None:
        """Load the newest checkpoint that verifies with ``read`` (rank 0 decides, every rank loads the same one;
        each newer one that does not is said and skipped): its step and the client state ``read`` returns."""
        found: list[int | None] = [None]
        if self.rank == 0:
            found[0] = self.dir.latest_valid(lambda s, why: self.log(f"checkpoint {self.dir.path(s)} skipped: {why}"))
        dist.broadcast_object_list(found, src=0)
        step = found[0]
        if step is None:
            return None
        return step, read(self.dir.root, self.name(step))
