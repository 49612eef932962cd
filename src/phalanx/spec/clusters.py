"""``slurm`` and ``kubernetes``: how a cluster manager is asked for the job's nodes, checked as strictly as
the rest of the spec, since what is rendered from them reaches sbatch and the Kubernetes API."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, PositiveInt

from phalanx.spec.base import Strict

SlurmName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.@:-]{1,128}$")]
# Slurm's own forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
SlurmTime = Annotated[str, Field(pattern=r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")]
# sbatch's --mem: a size with an optional unit; 0 is all of each node's memory.
SlurmMemory = Annotated[str, Field(pattern=r"^\d{1,9}[KMGT]?$")]
# What the batch script renders itself, or takes from another field: never passed through slurm.sbatch_options.
SBATCH_RENDERED = {
    "nodes": "resources.nodes and spare_nodes", "ntasks": "one agent per node", "ntasks-per-node": "one agent per node",
    "cpus-per-task": "slurm.cpus_per_node", "mem": "slurm.mem", "exclusive": "slurm.exclusive",
    "gres": "slurm.gpus_per_node", "gpus": "slurm.gpus_per_node", "gpus-per-node": "slurm.gpus_per_node",
    "time": "slurm.time_limit", "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos",
    "constraint": "slurm.constraint", "job-name": "name", "output": "phalanx's log files",
    "error": "phalanx's log files", "open-mode": "phalanx's log files", "chdir": "the submitting directory",
    "no-kill": "phalanx's node handling", "requeue": "slurm.requeue", "no-requeue": "slurm.requeue",
    "signal": "slurm.stop_margin_s", "wait-all-nodes": "the batch script", "array": None, "wrap": None,
    "parsable": None, "export": "env (the workers' environment) and slurm.setup",
}  # fmt: skip


def _sbatch_option(option: str) -> str:
    name, _, value = option.partition("=")
    if not re.fullmatch(r"--[a-z][a-z0-9-]{0,40}", name):
        raise ValueError(
            f"{option!r}: give a long option as sbatch takes it, --name or --name=value (e.g. --reservation=maint)"
        )
    if not re.fullmatch(r"[^\s\"'\\]{0,256}", value):
        raise ValueError(f"{option[:60]!r}: a value of at most 256 characters, with no spaces, quotes or backslashes")
    if name[2:] in SBATCH_RENDERED:
        instead = SBATCH_RENDERED[name[2:]]
        raise ValueError(f"{name}: phalanx renders it" + (f" from {instead}" if instead else " or cannot run with it"))
    return option


def _port_range(ports: str) -> str:
    low, _, high = ports.partition("-")
    if not (re.fullmatch(r"\d{1,5}(-\d{1,5})?", ports) and 1024 <= int(low) <= int(high or low) <= 65535):
        raise ValueError("give PORT or LOW-HIGH, with 1024 <= LOW <= HIGH <= 65535 (e.g. 29400-29499)")
    return ports


class Slurm(Strict):
    """How `phalanx slurm submit` (and a server with `--executor slurm`) asks Slurm for the job's nodes, and how
    each node is set up (docs/clusters.md)."""

    partition: SlurmName | None = Field(default=None, description="sbatch --partition; default: the cluster's")
    account: SlurmName | None = Field(default=None, description="sbatch --account")
    qos: SlurmName | None = Field(default=None, description="sbatch --qos")
    constraint: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.&|!*()\[\]:,-]{1,256}$")] | None = Field(
        default=None, description="sbatch --constraint: node features, e.g. h100&ib"
    )
    time_limit: SlurmTime | None = Field(
        default=None,
        description="sbatch --time: minutes, HH:MM:SS or D-HH:MM:SS; stop_margin_s before it the job checkpoints "
        "and stops",
    )
    stop_margin_s: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        default=None,
        description="how long before the time limit Slurm warns the job (--signal), which then stops with a "
        "checkpoint; at least resilience.stop_grace_s; default: stop_grace_s + 60",
    )
    gpus_per_node: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="GPUs asked per node (gres gpu); default: procs_per_node on cuda, else 0"
    )
    cpus_per_node: PositiveInt | None = Field(
        default=None,
        description="CPUs asked per node (--cpus-per-task of the node's one agent, which its workers share); "
        "default: all of each node's on cuda (exclusive), else procs_per_node",
    )
    mem: SlurmMemory | None = Field(
        default=None, description="memory per node (--mem), e.g. 500G; 0: all of it; default: 0 on cuda, else Slurm's"
    )
    exclusive: bool | None = Field(
        default=None, description="whole nodes, shared with no other job (--exclusive); default: true on cuda"
    )
    requeue: bool = Field(
        default=True,
        description="Slurm requeues the job when node 0 is lost or it is preempted, and it resumes from its last "
        "checkpoint; false: the job ends",
    )
    rdzv_ports: Annotated[str, AfterValidator(_port_range)] = Field(
        default="29400-29499",
        description="the rendezvous listens on one port of this range (open it between the nodes), the job id "
        "modulo its size: jobs sharing a head node collide only when their ids are that far apart",
    )
    python: Annotated[str, Field(pattern=r"^[^\x00\n]{1,1024}$")] | None = Field(
        default=None, description="the Python interpreter on the nodes; default: the one that submits"
    )
    setup: list[Annotated[str, Field(pattern=r"^[^\x00\n]{0,1024}$")]] = Field(
        default=[],
        description="shell lines the batch script runs before it starts the agents (module load, source a venv); "
        "srun carries the environment they make to every node",
    )
    sbatch_options: list[Annotated[str, AfterValidator(_sbatch_option)]] = Field(
        default=[],
        description="more sbatch options for the site, e.g. --reservation=x, --comment=y; those phalanx renders "
        "are refused with the field to use",
    )

    @property
    def ports(self) -> tuple[int, int]:
        low, _, high = self.rdzv_ports.partition("-")
        return int(low), int(high or low)


K8sName = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]
Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")]


class Kubernetes(Strict):
    """How `phalanx k8s render|submit` makes the job a JobSet: one pod per node, one agent per pod
    (docs/clusters.md)."""

    namespace: K8sName = Field(default="default", description="where the JobSet and its ConfigMap go")
    image: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="the container image, with phalanx, torch and the job's code; needed to render"
    )
    queue: K8sName | None = Field(
        default=None, description="a Kueue LocalQueue: the JobSet gets the kueue.x-k8s.io/queue-name label"
    )
    runs_claim: K8sName | None = Field(
        default=None,
        description="a ReadWriteMany PersistentVolumeClaim mounted at runs_path in every pod (the shared filesystem "
        "of run directories and checkpoints); null: an emptyDir, for one-node jobs",
    )
    runs_path: Annotated[str, Field(pattern=r"^/")] = Field(
        default="/phalanx/runs", description="where the run directories are, in every pod"
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", description="the extended resource that counts GPUs")
    cpu: Quantity | None = Field(default=None, description="CPU request and limit per pod, e.g. '16' or '500m'")
    memory: Quantity | None = Field(default=None, description="memory request and limit per pod, e.g. '200Gi'")
    priority_class: K8sName | None = Field(default=None, description="the pods' priorityClassName")
    service_account: K8sName | None = Field(default=None, description="the pods' serviceAccountName")
    node_selector: dict[str, str] = Field(default={}, description="the pods' nodeSelector")
