"""``phalanx server --cluster-config FILE``: what the operator says of the fleet that no driver reports, the
GPU types' prices (on-demand and spot, per GPU-hour), memory, vendor and peak. The executor still finds the
nodes and their types; a type it finds that the file does not describe costs nothing.

    gpu_types:
      H100: {price_per_gpu_h: 2.49, spot_price_per_gpu_h: 1.10, memory_gib: 80}
      A100: {price_per_gpu_h: 1.29, memory_gib: 80}
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from phalanx.control import scheduler as core
from phalanx.spec.load import MAX_VALUES, values_over

MAX_CHARS = 64 * 1024
Money = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]


class GpuTypeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    price_per_gpu_h: Money = Field(description="on-demand dollars per GPU-hour")
    spot_price_per_gpu_h: Money | None = None
    memory_gib: Annotated[float, Field(ge=0, le=1e5, allow_inf_nan=False)] = 0.0
    vendor: Literal["nvidia", "amd", "intel", "other"] = "nvidia"
    tflops: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] | None = Field(
        default=None, description="dense 16-bit peak per GPU; default: the data sheet's, for a model listed there"
    )


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu_types: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")], GpuTypeConfig]

    def types(self) -> tuple[core.GpuType, ...]:
        return tuple(
            core.GpuType(
                name,
                c.tflops if c.tflops is not None else core.GpuType.named(name).tflops,
                c.memory_gib,
                c.vendor,
                c.price_per_gpu_h,
                c.spot_price_per_gpu_h,
            )
            for name, c in self.gpu_types.items()
        )


def load(path: Path) -> tuple[core.GpuType, ...]:
    """The GPU types ``path`` describes; ValueError naming the file and the field when it cannot be used."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--cluster-config {path}: cannot read it: {e.strerror}") from None
    if len(text) > MAX_CHARS:
        raise ValueError(f"--cluster-config {path}: {len(text):,} characters; at most {MAX_CHARS:,}")
    try:
        data = yaml.safe_load(text)
        if values_over(data, MAX_VALUES):  # YAML aliases: a few bytes that expand to millions of values
            raise ValueError(f"--cluster-config {path}: more than {MAX_VALUES:,} values once aliases are expanded")
        return ClusterConfig.model_validate(data).types()
    except yaml.YAMLError as e:
        raise ValueError(f"--cluster-config {path}: not valid YAML: {str(e)[:200]}") from None
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(top)'}: {x['msg']}" for x in e.errors()[:10])
        raise ValueError(f"--cluster-config {path}: {where}") from None


def as_found(types: Sequence[core.GpuType], nodes: Iterable[core.Node]) -> list[core.GpuType]:
    """The operator's types, each named as the executor names it where only the case differs (Slurm's gres
    types are often lower case: ``gpu:h100:8``), so that the file's H100 prices the nodes found as h100."""
    found = {node.gpu_type.lower(): node.gpu_type for node in nodes}
    return [replace(t, name=found.get(t.name.lower(), t.name)) for t in types]


def fleet(nodes: Sequence[core.Node], unit: str, types: Sequence[core.GpuType]) -> core.Cluster:
    """The executor's nodes with the operator's types (``as_found``): what the scheduler places on, and the
    type table (peaks, prices) the API's speed table is seeded by, the same for both."""
    return core.Cluster(nodes, unit, as_found(types, nodes))
