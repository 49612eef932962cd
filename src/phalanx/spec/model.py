"""The job spec: one declarative description of a job that every layer reads.

Field-level rules live on the fields; rules that relate several fields (parallel degrees
against the world size, batch divisibility) live in ``JobSpec._cross_field_issues`` so that
each can name the exact field it blames.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]


class Strict(BaseModel):
    """Base for every spec section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True, allow_inf_nan=False)


class Resources(Strict):
    """Where the job runs: how many worker processes, on which device."""

    nodes: PositiveInt = Field(
        default=1, description="machines, an agent each (`phalanx agent`, or `phalanx run --local-nodes` on one)"
    )
    spare_nodes: Annotated[int, Field(ge=0)] = Field(
        default=0, description="extra agents that wait as hot spares and replace a failed or lost node"
    )
    procs_per_node: PositiveInt = Field(default=1, description="worker processes per machine: one per GPU on CUDA")
    device: Literal["cpu", "cuda", "auto"] = Field(
        default="auto", description="auto: cuda when this machine has CUDA devices, else cpu (gloo)"
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class ModelSpec(Strict):
    """A preset name, optionally with architecture fields overriding the preset's."""

    preset: str = Field(
        default="llama-debug",
        description="llama-tiny, llama-debug, llama3-1b, llama3-3b, llama3-8b or llama3-70b (train/models/llama.py)",
    )
    dim: PositiveInt | None = Field(default=None, description="model width; default: the preset's")
    n_layers: PositiveInt | None = Field(default=None, description="transformer blocks; default: the preset's")
    n_heads: PositiveInt | None = Field(default=None, description="attention heads; default: the preset's")
    n_kv_heads: PositiveInt | None = Field(
        default=None, description="key/value heads (grouped-query attention); default: the preset's"
    )
    vocab_size: PositiveInt | None = Field(
        default=None, description="default: the preset's; must hold the vocabulary of the data it trains on"
    )
    tie_embeddings: bool | None = Field(default=None, description="share the input embedding and output weights")


PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
ONE_STAGE_SCHEDULES = ("1F1B", "GPipe")  # a stage per rank; the others run pp_stages_per_rank each


class Parallel(Strict):
    """Degrees of the device mesh (pp, dp_replicate, dp_shard, tp, outermost first); ``dp_shard: -1`` takes
    whatever the world size leaves."""

    pp: PositiveInt = Field(
        default=1, description="pipeline-parallel degree: the blocks split into stages, one group of ranks each"
    )
    pp_schedule: Literal[PIPELINE_SCHEDULES] = Field(  # type: ignore[valid-type]
        default="1F1B",
        description="how the micro-batches go through the stages: 1F1B, GPipe, Interleaved1F1B (several stages "
        "per rank, a smaller bubble), InterleavedZeroBubble or ZBVZeroBubble (backward split into its input and "
        "weight halves, the smallest bubble)",
    )
    pp_stages_per_rank: PositiveInt = Field(
        default=1,
        description="virtual stages per pipeline rank: 1 for 1F1B and GPipe, 2 for ZBVZeroBubble, 1 or more for the "
        "interleaved schedules",
    )
    dp_replicate: PositiveInt = Field(default=1, description="data-parallel replicas; > 1 with dp_shard > 1 is HSDP")
    dp_shard: Annotated[int, Field(ge=-1)] = Field(
        default=-1, description="FSDP2 sharding degree; -1: the world size / (pp x dp_replicate x tp)"
    )
    tp: PositiveInt = Field(default=1, description="tensor-parallel degree (Megatron-style, sequence-parallel norms)")

    @model_validator(mode="after")
    def _consistent(self) -> Parallel:
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be a positive degree, or -1 to fill the world size")
        if self.pp_schedule in ONE_STAGE_SCHEDULES and self.pp_stages_per_rank != 1:
            raise ValueError(
                f"pp_stages_per_rank = {self.pp_stages_per_rank} with pp_schedule {self.pp_schedule}, which runs "
                "one stage per rank; use pp_schedule: Interleaved1F1B, or pp_stages_per_rank: 1"
            )
        if self.pp_schedule == "ZBVZeroBubble" and self.pp_stages_per_rank != 2:
            raise ValueError(
                f"pp_stages_per_rank = {self.pp_stages_per_rank} with pp_schedule ZBVZeroBubble, which runs two "
                "stages per rank (down the ranks and back); use pp_stages_per_rank: 2"
            )
        return self

    def resolved(self, world_size: int) -> Parallel:
        """The same degrees with ``dp_shard: -1`` replaced by its value for ``world_size``."""
        if self.dp_shard != -1:
            return self
        return self.model_copy(update={"dp_shard": world_size // (self.pp * self.dp_replicate * self.tp)})

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def stages(self) -> int:
        """Pipeline stages in all: the blocks are split into this many contiguous chunks."""
        return self.pp * self.pp_stages_per_rank


DEFAULT_WARMUP = 20


class Optimizer(Strict):
    """AdamW with a warmup and a decay schedule."""

    lr: PositiveFloat = Field(default=3.0e-4, description="peak learning rate, reached at the end of the warmup")
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        default=0.1, description="the schedule decays to lr x this by the last step"
    )
    warmup_steps: Annotated[int, Field(ge=0)] = Field(
        default=DEFAULT_WARMUP,
        description=f"linear warmup from 0; at most train.steps; default {DEFAULT_WARMUP}, or a tenth of a shorter run",
    )
    schedule: Literal["cosine", "linear", "constant"] = Field(default="cosine", description="decay after the warmup")
    weight_decay: Annotated[float, Field(ge=0.0)] = Field(default=0.1, description="AdamW's decoupled weight decay")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        default=(0.9, 0.95), description="AdamW's (beta1, beta2)"
    )
    eps: PositiveFloat = Field(default=1.0e-8, description="AdamW's epsilon")
    grad_clip: Annotated[float, Field(ge=0.0)] = Field(
        default=1.0, description="clip the global gradient norm to this; 0: no clipping"
    )


class Train(Strict):
    """The built-in LLM recipe."""

    model: ModelSpec = ModelSpec()
    parallel: Parallel = Parallel()
    steps: PositiveInt = Field(default=200, description="optimizer steps to train")
    global_batch: PositiveInt = Field(
        default=16, description="sequences per step, over all ranks; a multiple of micro_batch x the data-parallel size"
    )
    micro_batch: PositiveInt = Field(
        default=4, description="sequences per forward pass per rank; fewer than the rank's share means accumulation"
    )
    seq_len: PositiveInt = Field(default=256, description="tokens per sequence")
    optimizer: Optimizer = Optimizer()
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32", description="bf16: FSDP2 bf16 parameters with fp32 gradient reduction (autocast on one rank)"
    )
    activation_checkpoint: Literal["off", "full", "selective"] = Field(
        default="off",
        description="recompute activations in backward: every block's (full), or all but matmul and "
        "attention outputs (selective)",
    )
    compile: bool = Field(default=False, description="torch.compile each transformer block")
    seed: int = Field(default=1234, description="model initialisation, synthetic data and the data order")
    peak_tflops: PositiveFloat | None = Field(
        default=None, description="peak dense TFLOP/s per device for MFU; default: the table in obs/metrics.py"
    )

    @model_validator(mode="after")
    def _warmup_fits(self) -> Train:
        """A default must not make a valid-looking spec invalid: a run shorter than the default warmup warms up
        for a tenth of its steps. (A warmup the user wrote is checked against the run, in JobSpec.)"""
        if "warmup_steps" not in self.optimizer.model_fields_set and self.optimizer.warmup_steps > self.steps:
            self.optimizer = self.optimizer.model_copy(update={"warmup_steps": self.steps // 10})
        return self


class DataSource(Strict):
    path: str = Field(description="a prepared dataset directory (`phalanx data prepare`), or builtin:stdlib")
    weight: PositiveFloat = Field(default=1.0, description="share of the blend (weights are normalised)")


class Data(Strict):
    """Tokenized datasets for the recipe, blended by weight in a deterministic order. Without `data:` the recipe
    trains on learnable synthetic tokens."""

    sources: Annotated[list[DataSource], Field(min_length=1)]
    verify: Literal["full", "size"] = Field(
        default="full", description="check shards at start: sha256 and size (full), or size only (fast)"
    )


class Checkpoint(Strict):
    """Sharded checkpoints of the recipe (torch DCP), committed atomically with a checksummed manifest."""

    dir: str | None = Field(
        default=None,
        description="a local path or an fsspec URL (s3://...); a run resumes from its newest valid checkpoint. "
        "Default: <run dir>/checkpoints",
    )
    every_steps: PositiveInt | Literal["auto"] = Field(
        default=50,
        description="save every this many steps, and at the end; auto: Young/Daly's optimum from the measured "
        "cost of a save and the job's failure rate (resilience.mtbf_hours)",
    )
    async_save: bool = Field(
        default=True, alias="async", description="copy to CPU and write behind training (false: training waits)"
    )
    keep_last: PositiveInt = Field(default=3, description="committed checkpoints kept, newest first")
    keep_every: PositiveInt | None = Field(
        default=None, description="also keep every checkpoint whose step is a multiple of this"
    )


class Resilience(Strict):
    """What the supervisor does when a job fails, hangs, slows down or produces bad losses."""

    max_restarts: Annotated[int, Field(ge=0)] = Field(
        default=3, description="restarts after infrastructure failures (crashes, hangs); user errors are not retried"
    )
    restart_backoff_s: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="wait before the first restart; doubled for each next one, at most 60 s"
    )
    hang_timeout_s: PositiveFloat | Literal["auto"] = Field(
        default="auto", description="no step progress for this long is a hang; auto: max(3x p99 step time, 120 s)"
    )
    on_nan: Literal["stop", "skip", "rollback"] = Field(
        default="rollback", description="a step whose loss or grad norm is NaN/Inf, or whose loss spikes"
    )
    loss_spike_factor: float | None = Field(
        default=3.0, gt=1.0, description="a loss above this times the median of the last 50 is a spike (null: off)"
    )
    allow_shrink: bool = Field(
        default=False, description="go on with fewer ranks when a slot's rank fails first in two attempts in a row"
    )
    min_procs: PositiveInt = Field(default=1, description="with allow_shrink: never fewer processes than this")
    regrow_after_s: PositiveFloat | None = Field(
        default=600.0, description="after a shrink, train this long, then try every slot again (null: never)"
    )
    straggler_factor: float = Field(
        default=1.5, gt=1.0, description="a rank whose compute per step stays this many times the others' is reported"
    )
    stop_grace_s: PositiveFloat = Field(
        default=30.0, description="after SIGTERM, how long workers get (for an emergency checkpoint) before SIGKILL"
    )
    node_timeout_s: Annotated[float, Field(ge=1.0)] = Field(
        default=5.0, description="a node whose agent died (its machine gone) is found lost within this (multi-node)"
    )
    mtbf_hours: PositiveFloat | None = Field(
        default=None,
        description="the job's mean time between failures, for checkpoint.every_steps: auto; default: the Llama 3 "
        "report's (one per ~50,700 GPU-hours) over the job's processes",
    )
    in_process: bool = Field(
        default=False,
        description="when a rank crashes, the others keep their processes, a warm spare takes its place and the "
        "state comes back from the ranks' memory; what that cannot handle falls back to a restart (built-in "
        "recipe, one node; docs/failures.md)",
    )
    warm_spares: PositiveInt = Field(
        default=1,
        description="with in_process: processes kept started (torch imported), each ready to take a rank's place",
    )
    memory_every_steps: PositiveInt = Field(
        default=1,
        description="with in_process: every this many steps each rank copies its state to memory and to a "
        "neighbour rank; a recovery loses at most the steps since",
    )
    recovery_timeout_s: PositiveFloat = Field(
        default=30.0, description="with in_process: a recovery not done in this long falls back to a restart"
    )


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


def _pipeline_issues(p: Parallel, microbatches: int) -> list[tuple[str, str]]:
    """A pipeline's micro-batches are the step's accumulation steps: global_batch / (micro_batch x dp)."""
    if "ZeroBubble" in p.pp_schedule and p.dp > 1:
        return [
            (
                "train.parallel.pp_schedule",
                f"{p.pp_schedule} with a data-parallel degree of {p.dp}: FSDP reduces a block's gradients when its "
                "backward pass ends, before a zero-bubble schedule's separate weight pass has computed them (in "
                "torch 2.13 the gradients come out wrong); use Interleaved1F1B, or dp_replicate = dp_shard = 1",
            )
        ]
    where = "train.micro_batch"
    have = f"{microbatches} micro-batch(es) a step (global_batch / (micro_batch x data-parallel degree))"
    if p.pp_schedule == "1F1B" and microbatches < p.pp:
        return [
            (
                where,
                f"{have} for pp = {p.pp} stages with pp_schedule 1F1B, which needs at least one per stage; "
                f"use a micro_batch that gives >= {p.pp}, or pp_schedule: GPipe",
            )
        ]
    rounds = max(1, microbatches // p.pp)
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        valid = [m for m in range(p.pp, 2 * microbatches + p.pp) if m % max(1, m // p.pp) == 0]
        near = sorted(valid, key=lambda m: abs(m - microbatches))[:4]
        return [
            (
                where,
                f"{have} with pp_schedule {p.pp_schedule} and pp = {p.pp}: it runs them in count // pp = {rounds} "
                f"rounds, so the count must be a multiple of {rounds}; valid counts near it: "
                f"{', '.join(map(str, sorted(near)))}",
            )
        ]
    return []


class JobSpec(Strict):
    """A job: either the built-in recipe (``train:``) or any script under supervision (``command:``)."""

    name: Name = Field(description="the job's name: runs go to <runs dir>/<name>/<run id>")
    resources: Resources = Resources()
    train: Train | None = None
    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = Field(
        default=None, description="argv of a script to run on every rank; a leading python is this interpreter"
    )
    env: dict[str, str] = Field(default={}, description="extra environment variables for the workers")
    data: Data | None = None
    checkpoint: Checkpoint = Checkpoint()
    resilience: Resilience = Resilience()
    slurm: Slurm = Slurm()
    kubernetes: Kubernetes = Kubernetes()

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        issues = self._cross_field_issues()
        if issues:
            raise ValueError("\n".join(f"{path}: {message}" for path, message in issues))
        return self

    def _cross_field_issues(self) -> list[tuple[str, str]]:
        if (self.train is None) == (self.command is None):
            return [("train|command", "give exactly one: `train:` (the built-in recipe) or `command:` (a script)")]
        return self._slurm_issues() + self._train_issues()

    def _slurm_issues(self) -> list[tuple[str, str]]:
        margin, grace = self.slurm.stop_margin_s, self.resilience.stop_grace_s
        if margin is not None and margin < grace:
            return [
                (
                    "slurm.stop_margin_s",
                    f"{margin} s is shorter than resilience.stop_grace_s = {grace:g} s, the time the job gets to "
                    f"checkpoint once warned; use at least {math.ceil(grace)}",
                )
            ]
        return []

    @property
    def stop_margin_s(self) -> int:
        """How long before Slurm's time limit the job is warned to stop (slurm.stop_margin_s, or its default)."""
        return self.slurm.stop_margin_s or math.ceil(self.resilience.stop_grace_s) + 60

    def _train_issues(self) -> list[tuple[str, str]]:
        if self.train is None:
            return self._in_process_issues()
        world = self.resources.world_size
        p, t = self.train.parallel, self.train
        fixed = p.pp * p.dp_replicate * p.tp * (p.dp_shard if p.dp_shard != -1 else 1)
        if world % fixed or (p.dp_shard != -1 and fixed != world):
            shown = "-1" if p.dp_shard == -1 else str(p.dp_shard)
            return [
                (
                    "train.parallel",
                    f"pp x dp_replicate x dp_shard x tp = {p.pp} x {p.dp_replicate} x {shown} x {p.tp} does not fit "
                    f"the world size nodes x procs_per_node = {self.resources.nodes} x {self.resources.procs_per_node}"
                    f" = {world}; the product must equal {world} (dp_shard: -1 fills it when {world} is divisible by "
                    f"pp x dp_replicate x tp)",
                )
            ]
        dp = p.resolved(world).dp
        issues = self._in_process_issues()
        step = t.micro_batch * dp
        if t.global_batch % step:
            issues.append(
                (
                    "train.global_batch",
                    f"{t.global_batch} is not a multiple of micro_batch x data-parallel degree = "
                    f"{t.micro_batch} x {dp} = {step}; valid values are multiples of {step} "
                    f"(e.g. {', '.join(str(step * k) for k in (1, 2, 4))}), or choose a micro_batch that "
                    f"divides global_batch / {dp}",
                )
            )
        elif p.pp > 1:
            issues += _pipeline_issues(p.resolved(world), t.global_batch // step)
        if t.optimizer.warmup_steps > t.steps:
            issues.append(
                (
                    "train.optimizer.warmup_steps",
                    f"{t.optimizer.warmup_steps} is longer than the run (train.steps = {t.steps}); "
                    f"use at most {t.steps}",
                )
            )
        return issues

    def _in_process_issues(self) -> list[tuple[str, str]]:
        """In-process recovery rebuilds the recipe's own state, on one node, from the other ranks' memory."""
        res = self.resources
        if not self.resilience.in_process:
            return []
        if self.command is not None:
            return [
                (
                    "resilience.in_process",
                    "true with `command:`: in-process recovery rebuilds the built-in recipe's state, which a "
                    "script's is not; use `train:`, or in_process: false",
                )
            ]
        if res.nodes + res.spare_nodes > 1:
            return [
                (
                    "resilience.in_process",
                    f"true with resources.nodes = {res.nodes} (spare_nodes = {res.spare_nodes}): in-process "
                    "recovery runs on one node for now; use nodes: 1, or in_process: false (a failed node's job "
                    "restarts from its last checkpoint)",
                )
            ]
        if self.train is not None and self.train.parallel.pp > 1:
            return [
                (
                    "resilience.in_process",
                    f"true with train.parallel.pp = {self.train.parallel.pp}: in-process recovery does not rebuild "
                    "pipeline stages yet; use pp: 1, or in_process: false (a failed rank's job restarts from its "
                    "last checkpoint)",
                )
            ]
        if res.world_size < 2:
            return [
                (
                    "resilience.in_process",
                    "true with a world of 1 process: no rank would survive to keep the state; use "
                    "procs_per_node >= 2, or in_process: false",
                )
            ]
        return []

    @property
    def parallel(self) -> Parallel | None:
        """The recipe's parallel degrees with ``dp_shard`` resolved for this job's world size."""
        return self.train.parallel.resolved(self.resources.world_size) if self.train else None

    @property
    def microbatches(self) -> int | None:
        """The recipe's micro-batches a step on each rank: its accumulation steps, a pipeline's micro-batches."""
        if self.train is None or self.parallel is None:
            return None
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)
