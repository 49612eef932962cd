"""Other frameworks' checkpoints in phalanx's format (`phalanx ckpt import`): a DeepSpeed checkpoint (ZeRO stage 1,
2 or 3) or a Megatron-core ``dist_checkpointing`` one (any tensor-parallel size) of a Llama-shaped model becomes a
checkpoint of the built-in recipe, with its weights, AdamW's moments and hyperparameters and its step. The recipe
then continues training it at any layout (DCP reshards it on load), and `phalanx ckpt export` writes it as Hugging
Face safetensors.

- DeepSpeed: ZeRO partitions the fp32 weights and the moments in flat buffers; DeepSpeed's own converter to its
  universal format (``deepspeed.checkpoint.ds_to_universal``) gathers them per parameter, under the names of
  phalanx's Llama (the model examples/deepspeed_zero.py trains).
- Megatron: dist_checkpointing writes torch DCP files of global tensors, each layer's stacked on a first axis and
  named as Transformer Engine's (a norm is its linear layer's ``layer_norm_weight``); they are read with DCP and
  cut into phalanx's names: the fused QKV projection per query group, SwiGLU's gate and up halves.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from phalanx.checkpoint.directory import MANIFEST, STEP_DIR, CheckpointDir
from phalanx.checkpoint.manager import CheckpointManager
from phalanx.spec.model import Checkpoint
from phalanx.train.models.args import PRESETS, LlamaConfig
from phalanx.train.models.llama import Llama
from phalanx.train.state import RNG, ModelAndOptimizer, Progress

FRAMEWORKS = ("deepspeed", "megatron")
KINDS = ("fp32", "exp_avg", "exp_avg_sq")  # a parameter's weights and AdamW's two moments
CONVERT_TIMEOUT_S = 3600  # DeepSpeed's converter, on a checkpoint of any size

PerName = dict[str, dict[str, torch.Tensor]]  # parameter name -> kind -> tensor


class ConvertError(ValueError):
    """A checkpoint that cannot be imported, and why."""


@dataclasses.dataclass(frozen=True)
class Found:
    """A framework's checkpoint directory, which framework wrote it, and the model its manifest records."""

    path: Path
    framework: str
    model: dict[str, Any] | None


def find(source: Path) -> Found:
    """The checkpoint ``source`` names: a step's directory committed by phalanx (it must verify), a directory of
    them or a run directory (the newest that verifies), or a directory the framework wrote by itself."""
    if (source / MANIFEST).is_file() and (m := STEP_DIR.fullmatch(source.name)):
        parent, step = CheckpointDir(source.parent), int(m[1])
        if (problem := parent.verify(step)) is not None:
            raise ConvertError(f"{source} is not a valid checkpoint: {problem}")
        return _committed(parent, step)
    run = source / "checkpoints"
    if (root := CheckpointDir(run if run.is_dir() else source)).steps():
        if (step := root.latest_valid()) is None:
            raise ConvertError(f"{root}: no checkpoint there verifies (`phalanx ckpt verify` says why)")
        return _committed(root, step)
    if any(source.glob("*model_states.pt")):
        return Found(source, "deepspeed", None)
    if (source / "metadata.json").is_file() and (source / ".metadata").is_file():
        return Found(source, "megatron", None)
    raise ConvertError(f"{source}: no DeepSpeed (*model_states.pt) or Megatron (metadata.json, .metadata) checkpoint")


def _committed(root: CheckpointDir, step: int) -> Found:
    manifest = root.manifest(step)
    if (framework := manifest.get("framework")) not in FRAMEWORKS:
        raise ConvertError(f"{root.path(step)} was written by {framework or 'phalanx'}, not {' or '.join(FRAMEWORKS)}")
    return Found(Path(root.path(step)), framework, manifest.get("model"))


