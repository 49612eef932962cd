"""Per-step training metrics: throughput and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / peak FLOP/s per device, where achieved = tokens/s per device x
training FLOPs per token (6N + 12·L·H·Q·T, see ``LlamaConfig.flops_per_token``). Peaks are dense (no
sparsity) datasheet numbers; ``train.peak_tflops`` in the spec overrides the table, and a device not in the
table (a CPU, say) reports no MFU unless it is set.
"""

from __future__ import annotations

import resource
import sys

import torch

# (device name fragment, precision) -> peak dense FLOP/s; the first fragment found in the device name wins.
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("B200", "bf16"): 2250e12,
    ("H200", "bf16"): 989.4e12,
    ("H100", "bf16"): 989.4e12,
    ("H200", "fp32"): 66.9e12,
    ("H100", "fp32"): 66.9e12,
    ("A100", "bf16"): 312e12,
    ("A100", "fp32"): 19.5e12,
    ("L4", "bf16"): 121e12,
}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_flops(device: torch.device, precision: str, override_tflops: float | None = None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    name = device_name(device)
    return next((peak for (fragment, prec), peak in PEAK_FLOPS.items() if fragment in name and prec == precision), None)


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    return flops_per_token * tokens_per_s_per_device / peak if peak else None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on its device: CUDA allocator peak, or peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def gpu_utilisation(device: torch.device) -> float | None:
    """The share of the last sample period (NVML's, a fraction of a second to a second) in which the GPU ran a
    kernel, in percent; None on a CPU, or where NVML cannot be read (no pynvml)."""
    global _nvml
    if device.type != "cuda" or _nvml is False:
        return None
    try:
        util = float(torch.cuda.utilization(device))
    except (ModuleNotFoundError, RuntimeError):
        _nvml = False  # not on every heartbeat again
        return None
    _nvml = True
    return util


_nvml: bool | None = None


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux), unlike the peak: what shows whether memory is given back."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None
