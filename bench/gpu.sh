#!/usr/bin/env bash
# MFU and tokens/s of phalanx's llama3-1b preset (bf16, torch.compile) against torchtitan's Llama 3 1B config
# on one CUDA GPU, the same device, batch and sequence length; about 10 minutes with the compiles.
#
#     bash bench/gpu.sh [--steps 30] [--batch 8] [--seq-len 2048] [--out report.md]
#
# Runs in the benchmark environment (`make bench-env`, which installs torchtitan 0.3.0), building it if it
# is missing. Prints a short table; `bench/run.py` includes it in bench/RESULTS.md on a CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv-bench/bin/python}
[ -x "$PY" ] || make bench-env
exec "$PY" bench/gpu.py "$@"
