"""The job spec: one declarative description of a job that every layer reads.

Field-level rules live on the fields; rules that relate several fields (parallel degrees
against the world size, batch divisibility) live in ``JobSpec._cross_field_issues`` so that
each can name the exact field it blames.
"""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import ByteSize, Field, PositiveFloat, PositiveInt, WithJsonSchema, model_validator

from phalanx.spec.base import Location, Name, Strict
from phalanx.spec.clusters import Kubernetes, Slurm
from phalanx.spec.parallel import Parallel, pipeline_issues

KIND_CHARS = 64  # of a job's kind, as the server keeps it


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
    gpu_types: Annotated[list[Name], Field(max_length=32)] = Field(
        default_factory=list,
        description="the GPU types it may run on under `phalanx server`, such as [H100, H200]; empty: any",
    )
    prefer_gpu_types: Annotated[list[Name], Field(max_length=32)] = Field(
        default_factory=list, description="of those, the ones it would rather have, best first"
    )
    mix_gpu_types: bool = Field(
        default=False,
        description="one gang may span GPU types when no one type holds it (it runs at the pace of the slowest)",
    )
    gpu_fraction: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="a share of one GPU, 0.001 to 0.999, for a job of one process on one node under `phalanx "
        "server`: it runs beside other shares of the same GPU, its CUDA memory capped at that share; none: whole GPUs",
    )

    @model_validator(mode="after")
    def _preferred_are_allowed(self) -> Resources:
        if stray := [t for t in self.prefer_gpu_types if self.gpu_types and t not in self.gpu_types]:
            raise ValueError(f"prefer_gpu_types: {stray} are not in gpu_types {self.gpu_types}")
        if self.gpu_fraction is not None:
            if not 1 <= self.gpu_milli < 1000:
                raise ValueError(f"gpu_fraction: {self.gpu_fraction}; a share counts thousandths, 0.001 to 0.999")
            if (self.nodes, self.procs_per_node, self.spare_nodes) != (1, 1, 0):
                raise ValueError(
                    f"gpu_fraction: a share of one GPU is for one process on one node; this job asks for nodes "
                    f"{self.nodes}, procs_per_node {self.procs_per_node}, spare_nodes {self.spare_nodes}"
                )
        return self

    @property
    def gpu_milli(self) -> int:
        """Its GPU in thousandths: 1000 for whole GPUs."""
        return 1000 if self.gpu_fraction is None else round(self.gpu_fraction * 1000)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class ModelSpec(Strict):
    """A preset name, optionally with architecture fields overriding the preset's."""

    preset: str = Field(
        default="llama-debug",
        description="llama-tiny, llama-debug, llama3-1b, llama3-3b, llama3-8b or llama3-70b (train/models/args.py)",
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
    path: Location = Field(
        description="a prepared dataset (`phalanx data prepare`): a directory, an fsspec URL (s3://bucket/prefix, "
        "read through the node's cache), or builtin:stdlib"
    )
    weight: PositiveFloat = Field(default=1.0, description="share of the blend (weights are normalised)")


class Data(Strict):
    """Tokenized datasets for the recipe, blended by weight in a deterministic order. Without `data:` the recipe
    trains on learnable synthetic tokens."""

    sources: Annotated[list[DataSource], Field(min_length=1)]
    verify: Literal["full", "size"] = Field(
        default="full",
        description="check local shards at start: sha256 and size (full), or size only (fast); a remote dataset's "
        "sizes are checked at start and each chunk's checksum when it is fetched",
    )
    cache_dir: str | None = Field(
        default=None,
        description="a node-local directory for remote datasets' chunks, shared by the node's ranks and jobs. "
        "Default: $PHALANX_CACHE/data (~/.cache/phalanx/data)",
    )
    cache_bytes: Annotated[
        ByteSize,
        Field(gt=0),
        WithJsonSchema({"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "string"}]}),
    ] = Field(
        default=ByteSize(64 << 30),
        description="the most the node's cache holds (bytes, or with a unit: 500GB, 64GiB); the least recently "
        "used chunks go first",
    )
    fetch_timeout_s: PositiveFloat = Field(
        default=300.0,
        description="how long a chunk may keep failing to arrive (the store down, erroring or slow) before the job "
        "fails naming it; it is tried again with backoff meanwhile",
    )


class Checkpoint(Strict):
    """Sharded checkpoints of the recipe (torch DCP), committed atomically with a checksummed manifest."""

    dir: Location | None = Field(
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
        description="when a rank crashes (one node) or a node is lost (several, with spare_nodes), the others keep "
        "their processes, warm spares take the lost ranks and the state comes back from the ranks' memory; what "
        "that cannot handle falls back to a restart (built-in recipe; docs/failures.md)",
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
    kind: Name | None = Field(
        default=None,
        description="its class for `phalanx server`'s speed table: jobs of a kind run alike on each GPU type; "
        "default: the recipe's model and sequence length, or the script's name",
    )

    @property
    def job_kind(self) -> str:
        """``kind``, or one made from what decides a job's speed per GPU: the recipe's model (its preset and
        any field changed) and sequence length; a script's file (or module) name."""
        if self.kind is not None:
            return self.kind
        if self.train is not None:
            m = self.train.model
            changed = "".join(f"-{k}{v}" for k, v in m.model_dump(exclude={"preset"}, exclude_none=True).items())
            return f"{m.preset}{changed}-seq{self.train.seq_len}"[:KIND_CHARS]
        argv = self.command or []
        after_m = argv[argv.index("-m") + 1 : argv.index("-m") + 2] if "-m" in argv else []
        script = after_m or [a for a in argv if a.endswith(".py")][:1] or argv[:1]
        return PurePosixPath(script[0]).name[:KIND_CHARS]

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
            issues += pipeline_issues(p.resolved(world), t.global_batch // step)
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
        """In-process recovery rebuilds the recipe's own state from the other ranks' memory."""
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
