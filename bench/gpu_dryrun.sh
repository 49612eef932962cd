#!/usr/bin/env bash
# bench/gpu.sh's steps on this machine's CPU with a tiny model, so that they are exercised (tests/test_bench.py,
# in CI) before a GPU sees them: the wheels downloaded as for the GPU machine (here for this interpreter), put
# beside it, phalanx's side trained (bf16, compile, the final checkpoint), torchtitan's data written and its
# configuration parsed (its trainer needs CUDA), the attention kernels probed, the report written.
#
#     bash bench/gpu_dryrun.sh [--out report.md]
#
# WHEELS: a folder where they are already (`make install` downloads them into .venv/gpu-wheels, so that the
# test reaches no registry); without it, they are downloaded into a temporary one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ -z "${WHEELS:-}" ]; then
  WHEELS=$(mktemp -d)
  trap 'rm -rf "$WHEELS"' EXIT
  PY=$PY bash bench/gpu_wheels.sh "$WHEELS" --here
fi
PY=$PY WHEELS=$WHEELS bash bench/gpu.sh --device cpu --preset llama-tiny --steps 4 --warmup 1 --batch 2 \
  --seq-len 64 --texts 50 "$@"
