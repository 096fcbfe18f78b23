#!/usr/bin/env bash
# Speed measurements alone on the GPU machine, in one call (issues 11 and 13), each step under
# its own limit so the call ends inside 600 s, nothing else running beside them:
#   1. GPU tests first (TESTS: pytest arguments; default the save / load test of
#      tests/test_decode_gpu.py)
#   2. benchmarks/decode_speed.py: latency and batch parts, combined
#   3. benchmarks/profile_hybrid.py: kernel tables of one layer at B 8 x T 1k (fwd, fwd + bwd)
#   4. benchmarks/attention_speed.py without the tile sweep: ATTN_SHAPES (default
#      8x1024,2x4096,1x16384,1x65536), ATTN_CASES (a regular expression on row names; all)
#   bash benchmarks/speed_gpu.sh          (wheels in .whl/, carried)
# SKIP_DECODE=1 / SKIP_PROFILE=1 / SKIP_ATTN=1 leave a step out; *_TIMEOUT (seconds) bound them.
# Writes $OUT/speed_gpu.log and, under $OUT/speed/, decode_speed.{json,md}, profile_hybrid.json,
# attention_speed.{json,md}, summary.json, kernels_gpu.log: 8 files, a call's limit.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=$OUT/speed; mkdir -p $R  # written as they go: a call cut at its limit still sends them back
exec > >(tee -a "$OUT/speed_gpu.log") 2>&1
source benchmarks/gpu_env.sh || exit 1
start=$(date +%s)
at() { echo "== $1 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
at "1. GPU tests: ${TESTS:-tests/test_decode_gpu.py -k save_load}"
timeout -s INT -k 10 "${TESTS_TIMEOUT:-60}" python3 -m pytest -p no:cacheprovider -m gpu -q -rfE \
  --tb=short ${TESTS:-tests/test_decode_gpu.py -k save_load} 2>&1 | grep -v '^{' | tail -30
if [ "${SKIP_DECODE:-0}" != 1 ]; then
  at "2. decode benchmark"
  # the two parts in /tmp, combined under $R (a call sends back at most 8 files)
  rm -f /tmp/decode_latency.json /tmp/decode_batch.json
  timeout -k 10 "${LATENCY_TIMEOUT:-170}" python3 benchmarks/decode_speed.py --parts latency \
    --out /tmp/decode_latency.json 2>&1 | grep -v Warning | tail -25
  timeout -k 10 "${BATCH_TIMEOUT:-90}" python3 benchmarks/decode_speed.py --parts batch \
    --out /tmp/decode_batch.json 2>&1 | tail -8
  parts=$(ls /tmp/decode_latency.json /tmp/decode_batch.json 2>/dev/null)
  [ -n "$parts" ] && python3 benchmarks/decode_speed.py --combine $parts \
    --out $R/decode_speed.json --md $R/decode_speed.md 2>&1 | tail -40
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  at "3. kernel profile"
  timeout -k 10 "${PROFILE_TIMEOUT:-70}" python3 benchmarks/profile_hybrid.py --shapes 8x1024 \
    --no-denominator --out $R/profile_hybrid.json 2>&1 | tail -70
fi
if [ "${SKIP_ATTN:-0}" != 1 ]; then
  at "4. attention_speed"
  args="--shapes ${ATTN_SHAPES:-8x1024,2x4096,1x16384,1x65536}"
  SKIP_TESTS=1 SKIP_STAGES=1 ATTN_TUNE=0 OUT=$R ATTN_TIMEOUT=${ATTN_TIMEOUT:-190} \
    ATTN_ARGS="$args${ATTN_CASES:+ --cases $ATTN_CASES}" bash benchmarks/kernels_gpu.sh \
    2>&1 | grep -v "^{" | tail -60
fi
at "done"
ls -la $R
