"""Test harness: Megatron's own forward of a checkpoint of examples/megatron_gpt.py, built at tensor parallel 1
(dist_checkpointing reshards it), on the tokens saved in argv[2]; the logits are saved to argv[3]. Run under
tests/workers/megatron_cpu.py's shim (SCRIPT), in one process.

    megatron_logits.py CHECKPOINT_STEP_DIR TOKENS.pt LOGITS.pt [PRESET]
"""

import runpy
import sys
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

import phalanx
from phalanx.train.models.args import PRESETS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"

checkpoint, tokens_path, out = sys.argv[1:4]
preset = sys.argv[4] if len(sys.argv) > 4 else "llama-tiny"
llama_gpt = runpy.run_path(str(EXAMPLE))["llama_gpt"]  # the example's model, its main not run
phalanx.init()  # one process: a group of its own
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
tokens = torch.load(tokens_path)
model = llama_gpt(PRESETS[preset], tokens.shape[1]).eval()
model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint)["model"])
positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
causal = torch.ones(1, 1, tokens.shape[1], tokens.shape[1]).triu(1).bool()
with torch.no_grad():
    torch.save(model(tokens, positions, causal), out)
