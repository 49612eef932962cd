"""The worker SDK: what a training script calls to join its job. The built-in recipe uses it too.

    ctx = phalanx.init()          # process group, device, rank, the job's spec and run directory
    ...
    ctx.report(step, loss=...)    # heartbeat to the supervisor; rank 0 appends the metrics to the run dir

Run outside phalanx (no RANK in the environment), ``init()`` makes a single-process group, so the same
script also runs with plain ``python``.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.obs import EventLog, JsonlLog, RunDir, protocol
from phalanx.obs.metrics import gpu_utilisation, peak_memory_bytes
from phalanx.obs.protocol import CHAOS_LOSS_KEY, HEARTBEAT_KEY
from phalanx.spec import JobSpec, load_spec


@dataclass
class WorkerContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    attempt: int = 0
    generation: int = 0  # in-process recoveries of this attempt so far: whose process group this rank is in
    run_dir: RunDir | None = None
    spec: JobSpec | None = None
    _store: dist.Store | None = field(default=None, repr=False)
    _metrics: JsonlLog | None = field(default=None, repr=False)
    _events: EventLog | None = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def supervised(self) -> bool:
        """Run by `phalanx run`: its supervisor shows the job's progress from the metrics this rank reports."""
        return "PHALANX_RUN_ID" in os.environ

    def heartbeat(self, step: int, compute_s: float | None = None) -> None:
        """Tell the supervisor this rank made progress (its failure report names the last step reported; a
        rank that stops reporting is hung). ``compute_s``, this rank's own compute in the step, lets it find
        stragglers; the rank's peak memory and GPU utilisation go to the run's ranks.json (obs/ranks.py)."""
        if self._store is not None:
            beat = {
                "step": step,
                "ts": time.time(),
                "compute_s": compute_s,
                "peak_memory_bytes": peak_memory_bytes(self.device),  # per rank: rank 0's metrics have only its own
                "gpu_util": gpu_utilisation(self.device),
            }
            self._store.set(HEARTBEAT_KEY.format(rank=self.rank), json.dumps(beat))

    def report(self, step: int, **metrics: Any) -> None:
        """Heartbeat, and on rank 0 append ``{step, **metrics}`` to the run's metrics.jsonl."""
        self.heartbeat(step, metrics.get("compute_s"))
        if self._metrics is not None:
            self._metrics.write(step=step, **metrics)

    def checkpoint_location(self) -> str:
        """Where the recipe's checkpoints go: ``checkpoint.dir`` (a path or a URL such as s3://bucket/run), else
        the run's checkpoints/."""
        assert self.spec is not None
        if self.run_dir is None:
            if not self.spec.checkpoint.dir:
                raise ValueError("checkpoint.dir must be set in the spec when the trainer runs without a run directory")
            return self.spec.checkpoint.dir
        return self.run_dir.checkpoint_location(self.spec.checkpoint.dir)

    def requested_fault(self) -> str | None:
        """Fault injection: the loss fault ``phalanx chaos nan|spike`` asked for, if any. Rank 0 answers, once
        per request (one rank's bad loss reaches every rank through the gradient and loss reductions)."""
        if self._store is None or self.rank != 0 or not self._store.check([CHAOS_LOSS_KEY]):
            return None
        fault = self._store.get(CHAOS_LOSS_KEY).decode()
        self._store.delete_key(CHAOS_LOSS_KEY)
        return fault

    def event(self, kind: str, **fields: Any) -> None:
        """On rank 0, record an event in the run's events.jsonl beside the supervisor's (one line per append)."""
        if self._events is not None:
            self._events.emit(kind, attempt=self.attempt, **fields)

    @property
    def store(self) -> dist.Store:
        """The attempt's store, which the supervisor hosts (only under a supervisor)."""
        if self._store is None:
            raise RuntimeError("not run by phalanx: there is no supervisor's store")
        return self._store

    def rejoin(self, generation: int) -> None:
        """In-process recovery: leave every process group, join ``generation``'s with the same rank."""
        leave()
        join(self.store, generation, self.rank, self.world_size, self.device)
        self.generation = generation

    def close(self) -> None:
        """Leave the job cleanly, all ranks together (a gloo group torn down while a peer still talks can abort).
        Call it on success only: after a failure a peer may never reach the barrier; just exit."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


_stacks_file = None  # kept open for faulthandler, which writes to it from its signal handler


def _dump_stacks_on_sigusr1(path: Path) -> None:
    """SIGUSR1 appends every thread's Python stack to ``path``: the supervisor's look inside a hung rank.
    faulthandler does it from C, so it works while Python is blocked in a collective."""
    global _stacks_file
    _stacks_file = path.open("a")
    faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True)


def init(device: str | None = None) -> WorkerContext:
    """Join the job: pick the device, initialise the default process group (NCCL on CUDA, gloo on CPU).

    A warm spare of in-process recovery (PHALANX_SPARE) first waits, torch imported, until the supervisor
    gives it a failed rank's place; it then joins that recovery's process group under that rank."""
    env = os.environ
    device_type = device or env.get("PHALANX_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    store: dist.Store | None = None
    generation = 0
    if "RANK" in env or "PHALANX_SPARE" in env:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False)
    if "PHALANX_SPARE" in env:
        assert store is not None
        try:
            given = protocol.assignment(store, int(env["PHALANX_SPARE"]))
        except dist.DistNetworkError:  # the attempt's store closed: the attempt ended before a rank was lost
            print("warm spare: the attempt ended before it took a rank", flush=True)
            os._exit(0)
        env.update(given["env"])  # the rank's own variables: RANK, LOCAL_RANK, its error and stacks files
        generation = given["generation"]
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        if fraction := env.get("PHALANX_GPU_FRACTION"):  # a share of the GPU: its memory, not its neighbours'
            torch.cuda.set_per_process_memory_fraction(float(fraction), local_rank)
        dev, backend = torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if generation:
        assert store is not None
        join(store, generation, int(env["RANK"]), int(env["WORLD_SIZE"]), dev)
    elif "RANK" in env:
        dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if "PHALANX_STACKS_FILE" in env:
        _dump_stacks_on_sigusr1(Path(env["PHALANX_STACKS_FILE"]))
    run_dir = RunDir(Path(env["PHALANX_RUN_DIR"])) if "PHALANX_RUN_DIR" in env else None
    rank = dist.get_rank()
    return WorkerContext(
        rank=rank,
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        device=dev,
        attempt=int(env.get("PHALANX_ATTEMPT", "0")),
        generation=generation,
        run_dir=run_dir,
        spec=load_spec(env["PHALANX_SPEC"]) if "PHALANX_SPEC" in env else None,
        _store=store,
        _metrics=JsonlLog(run_dir.metrics) if run_dir is not None and rank == 0 else None,
        _events=EventLog(run_dir.events) if run_dir is not None and rank == 0 else None,
    )


# In-process recovery's process groups: a survivor leaves the broken one and joins the next generation's.
def leave() -> None:
    """Destroy every process group of this process (the default one, the mesh's, the checkpoint's): their
    sockets close, so a survivor still waiting in one of them fails too and joins the recovery."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _give_back_memory()


def _give_back_memory() -> None:
    """Free what the old groups, model and optimizer held and return it to the OS (glibc keeps freed memory
    in its arenas otherwise): a process that recovers many times stays its size."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def join(store: dist.Store, generation: int, rank: int, world_size: int, device: torch.device) -> None:
    """Join generation ``generation``'s process group."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    hook = sys.excepthook  # each init wraps it again to prefix "[rank<r>]"; a survivor keeps the one it has
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"phalanx/pg/{generation}", store),
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
    )
    if getattr(hook, "__name__", "") == "_distributed_excepthook":
        sys.excepthook = hook
