#!/usr/bin/env bash
# The GPU check in one call (CI has no GPU): the GPU test matrix, then the layer's speed rows.
#
#   bash scripts/gpu_check.sh            (from the repository root; wheels in .whl/, carried)
#
#   1. tests/test_backends_gpu.py, tests/test_triton_kernels.py, tests/test_decode_gpu.py
#      (the gpu-marked tests, in parallel workers): log, and each case's errors as tables
#      (scripts/gpu_tests_report.py)
#   2. benchmarks.attention_speed at 8 x 1k and 1 x 64k: the teacher, SWA and the hybrid layer
#      (forward + backward, and forward alone), the T 1k / T 64k ratios
#
# Writes under $OUT (default /tmp/out): gpu.txt (machine, versions, commit), gpu_tests.log,
# gpu_tests.md, gpu_tests.jsonl, speed/attention_speed.{json,md,png}, speed/summary.json,
# speed.log. Limits (seconds, env): TESTS_TIMEOUT 420, SPEED_TIMEOUT 150; WORKERS 12.
# SKIP_TESTS=1 / SKIP_SPEED=1 leave a step out. Exit status: the tests'.
set -o pipefail
source scripts/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format=%H 2>/dev/null
  git status --short 2>/dev/null | head -20
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== 1. GPU tests ($SECONDS s)"
  export HEDGECATS_GPU_REPORT=/tmp/gpu_report
  rm -rf "$HEDGECATS_GPU_REPORT"
  timeout -s INT -k 20 "${TESTS_TIMEOUT:-420}" python -m pytest -p no:cacheprovider -m gpu -q \
    -rfEs --tb=short -n "${WORKERS:-12}" tests/test_backends_gpu.py tests/test_triton_kernels.py \
    tests/test_decode_gpu.py > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
  tail -1 "$OUT/gpu_tests.log"
  cat "$HEDGECATS_GPU_REPORT"/*.jsonl > "$OUT/gpu_tests.jsonl" 2>/dev/null
  python scripts/gpu_tests_report.py "$HEDGECATS_GPU_REPORT" > "$OUT/gpu_tests.md"
fi
if [ "${SKIP_SPEED:-0}" != 1 ]; then
  echo "== 2. the layer's speed rows ($SECONDS s)"
  timeout -s INT -k 20 "${SPEED_TIMEOUT:-150}" python -m benchmarks.attention_speed \
    --shapes 8x1024,1x65536 --check-max-tokens 8192 \
    --cases '^(teacher|swa|hybrid fixed)( fwd)?$' --out "$OUT/speed" > "$OUT/speed.log" 2>&1
  grep -E "^B=" "$OUT/speed.log" | cut -c1-110
  python -c "import json, sys; s = json.load(open(sys.argv[1])); \
print({k: v for k, v in s.items() if k.startswith('layer_')})" "$OUT/speed/summary.json"
fi
echo "== done ($SECONDS s)"
exit $rc
