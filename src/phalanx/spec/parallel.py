"""``train.parallel``: the degrees of the device mesh, and the rules a pipeline's schedule puts on them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveInt, model_validator

from phalanx.spec.base import Strict

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


def pipeline_issues(p: Parallel, microbatches: int) -> list[tuple[str, str]]:
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
