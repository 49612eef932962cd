"""Export a built-in-recipe checkpoint's model in Hugging Face Llama layout: ``model.safetensors`` (HF parameter
names) and ``config.json``, which ``transformers.LlamaForCausalLM.from_pretrained`` loads.

The model's architecture comes from the checkpoint's manifest (the recipe records it), its weights from DCP,
read without a process group and assembled whole whatever layout wrote them. Our rotary embedding turns
channel pairs (2i, 2i+1), Meta's convention; HF's turns (i, i + head_dim/2), so the query and key projections'
rows are permuted per head, as HF's own Llama conversion script does.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from phalanx.checkpoint.directory import CheckpointDir

MODEL_PREFIX = "train.model."  # where the recipe's state puts the model in a checkpoint
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    pass


def _reader(checkpoints: CheckpointDir, step: int) -> dcp.StorageReader:
    if checkpoints.local:
        return dcp.FileSystemReader(checkpoints.location(step))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(checkpoints.location(step))


def read_model(checkpoints: CheckpointDir, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The model config the manifest records and the model's full weights (our names) at ``step``."""
    model = checkpoints.manifest(step).get("model")
    if not model:
        raise ExportError(
            f"{checkpoints.location(step)}: the manifest records no model; export needs a checkpoint written by the "
            "built-in train recipe"
        )
    metadata = _reader(checkpoints, step).read_metadata()
    weights = {
        key.removeprefix(MODEL_PREFIX): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"train": {"model": weights}}, storage_reader=_reader(checkpoints, step), no_dist=True)
    return model, weights


def _permute_for_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (2i, 2i+1) to halves (i, i + head_dim/2)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(model: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in weights.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = w
        elif name == "output.weight":
            if not model["tie_embeddings"]:
                out["lm_head.weight"] = w
        else:
            _, layer, rest = name.split(".", 2)
            if rest == "attention.wq.weight":
                w = _permute_for_hf(w, model["n_heads"])
            elif rest == "attention.wk.weight":
                w = _permute_for_hf(w, model["n_kv_heads"])
            out[f"model.layers.{layer}.{BLOCK_NAMES[rest]}"] = w
    return out


def hf_config(model: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model["dim"],
        "intermediate_size": model["ffn_dim"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "head_dim": model["dim"] // model["n_heads"],
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["max_seq_len"],
        "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],  # read by transformers 4 and most other loaders
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},  # transformers 5
        "tie_word_embeddings": model["tie_embeddings"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def export_hf(
    checkpoints: CheckpointDir, step: int | None, out: Path, dtype: str = "float32"
) -> tuple[int, list[Path]]:
    """Write ``out/model.safetensors`` and ``out/config.json`` for the checkpoint of ``step`` (default: the
    latest valid one); returns the step and the files."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if step is None:
        if (step := checkpoints.latest_valid()) is None:
            raise ExportError(f"no valid checkpoint in {checkpoints}")
    elif step not in (steps := checkpoints.steps()):
        raise ExportError(
            f"no checkpoint of step {step} in {checkpoints}; steps there: {', '.join(map(str, steps)) or 'none'}"
        )
    elif (problem := checkpoints.verify(step)) is not None:
        raise ExportError(f"{checkpoints.location(step)} is not a valid checkpoint: {problem}")
    model, weights = read_model(checkpoints, step)
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_state_dict(model, weights).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2) + "\n")
    return step, [out / "model.safetensors", out / "config.json"]