def model_config(found: Found, preset: str | None) -> tuple[dict[str, Any], LlamaConfig]:
    """The model: the one the manifest records, else ``preset``'s."""
    if found.model is not None:
        return found.model, LlamaConfig(**{k: v for k, v in found.model.items() if k != "preset"})
    presets = ", ".join(PRESETS)
    if preset is None:
        raise ConvertError(f"{found.path}: its manifest records no model; say which with --preset ({presets})")
    if preset not in PRESETS:
        raise ConvertError(f"--preset {preset!r} is not a preset; valid presets: {presets}")
    return {"preset": preset, **dataclasses.asdict(PRESETS[preset])}, PRESETS[preset]


def read_deepspeed(path: Path, model: Llama) -> tuple[int, dict[str, Any], PerName]:
    """The checkpoint's step, its optimizer's hyperparameters and each of ``model``'s parameters' kinds."""
    names = dict(model.named_parameters())
    if not any(path.glob("zero_pp_rank_*optim_states.pt")):
        raise ConvertError(f"{path}: no zero_pp_rank_*_optim_states.pt: not a checkpoint of ZeRO stage 1, 2 or 3")
    with tempfile.TemporaryDirectory(prefix="phalanx-import-") as universal:
        _to_universal(path, Path(universal))
        zero = Path(universal) / "zero"
        common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
        per_name = {}
        for name, param in names.items():
            if not (zero / name).is_dir():
                raise ConvertError(f"{path}: no parameter {name} in it; is it a checkpoint of this model?")
            per_name[name] = {kind: _tensor(zero / name / f"{kind}.pt").view(param.shape) for kind in KINDS}
        if (kept := zero / next(iter(names)) / "step.pt").is_file():  # stages 1 and 2 keep it per parameter
            step = int(torch.load(kept, weights_only=False))
        else:
            step = int(common["optimizer_state_dict"]["state"][0]["step"])
        return step, common["param_groups"][0], per_name


def _tensor(path: Path) -> torch.Tensor:
    found = torch.load(path, map_location="cpu", weights_only=False)
    return found["param"] if isinstance(found, dict) else found  # stages 1-2: with its cat_dim; 3: flat


