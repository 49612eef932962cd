"""Other frameworks' checkpoints in phalanx's format (`phalanx ckpt import`): a DeepSpeed checkpoint (ZeRO stage 1,
2 or 3) of a Llama-shaped model becomes a checkpoint of the built-in recipe, with its weights, AdamW's moments and
its step. The recipe then continues training it at any layout (DCP reshards it on load), and `phalanx ckpt
export` writes it as Hugging Face safetensors.

ZeRO partitions the fp32 weights and the optimizer's moments in flat buffers; DeepSpeed's own converter to its
universal format (``deepspeed.checkpoint.ds_to_universal``) gathers them per parameter, and they are read from
there by the names of phalanx's Llama (the model examples/deepspeed_zero.py trains)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.directory import MANIFEST, STEP_DIR, CheckpointDir
from phalanx.checkpoint.manager import CheckpointManager
from phalanx.spec.model import Checkpoint
from phalanx.train.models.args import PRESETS, LlamaConfig
from phalanx.train.models.llama import Llama
from phalanx.train.state import RNG, ModelAndOptimizer, Progress

MOMENTS = ("exp_avg", "exp_avg_sq")
CONVERT_TIMEOUT_S = 3600  # DeepSpeed's converter, on a checkpoint of any size


class ConvertError(ValueError):
    """A checkpoint that cannot be imported, and why."""


@dataclasses.dataclass(frozen=True)
class Found:
    """A DeepSpeed checkpoint's directory (DeepSpeed's tag directory) and the model the manifest records."""

    path: Path
    model: dict[str, Any] | None


def find_deepspeed(source: Path) -> Found:
    """The DeepSpeed checkpoint ``source`` names: a step's directory committed by phalanx (it must verify), a
    directory of them or a run directory (the newest that verifies), or a directory DeepSpeed wrote by itself."""
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
    if not any(source.glob("*model_states.pt")):
        raise ConvertError(f"{source}: no DeepSpeed checkpoint there (no *model_states.pt files)")
    return Found(source, None)


def _committed(root: CheckpointDir, step: int) -> Found:
    manifest = root.manifest(step)
    if manifest.get("framework") != "deepspeed":
        raise ConvertError(f"{root.path(step)} was written by {manifest.get('framework', 'phalanx')}, not DeepSpeed")
    return Found(Path(root.path(step)), manifest.get("model"))


def model_config(found: Found, preset: str | None) -> tuple[dict[str, Any], LlamaConfig]:
    """The model: the one the manifest records, else ``preset``'s."""
    if found.model is not None:
        recorded = {k: v for k, v in found.model.items() if k != "preset"}
        return found.model, LlamaConfig(**recorded)
    if preset is None:
        raise ConvertError(
            f"{found.path}: its manifest records no model; say which with --preset ({', '.join(PRESETS)})"
        )
    if preset not in PRESETS:
        raise ConvertError(f"--preset {preset!r} is not a preset; valid presets: {', '.join(PRESETS)}")
    return {"preset": preset, **dataclasses.asdict(PRESETS[preset])}, PRESETS[preset]


def read_deepspeed(path: Path, model: Llama) -> tuple[int, dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """The checkpoint's step, its optimizer's hyperparameters and, by parameter name, ``fp32``, ``exp_avg`` and
    ``exp_avg_sq`` (shaped as ``model``'s parameters)."""
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
            per_name[name] = {
                kind: _tensor(zero / name / f"{kind}.pt").view(param.shape) for kind in ("fp32", *MOMENTS)
            }
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


def import_deepspeed(
    source: Path, out: str, preset: str | None = None, log: Callable[[str], None] = print
) -> tuple[int, str]:
    """Write the DeepSpeed checkpoint ``source`` names as a checkpoint of the built-in recipe under ``out`` (a
    checkpoint root: a path or a URL); its step and where it went."""
    found = find_deepspeed(source)
    recorded, cfg = model_config(found, preset)
    model = Llama(cfg)
    step, hyper, per_name = read_deepspeed(found.path, model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(per_name[name]["fp32"])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"]
    )
    for name, param in model.named_parameters():
        optimizer.state[param] = {"step": torch.tensor(float(step)), **{m: per_name[name][m].float() for m in MOMENTS}}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step, "_step_count": step + 1})
    state = {
        "train": ModelAndOptimizer(model, optimizer),
        "scheduler": scheduler,
        "rng": RNG(),
        "progress": Progress(step),
    }
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checkpoints = CheckpointManager(
            out, Checkpoint(**{"async": False}), layout={"imported_from": "deepspeed"}, spec_hash="imported",
            model=recorded, log=log,
        )  # fmt: skip
        checkpoints.save(step, state, sync=True)
        checkpoints.close()
    finally:
        dist.destroy_process_group()
    return step, checkpoints.dir.location(step)
