#!/usr/bin/env bash
# MFU and tokens/s of phalanx's llama3-1b against torchtitan's Llama 3 trainer on the same shape, on one CUDA
# GPU (bench/gpu.py): about 6 minutes, the compiles and phalanx's final 15 GB checkpoint included.
#
#     bash bench/gpu.sh [--steps 30] [--batch 8] [--seq-len 2048] [--out report.md]
#
# Made for the lent GPU machine, which reaches no package registry: it runs under that machine's own python3
# and torch, and installs beside them, for this run only, the wheels in .whl/ (the packages it lacks, which
# `bash bench/gpu_wheels.sh` downloads here; carry .whl with the call). Elsewhere set PY to an interpreter with
# torch, and WHEELS to another folder or to nothing. bench/gpu_dryrun.sh runs these steps on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS-.whl}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE:$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$PY" bench/gpu.py "$@"