def _to_universal(path: Path, out: Path) -> None:
    """DeepSpeed's converter, in a process of its own (it forks workers, and prints its progress)."""
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path)]
    argv += ["--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    argv += ["--inject_missing_state"]  # a client that recorded no universal info of its own (any plain script)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConvertError(f"DeepSpeed's converter took more than {CONVERT_TIMEOUT_S} s on {path}") from None
    if done.returncode != 0:
        raise ConvertError(f"DeepSpeed's converter failed on {path}:\n{done.stderr[-2000:]}")


MEGATRON_PREFIX = {"fp32": "", "exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq."}


def read_megatron(path: Path, model: Llama, cfg: LlamaConfig) -> tuple[int, dict[str, Any], PerName]:
    """The checkpoint's step, its optimizer's hyperparameters and each of ``model``'s parameters' kinds, from the
    files examples/megatron_gpt.py's integration writes (phalanx.integrations.megatron)."""
    reader = dcp.FileSystemReader(str(path))
    stored = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and "_extra_state" not in key
    }
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(stored, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    common = torch.load(path / "common.pt", map_location="cpu", weights_only=False)
    if "optimizer_step" not in common:
        raise ConvertError(f"{path}: no optimizer_step in common.pt: not written by phalanx.integrations.megatron")
    per_kind = {
        kind: _megatron_names(lambda key, prefix=MEGATRON_PREFIX[kind]: _stored(stored, prefix + key, path), cfg)
        for kind in KINDS
    }
    per_name = {name: {kind: per_kind[kind][name] for kind in KINDS} for name, _ in model.named_parameters()}
    return int(common["optimizer_step"]), common["optimizer"]["param_groups"][0], per_name


def _stored(stored: dict[str, torch.Tensor], key: str, path: Path) -> torch.Tensor:
    if key not in stored:
        raise ConvertError(f"{path}: no {key} in it; is it a checkpoint of a Llama-shaped GPTModel?")
    return stored[key]


def _megatron_names(get: Callable[[str], torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """phalanx's Llama parameters from Megatron's (``get``: a global tensor by its key)."""
    layers, head_dim, groups = cfg.n_layers, cfg.head_dim, cfg.n_kv_heads
    per_group = cfg.n_heads // groups
    ours = {"tok_embeddings.weight": get("embedding.word_embeddings.weight")}
    ours["norm.weight"] = get("decoder.final_layernorm.weight")
    if not cfg.tie_embeddings:
        ours["output.weight"] = get("output_layer.weight")
    # Each query group's rows of the fused projection: its query heads, then its key head, then its value head.
    qkv = get("decoder.layers.self_attention.linear_qkv.weight").view(layers, groups, per_group + 2, head_dim, cfg.dim)
    fc1 = get("decoder.layers.mlp.linear_fc1.weight")  # SwiGLU: the gate's rows, then the up projection's
    block = {
        "attention.wo.weight": get("decoder.layers.self_attention.linear_proj.weight"),
        "attention_norm.weight": get("decoder.layers.self_attention.linear_qkv.layer_norm_weight"),
        "ffn_norm.weight": get("decoder.layers.mlp.linear_fc1.layer_norm_weight"),
        "feed_forward.w2.weight": get("decoder.layers.mlp.linear_fc2.weight"),
    }
    for i in range(layers):
        ours |= {f"layers.{i}.{name}": stacked[i] for name, stacked in block.items()}
        ours[f"layers.{i}.attention.wq.weight"] = qkv[i, :, :per_group].reshape(-1, cfg.dim)
        ours[f"layers.{i}.attention.wk.weight"] = qkv[i, :, per_group].reshape(-1, cfg.dim)
        ours[f"layers.{i}.attention.wv.weight"] = qkv[i, :, per_group + 1].reshape(-1, cfg.dim)
        ours[f"layers.{i}.feed_forward.w1.weight"], ours[f"layers.{i}.feed_forward.w3.weight"] = fc1[i].chunk(2)
    return ours


def import_checkpoint(
    source: Path, out: str, preset: str | None = None, log: Callable[[str], None] = print
) -> tuple[str, int, str]:
    """Write the checkpoint ``source`` names as a checkpoint of the built-in recipe under ``out`` (a checkpoint
    root: a path or a URL); the framework that wrote it, its step and where it went."""
    found = find(source)
    recorded, cfg = model_config(found, preset)
    model = Llama(cfg)
    try:
        if found.framework == "deepspeed":
            step, hyper, per_name = read_deepspeed(found.path, model)
        else:
            step, hyper, per_name = read_megatron(found.path, model, cfg)
    except RuntimeError as e:  # a tensor that does not take the model's shape: another model's checkpoint
        model_name = recorded.get("preset", "given")
        raise ConvertError(f"{found.path} does not fit the {model_name} model ({e}); is it its checkpoint?") from None
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(per_name[name]["fp32"])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"]
    )
    for name, param in model.named_parameters():
        moments = {kind: per_name[name][kind].float().clone() for kind in KINDS[1:]}
        optimizer.state[param] = {"step": torch.tensor(float(step)), **moments}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step, "_step_count": step + 1})
    state = {  # the recipe's (train/trainer.py)
        "train": ModelAndOptimizer(model, optimizer),
        "scheduler": scheduler,
        "rng": RNG(),
        "progress": Progress(step),
    }
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checkpoints = CheckpointManager(
            out, Checkpoint(**{"async": False}), layout={"imported_from": found.framework}, spec_hash="imported",
            model=recorded, log=log,
        )  # fmt: skip
        checkpoints.save(step, state, sync=True)
        checkpoints.close()
    finally:
        dist.destroy_process_group()
    return found.framework, step, checkpoints.dir.location(step)
