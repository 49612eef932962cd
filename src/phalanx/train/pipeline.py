"""Pipeline parallelism: the model's blocks split into stages, run by a ``torch.distributed.pipelining`` schedule.

Stage s of S holds an equal, contiguous run of blocks; the first stage also the embedding, the last the final
norm and the output projection. With 1F1B or GPipe each pipeline rank runs one stage; with Interleaved1F1B
or InterleavedZeroBubble it runs ``pp_stages_per_rank`` of them, stages r, r + pp, r + 2 pp, ..., so that a
micro-batch passes every rank several times and the pipeline's bubble (its ranks idle while it fills and
drains) shrinks as many times; ZBVZeroBubble runs two, r and 2 pp - 1 - r. A step's micro-batches are the
recipe's accumulation steps: global_batch / (micro_batch x dp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from phalanx.spec.parallel import Parallel
from phalanx.train.models.llama import Llama


def stage_indices(p: Parallel, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs: looping round the ranks, or for ZBVZeroBubble down the
    ranks and back up (rank 0 runs the first stage and the last)."""
    if p.pp_schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * p.pp - 1 - pp_rank]
    return [pp_rank + k * p.pp for k in range(p.pp_stages_per_rank)]


def split(model: Llama, p: Parallel, pp_rank: int) -> list[Llama]:
    """Keep in ``model`` only the modules of this rank's stages; return the stages, made of those modules."""
    per = model.cfg.n_layers // p.stages
    indices = stage_indices(p, pp_rank)
    blocks = {i: [str(b) for b in range(i * per, (i + 1) * per)] for i in indices}
    first, last = 0 in indices, p.stages - 1 in indices
    model.keep_only([b for i in indices for b in blocks[i]], first=first, last=last)
    return [model.stage(blocks[i], first=i == 0, last=i == p.stages - 1) for i in indices]


def bubble_fraction(p: Parallel, microbatches: int) -> float:
    """The share of a step a pipeline rank idles in theory, with equal stages and free communication, for m
    micro-batches and v stages per rank: (pp - 1) / (v m + pp - 1) for 1F1B, GPipe and Interleaved1F1B; for
    the zero-bubble schedules, which split a backward pass into its input and weight halves and fill the
    drain with the weight halves, (pp - 1) / (3 v m + pp - 1), ZB-H1's figure with the forward and the two
    halves taking equal time (ZBV's V-shaped placement can go below it)."""
    work = 3 * microbatches if "ZeroBubble" in p.pp_schedule else microbatches
    return (p.pp - 1) / (p.pp_stages_per_rank * work + p.pp - 1)


class Pipeline:
    """This rank's stages under the spec's schedule; ``step`` runs a step's forward and backward."""

    def __init__(
        self,
        stages: list[Llama],
        p: Parallel,
        pp_mesh: DeviceMesh,
        device: torch.device,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        indices = stage_indices(p, pp_mesh.get_local_rank())
        group = pp_mesh.get_group()
        runs = [PipelineStage(s, i, p.stages, device, group=group) for s, i in zip(stages, indices, strict=True)]
        schedule = get_schedule_class(p.pp_schedule)
        one = issubclass(schedule, PipelineScheduleSingle)
        self.schedule = schedule(runs[0] if one else runs, n_microbatches=microbatches, loss_fn=loss_fn)
        self.first, self.last = 0 in indices, p.stages - 1 in indices

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch (gradients scaled by 1 / micro-batches, as accumulation
        does); the micro-batches' losses on the rank that runs the last stage, none elsewhere."""
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *((inputs,) if self.first else ()),
            target=targets if self.last else None,
            losses=losses if self.last else None,
            return_outputs=False,
        )
        return losses
