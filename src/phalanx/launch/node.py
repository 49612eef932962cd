"""One attempt's plan, and what it means for the workers of one node: their ranks and torchrun environment.

Every backend (`phalanx run`, `--local-nodes`, Slurm, Kubernetes) starts its workers here, so every worker
sees the same environment, ``CONTRACT`` at least; tests/test_clusters.py checks it on each backend that runs
here.

Ranks are node-major: the node at group rank g runs global ranks g x procs ... g x procs + procs - 1, so that
the innermost mesh dimension (FSDP's shard group, TP) stays within a node and replication spans nodes.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from phalanx.launch.workers import Worker
from phalanx.obs.rundir import RunDir
from phalanx.spec import JobSpec, dump_spec


class LaunchError(RuntimeError):
    """The job cannot start as specified (not a failure of the job itself)."""


# What a worker can count on, whatever started it: its rank, the world size, its node, how many times the job
# restarted, its run directory and where its checkpoints go (docs/clusters.md).
CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "PHALANX_NODE_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "PHALANX_RUN_DIR",
    "PHALANX_CHECKPOINT_DIR",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass(frozen=True)
class Plan:
    """What every node runs in one attempt; node 0 publishes it and every agent reads the same."""

    attempt: int
    members: tuple[int, ...]  # node ranks of the agents that run workers, in group-rank order
    procs: int  # worker processes per node
    master_addr: str  # the attempt's worker store (TORCHELASTIC_USE_AGENT_STORE), hosted by node 0
    master_port: int
    spec_path: str  # the spec this attempt runs (a resized copy after a shrink), in the shared run directory
    device: str
    max_restarts: int
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES after a one-node shrink: the slots left

    @property
    def world_size(self) -> int:
        return len(self.members) * self.procs

    def group_rank(self, node: int) -> int:
        return self.members.index(node)

    def node_of(self, rank: int) -> int:
        """The node rank of the agent that runs global ``rank``."""
        return self.members[rank // self.procs]

    def ranks(self, node: int) -> range:
        first = self.group_rank(node) * self.procs
        return range(first, first + self.procs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(**{**data, "members": tuple(data["members"])})


RECIPE = "phalanx.train.main"  # the built-in recipe's worker module


def worker_argv(spec: JobSpec) -> list[str]:
    """What each worker runs; ``python`` in a command means this interpreter, as a venv user expects."""
    if spec.command is None:
        return [sys.executable, "-m", RECIPE]
    head, *rest = spec.command
    return [sys.executable, *rest] if head in ("python", "python3") else list(spec.command)


def node_workers(plan: Plan, node: int, spec: JobSpec, run_dir: RunDir) -> list[Worker]:
    """The workers ``node`` runs in ``plan``, each with the torchrun environment of its rank."""
    base = node_env(plan, node, spec, run_dir)
    workers = []
    for local_rank, rank in enumerate(plan.ranks(node)):
        run_dir.error_file(rank).unlink(missing_ok=True)
        workers.append(
            Worker(rank, worker_argv(spec), {**base, **rank_env(rank, local_rank, run_dir)}, run_dir.log(rank))
        )
    return workers


def spare_worker(plan: Plan, node: int, spec: JobSpec, run_dir: RunDir, spare: int) -> Worker:
    """Warm spare number ``spare`` of ``node``: the node's environment without a rank, which the supervisor
    gives it (``rank_env``) when it takes a failed rank's place."""
    env = {**node_env(plan, node, spec, run_dir), "PHALANX_SPARE": str(spare)}
    return Worker(-1, worker_argv(spec), env, run_dir.spare_log(spare), spare=spare)


def rank_env(rank: int, local_rank: int, run_dir: RunDir) -> dict[str, str]:
    """The variables that make a worker of the node one rank."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "ROLE_RANK": str(rank),
        "TORCHELASTIC_ERROR_FILE": str(run_dir.error_file(rank)),
        "PHALANX_STACKS_FILE": str(run_dir.stacks(rank)),
    }


def node_env(plan: Plan, node: int, spec: JobSpec, run_dir: RunDir) -> dict[str, str]:
    """The environment every worker of ``node`` shares: torchrun's variables but the rank's, and phalanx's (a
    spare node, not a member, gets its GROUP_RANK with the ranks it takes)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.procs))),
        **spec.env,
        **({"CUDA_VISIBLE_DEVICES": plan.visible_devices} if plan.visible_devices is not None else {}),
        **({"PHALANX_GPU_FRACTION": str(spec.resources.gpu_fraction)} if spec.resources.gpu_fraction else {}),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(plan.procs),
        "GROUP_RANK": str(plan.group_rank(node)) if node in plan.members else "",
        "GROUP_WORLD_SIZE": str(len(plan.members)),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": run_dir.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(plan.attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
        "PYTHONUNBUFFERED": "1",
        "PHALANX_RUN_ID": run_dir.run_id,
        "PHALANX_RUN_DIR": str(run_dir.root),
        "PHALANX_SPEC": plan.spec_path,
        "PHALANX_ATTEMPT": str(plan.attempt),
        "PHALANX_DEVICE": plan.device,
        "PHALANX_NODE_RANK": str(node),
        "PHALANX_CHECKPOINT_DIR": run_dir.checkpoint_location(spec.checkpoint.dir),
    }


def resolve_device(requested: str, procs_per_node: int) -> str:
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        have = torch.cuda.device_count()
        if have < procs_per_node:
            raise LaunchError(
                f"resources.device = cuda with procs_per_node = {procs_per_node}, but this machine has {have} "
                f"CUDA device(s); use procs_per_node <= {have} or device: cpu"
            )
    return requested


def spec_digest(spec: JobSpec) -> str:
    """Every agent must run the same spec: they compare this."""
    return hashlib.sha256(dump_spec(spec).encode()).hexdigest()[:16]
