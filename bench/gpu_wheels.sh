#!/usr/bin/env bash
# Download, as wheels, the packages in bench/gpu-wheels.txt: by default for the lent GPU machine (CPython 3.12,
# x86-64 Linux), into .whl/, which is then carried there (nothing there reaches a package registry);
# with --here, for this machine's interpreter (bench/gpu_dryrun.sh).
#
#     bash bench/gpu_wheels.sh [DIR] [--here]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PY:-python3}
target=(--python-version 3.12 --implementation cp)
for n in 17 27 28 31 34 35; do target+=(--platform "manylinux_2_${n}_x86_64"); done
target+=(--platform manylinux2014_x86_64)
[ "${2:-}" = --here ] && target=()
mkdir -p "$DIR"
rm -f "$DIR"/*.whl  # one version of each: two would stop the install there
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "${target[@]}" -d "$DIR" -r bench/gpu-wheels.txt
echo "$(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
