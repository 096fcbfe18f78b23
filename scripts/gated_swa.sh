#!/usr/bin/env bash
# The gated-SWA pretraining study (experiments/gated_swa.py, docs/gated-swa.md) on one GPU, from
# the repository root: every variant asked for at once, sharing the GPU.
#   bash scripts/gated_swa.sh [experiments.gated_swa args]      (wheels in .whl/, carried)
# Writes $OUT/gated_swa.json, gated_swa.md and gated_swa.log.
set -o pipefail
source scripts/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -m experiments.gated_swa --out "$OUT" "$@"
