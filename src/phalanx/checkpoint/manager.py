"""The CheckpointManager: sharded saves through torch.distributed.checkpoint (DCP), committed atomically.

    <dir>/step-00000050/   DCP's shard files and .metadata, then
                           manifest.json  (step, world layout, spec hash, every file's size and sha256)
                           COMMITTED      (renamed into place last: the checkpoint exists from then on)

A save becomes visible only after every rank's shards and DCP's metadata are written (DCP's save returns
on every rank after its final collective), the manifest is written, and the marker is renamed into place.
``latest_valid()`` walks back from the newest step and skips, saying why, any checkpoint without a marker
or whose files do not match its manifest. Loading goes through DCP, which reshards: a checkpoint saved
with one layout (FSDP over 4, TP 2, ...) loads into any other.

Async saves use DCP's ``async_save``: the state is staged to CPU memory, then written by a background
thread over a process group of its own, so training continues; at most one save is in flight and the next
waits for it, so a checkpoint is never overwritten or half-replaced.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from phalanx.spec.model import Checkpoint
from phalanx.storage import sha256_file, write_atomic

MANIFEST, COMMITTED = "manifest.json", "COMMITTED"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def saved_steps(root: Path) -> list[int]:
    """Steps that have a checkpoint directory under ``root``, committed or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        int(p.name.removeprefix("step-"))
        for p in root.glob("step-*")
        if p.is_dir() and p.name.removeprefix("step-").isdigit()
    )


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not valid, or None if it is (marker present, files match manifest)."""
    if not (path / COMMITTED).is_file():
        return "no commit marker (the save did not finish)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["size"]:
            return f"{name} is {f.stat().st_size} bytes, the manifest says {meta['size']}"
        if sha256_file(f) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


class CheckpointManager:
    def __init__(
        self,
        root: str | Path,
        policy: Checkpoint,
        layout: dict[str, Any],
        spec_hash: str,
        note: Callable[[str], None] = print,
    ):
        self.root, self.policy, self.layout, self.note = Path(root), policy, layout, note
        self.spec_hash = spec_hash  # recorded in each manifest: which job (spec) wrote the checkpoint
        self.rank = dist.get_rank()
        # Background saves run their collectives on a group of their own, beside training's.
        self._group = dist.new_group(backend="gloo") if policy.async_save else None
        self._pending: tuple[int, Future] | None = None

    def due(self, step: int) -> bool:
        return step % self.policy.every_steps == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()  # at most one in flight: the previous save commits before the next starts
        path = step_dir(self.root, step)
        if self.policy.async_save:
            response = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
            self._pending = (step, future)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._commit(step)

    def wait(self) -> None:
        """Finish (and commit) the save in flight, if any."""
        if self._pending is not None:
            step, future = self._pending
            self._pending = None
            future.result()
            self._commit(step)

    def _commit(self, step: int) -> None:
        if self.rank == 0:
            path = step_dir(self.root, step)
            files = {
                f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)}
                for f in sorted(path.iterdir())
                if f.is_file() and f.name not in (MANIFEST, COMMITTED)
            }
            manifest = {
                "step": step,
                "world_size": dist.get_world_size(),
                "layout": self.layout,
                "spec_hash": self.spec_hash,
                "files": files,
            }
            write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
            write_atomic(path / COMMITTED, hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest().encode())
            self._retire()
        dist.barrier(group=self._group)  # no rank moves on (or reads latest) before the commit is visible

    def _retire(self) -> None:
        """Delete committed checkpoints that keep_last / keep_every no longer keep; nothing else."""
        committed = sorted(s for s in saved_steps(self.root) if (step_dir(self.root, s) / COMMITTED).is_file())
        keep = set(committed[-self.policy.keep_last :])
        if self.policy.keep_every:
            keep |= {s for s in committed if s % self.policy.keep_every == 0}
        for step in committed:
            if step not in keep:
                shutil.rmtree(step_dir(self.root, step))

    def latest_valid(self) -> CheckpointInfo | None:
        """The newest checkpoint that verifies; older ones are tried in turn, and each skip is said.
        Rank 0 decides and tells the others, so every rank loads the same one."""
        found: list[int | None] = [None]
        if self.rank == 0:
            for step in reversed(saved_steps(self.root)):
                problem = verify(step_dir(self.root, step))
                if problem is None:
                    found[0] = step
                    break
                self.note(f"checkpoint {step_dir(self.root, step)} skipped: {problem}")
        dist.broadcast_object_list(found, src=0)
        return None if found[0] is None else CheckpointInfo(found[0], step_dir(self.root, found[0]))

    def load(self, info: CheckpointInfo, state: dict[str, Any]) -> None:
        dcp.load(state, checkpoint_id=str(info.path))

    def close(self) -> None:
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
