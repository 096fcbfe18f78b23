#!/usr/bin/env bash
# The gated-SWA pretraining study on the device machine (benchmarks/gated_swa.py; issue 15 item 4).
#   bash benchmarks/gated_swa.sh [gated_swa.py args]      (wheels in .whl/, carried)
# Installs the carried wheels into /tmp/site (torchdata, jsonargparse, ...: see
# ../shared/gpu/fetch-wheels.sh), links src/ as the hedgecats package, runs every variant at once
# on the GPU and writes $OUT/gated_swa.json, gated_swa.md and gated_swa.log.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD/src" /tmp/pkg/hedgecats
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 benchmarks/gated_swa.py --out "$OUT" "$@"
