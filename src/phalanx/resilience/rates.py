"""How often large training jobs fail: the Llama 3 report's figures (Dubey et al., 2024, section 3.3.4):
419 unexpected interruptions in 54 days of pre-training on 16,384 GPUs, one per ~50,700 GPU-hours."""

LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16_384 / 419


def default_mtbf_hours(processes: int) -> float:
    """A job's mean time between failures at the report's rate per GPU (a process per GPU)."""
    return LLAMA3_GPU_HOURS_PER_FAILURE / processes
