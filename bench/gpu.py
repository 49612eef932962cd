"""phalanx's llama3-1b against torchtitan's Llama 3 trainer on the same shape, on one CUDA GPU: tokens/s and
MFU, the same batch, sequence length and settings on both sides. Run through bench/gpu.sh; bench/gpu_dryrun.sh
runs the same steps on the CPU with a tiny model (torchtitan's trainer needs CUDA: there its configuration
is parsed, not run).

The same settings on both sides: bf16 autocast (one GPU: no FSDP on either), torch.compile of each
transformer block (torchtitan's loss is left uncompiled, as phalanx's is), no activation checkpointing (the
torchtitan default is selective: turned off), no CUDA graphs (this torchtitan release has none), AdamW with
each trainer's default implementation (phalanx foreach, torchtitan fused). The attention kernel each side
dispatches is probed and reported.

Both sides train ``--steps`` steps; the medians are over the steps after the first ``--warmup`` (compiles,
allocator growth). tokens/s is each side's own figure, the same measure on both: tokens over the wall time
between consecutive steps, after the step's GPU work has finished. MFU is computed for both from tokens/s
with phalanx's FLOPs per token (6N + 12·L·H·Q·T, N counting the tied output projection once) and the
device's peak from phalanx.obs.metrics; torchtitan's own MFU is shown beside (its N leaves out the embedding
matrix, which with tying is also the output projection, so it reads lower).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _report import Report, spread

from phalanx.obs.metrics import device_name, peak_flops
from phalanx.train.models.args import PRESETS

REPO = Path(__file__).resolve().parent.parent
TITAN_STEP = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan 0.2.2 runs its attention under sdpa_kernel with this priority (torchtitan/models/attention.py).
TITAN_SDPA = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "MATH")


def phalanx_side(work: Path, args: argparse.Namespace) -> list[float]:
    """`phalanx run` of the preset; tokens/s of each step after the warm-up."""
    spec = work / "job.yaml"
    spec.write_text(
        f"name: gpu\nresources: {{procs_per_node: 1, device: {args.device}}}\n"
        f"train: {{model: {{preset: {args.preset}}}, steps: {args.steps}, global_batch: {args.batch}, "
        f"micro_batch: {args.batch}, seq_len: {args.seq_len}, precision: bf16, compile: true, "
        "optimizer: {warmup_steps: 2}}\n"
        f"checkpoint: {{every_steps: {args.steps * 10}}}\n"  # the final save only
        "resilience: {max_restarts: 0, hang_timeout_s: 900}\n"  # 1B with AdamW: a 15 GB final checkpoint
    )
    cmd = [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(work / "runs")]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=sys.stderr)
    (run,) = (work / "runs" / "gpu").iterdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in records if r["step"] >= args.warmup]


def write_text_data(work: Path, texts: int) -> tuple[Path, Path]:
    """A local dataset (JSON lines of torch's own Python sources) and a byte-level BPE tokenizer trained on it:
    torchtitan reads text and tokenizes as it goes, and nothing can be downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    data, assets = work / "dataset", work / "tokenizer"
    data.mkdir()
    assets.mkdir()
    sources = [p.read_text(errors="replace") for p in sorted(Path(torch.__file__).parent.rglob("*.py"))[:texts]]
    with (data / "train.json").open("w") as f:
        for text in sources:
            f.write(json.dumps({"text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(sources, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials))
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[1]}))
    return data, assets


def torchtitan_args(args: argparse.Namespace, data: Path, assets: Path, dump: Path) -> list[str]:
    """torchtitan's command line for the run: the settings in this module's docstring."""
    return [
        f"--job.dump_folder={dump}",
        "--experimental.custom_import=torchtitan_1b",
        "--model.name=llama3_1b_bench",
        "--model.flavor=1B",
        f"--model.hf_assets_path={assets}",
        "--training.dataset=c4_test",
        f"--training.dataset_path={data}",
        f"--training.local_batch_size={args.batch}",
        f"--training.seq_len={args.seq_len}",
        f"--training.steps={args.steps}",
        "--lr_scheduler.warmup_steps=2",
        "--activation_checkpoint.mode=none",
        "--compile.enable",
        "--compile.components=model",
        "--metrics.log_freq=1",
    ]


def torchtitan_side(argv: list[str], work: Path, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """torchtitan's trainer under torchrun: (tokens/s, its own MFU) of each step after the warm-up."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m"]
    out = subprocess.run([*cmd, "torchtitan.train", *argv], cwd=work, capture_output=True, text=True)
    sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
    out.check_returncode()
    logged = TITAN_STEP.findall(ANSI.sub("", out.stdout + out.stderr))
    kept = [(float(t.replace(",", "")), float(m) / 100) for s, t, m in logged if int(s) > args.warmup]
    if not kept:
        raise SystemExit("no step lines with tps and mfu found in torchtitan's output")
    return [t for t, _ in kept], [m for _, m in kept]


def torchtitan_configured(argv: list[str]) -> str:
    """Without CUDA: parse torchtitan's configuration as its trainer would and check the settings took. (A torch
    built for CPU has no triton, which torchtitan imports: then only that is said.)"""
    import importlib

    try:
        from torchtitan.config import ConfigManager
        from torchtitan.protocols.train_spec import get_train_spec
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        return "not parsed: torchtitan imports triton, which this torch build lacks"

    config = ConfigManager().parse_args(argv)
    importlib.import_module(config.experimental.custom_import)
    spec = get_train_spec(config.model.name)
    assert config.activation_checkpoint.mode == "none" and config.compile.enable, config
    assert config.compile.components == ["model"] and spec.model_args[config.model.flavor].dim > 0, config
    return f"parsed, model {config.model.name}/{config.model.flavor}, compile {config.compile.components}"


def attention_kernel(device: torch.device, args: argparse.Namespace, backends: tuple[str, ...] = ()) -> str:
    """The kernel scaled_dot_product_attention dispatches to for one layer at the run's shapes (bf16, causal,
    grouped-query), in eager mode, under ``sdpa_kernel(backends)`` when given."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention
    from torch.profiler import ProfilerActivity, profile

    cfg = PRESETS[args.preset]
    q = torch.randn(args.batch, cfg.n_heads, args.seq_len, cfg.head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(args.batch, cfg.n_kv_heads, args.seq_len, cfg.head_dim, device=device, dtype=torch.bfloat16)
    chosen = sdpa_kernel([getattr(SDPBackend, b) for b in backends], set_priority=True) if backends else None
    with profile(activities=[ProfilerActivity.CPU]) as prof, chosen or contextlib.nullcontext():
        scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::_") and "attention" in e.name]
    return ops[0].removeprefix("aten::") if ops else "not seen"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run")
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--texts", type=int, default=2000, help="source files in torchtitan's text dataset")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device (bench/gpu_dryrun.sh runs its steps on the CPU)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cfg = PRESETS[args.preset]
    peak, flops = peak_flops(device, "bf16"), cfg.flops_per_token(args.seq_len)
    kernels = {"phalanx": attention_kernel(device, args), "torchtitan": attention_kernel(device, args, TITAN_SDPA)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "p").mkdir()
        ours = phalanx_side(work / "p", args)
        data, assets = write_text_data(work, args.texts)
        argv = torchtitan_args(args, data, assets, work / "outputs")
        if device.type == "cuda":
            titan_tps, titan_mfu = torchtitan_side(argv, work, args)
            titan = ["torchtitan 0.2.2", spread(titan_tps, fmt="{:,.0f}"), None, spread(titan_mfu, 100, "{:.1f}%")]
        else:
            titan_tps, parsed = [], torchtitan_configured(argv)
            titan = ["torchtitan 0.2.2", f"n/a: its trainer needs CUDA (configuration: {parsed})", "", ""]

    def mfu(tps: list[float]) -> str:
        return spread([flops * t / peak for t in tps], 100, "{:.1f}%") if peak else "n/a (no peak for this device)"

    if titan_tps:
        titan[2] = mfu(titan_tps)
    report = Report(
        f"GPU throughput: {args.preset}, one GPU",
        "bash bench/gpu.sh",
        f"torch {torch.__version__} on {device_name(device)}. {args.preset}: dim {cfg.dim}, {cfg.n_layers} layers, "
        f"{cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, vocab {cfg.vocab_size}, "
        f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings, {cfg.num_params():,} parameters. "
        f"Batch {args.batch} x {args.seq_len} tokens, {args.steps} steps each; medians over the steps after "
        f"{args.warmup}, with their range. Both sides: bf16 autocast, torch.compile per block, no activation "
        "checkpointing, no CUDA graphs; AdamW foreach (phalanx) and fused (torchtitan's default). Attention "
        f"kernels dispatched at these shapes: phalanx `{kernels['phalanx']}`, torchtitan `{kernels['torchtitan']}` "
        f"(it ranks {', '.join(TITAN_SDPA)}).",
    )
    report.table(
        ["trainer", "tokens/s", "MFU (same basis)", "MFU as the trainer reports it"],
        [["phalanx", spread(ours, fmt="{:,.0f}"), mfu(ours), mfu(ours)], titan],
    )
    if titan_tps:
        ratio = statistics.median(ours) / statistics.median(titan_tps)
        report.ratio("phalanx / torchtitan, tokens/s", ratio, ">= 0.95")
    report.finish(args.out)


if __name__ == "__main__":
    main()
