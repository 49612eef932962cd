"""phalanx's llama3-1b against torchtitan's Llama 3 1B on one CUDA GPU: bf16, torch.compile, the same batch
and sequence length, synthetic-quality data on both sides. Run through bench/gpu.sh.

Both sides train ``--steps`` steps; the medians are over the steps after the first ``--warmup`` (compiles,
allocator growth). tokens/s is each side's own report; MFU is computed for both from tokens/s with phalanx's
FLOPs per token (6N + 12·L·H·Q·T, the convention torchtitan uses too) and the device's peak from
phalanx.obs.metrics, so that the two stand on the same basis; torchtitan's own MFU figure is shown beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _report import Report

from phalanx.obs.metrics import device_name, peak_flops
from phalanx.train.models.llama import PRESETS

REPO = Path(__file__).resolve().parent.parent
TITAN_STEP = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def phalanx_side(work: Path, args: argparse.Namespace) -> list[float]:
    spec = work / "job.yaml"
    spec.write_text(
        "name: gpu\nresources: {procs_per_node: 1, device: cuda}\n"
        f"train: {{model: {{preset: llama3-1b}}, steps: {args.steps}, global_batch: {args.batch}, "
        f"micro_batch: {args.batch}, seq_len: {args.seq_len}, precision: bf16, compile: true}}\n"
        f"checkpoint: {{every_steps: {args.steps * 10}}}\n"
    )
    cmd = [sys.executable, "-m", "phalanx", "run", str(spec), "--runs-dir", str(work / "runs")]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=sys.stderr)
    (run,) = (work / "runs" / "gpu").iterdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in records if r["step"] >= args.warmup]


def torchtitan_side(work: Path, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """torchtitan's trainer on a local dataset and tokenizer written here: (tokens/s, its own MFU) per step."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    data, assets = work / "dataset", work / "tokenizer"
    data.mkdir()
    assets.mkdir()
    texts = [p.read_text(errors="replace") for p in sorted(Path(torch.__file__).parent.rglob("*.py"))[:2000]]
    with (data / "train.json").open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials))
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[1]}))
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'bench'}:{os.environ.get('PYTHONPATH', '')}",
        "BENCH_TOKENIZER": str(assets),
        "BENCH_DATASET": str(data),
        "BENCH_BATCH": str(args.batch),
        "BENCH_SEQ_LEN": str(args.seq_len),
        "BENCH_STEPS": str(args.steps),
        "BENCH_DUMP": str(work / "outputs"),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m"]
    cmd += ["torchtitan.train", "--module", "torchtitan_1b", "--config", "llama3_1b_bench"]
    out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
    out.check_returncode()
    logged = TITAN_STEP.findall(ANSI.sub("", out.stdout + out.stderr))
    steps = [(int(s), float(t.replace(",", "")), float(m)) for s, t, m in logged]
    kept = [(t, m / 100) for s, t, m in steps if s > args.warmup]
    if not kept:
        raise SystemExit("no step lines with tps and mfu found in torchtitan's output")
    return [t for t, _ in kept], [m for _, m in kept]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device")
    device = torch.device("cuda", 0)
    peak = peak_flops(device, "bf16")
    flops = PRESETS["llama3-1b"].flops_per_token(args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "p").mkdir()
        (Path(tmp) / "t").mkdir()
        ours = statistics.median(phalanx_side(Path(tmp) / "p", args))
        titan_tps, titan_mfu = torchtitan_side(Path(tmp) / "t", args)
    theirs = statistics.median(titan_tps)

    def mfu(tps: float) -> str:
        return f"{flops * tps / peak:.1%}" if peak else "n/a (no peak for this device)"

    report = Report(
        "GPU throughput: llama3-1b, one GPU",
        "bash bench/gpu.sh",
        f"torch {torch.__version__} on {device_name(device)}. Llama 3 1B shape (dim 2048, 16 layers, 32 heads, 8 KV "
        f"heads, vocab 128256, tied embeddings), bf16, torch.compile, batch {args.batch} x {args.seq_len} tokens, "
        f"no activation checkpointing, {args.steps} steps each, medians over the steps after {args.warmup}.",
    )
    report.table(
        ["trainer", "tokens/s", "MFU (same basis)", "MFU as the trainer reports it"],
        [
            ["phalanx", f"{ours:,.0f}", mfu(ours), mfu(ours)],
            ["torchtitan 0.3.0", f"{theirs:,.0f}", mfu(theirs), f"{statistics.median(titan_mfu):.1%}"],
        ],
    )
    report.ratio("phalanx / torchtitan, tokens/s", ours / theirs, ">= 0.95x")
    report.finish(args.out)


if __name__ == "__main__":
    main()
