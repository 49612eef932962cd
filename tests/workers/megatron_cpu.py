"""Test harness, never the example's: a CPU shim for Megatron-core, then examples/megatron_gpt.py run as it is.
Megatron-core's RNG tracker, memory buffer and checkpoint writer call CUDA directly; these six assignments point
them at the CPU and its generator (no Megatron file is changed). ``SCRIPT`` names another script to run under it."""

import os
import runpy
import sys
from pathlib import Path

import megatron.core.tensor_parallel.random as megatron_random
import torch

torch.cuda.current_device = lambda: torch.device("cpu")  # where Megatron's global memory buffer puts its tensors
torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
torch.cuda.manual_seed = torch.manual_seed
torch.cuda.synchronize = lambda device=None: None  # dist_checkpointing waits for copies to host memory
megatron_random._get_cuda_rng_state = lambda device=-1, clone=False, graph_safe=False: torch.get_rng_state()
megatron_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

script = os.environ.get("SCRIPT") or str(Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py")
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
