"""How often large training jobs fail: the Llama 3 report's figures (Dubey et al., 2024, section 3.3.4):
419 unexpected interruptions in 54 days of pre-training on 16,384 GPUs, one per ~50,700 GPU-hours; and how
often to save against them."""

import math

LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16_384 / 419


def default_mtbf_hours(processes: int) -> float:
    """A job's mean time between failures at the report's rate per GPU (a process per GPU)."""
    return LLAMA3_GPU_HOURS_PER_FAILURE / processes


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young (1974) and Daly (2006): the work between saves (storage checkpoints, memory snapshots) that loses
    least to saving plus redoing the work since the last save, for saves costing ``cost_s`` and failures
    ``mtbf_s`` apart on average."""
    return math.sqrt(2 * cost_s * mtbf_s)
