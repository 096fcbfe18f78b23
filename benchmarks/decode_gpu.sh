#!/usr/bin/env bash
# Issue 13 on the GPU machine, in one call: generation tests (tests/test_decode_gpu.py), then
# the decode benchmark's latency and batch parts, combined (benchmarks/decode_speed.py).
#   bash benchmarks/decode_gpu.sh        (wheels in .whl/, carried)
# Writes to $OUT: decode_tests.log, decode_latency.json, decode_batch.json, decode_speed.{json,md}.
# Limits (seconds, env): DECODE_TESTS_TIMEOUT 240, LATENCY_TIMEOUT 180, BATCH_TIMEOUT 150.
# Every step tees its output under $OUT, so a step cut at its limit still sends back what it had.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
start=$(date +%s)
echo "== decode tests"
timeout -s INT -k 20 "${DECODE_TESTS_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -m gpu \
  -v -rfEs --tb=short tests/test_decode_gpu.py 2>&1 | tee "$OUT/decode_tests.log"
echo "decode tests exit $? at $(( $(date +%s) - start )) s"
echo "== decode benchmark: latency"
timeout -k 20 "${LATENCY_TIMEOUT:-180}" python3 benchmarks/decode_speed.py --parts latency \
  --out "$OUT/decode_latency.json" 2>&1 | tail -40
echo "latency exit $? at $(( $(date +%s) - start )) s"
echo "== decode benchmark: batch"
timeout -k 20 "${BATCH_TIMEOUT:-150}" python3 benchmarks/decode_speed.py --parts batch \
  --out "$OUT/decode_batch.json" 2>&1 | tail -40
echo "batch exit $? at $(( $(date +%s) - start )) s"
parts=$(ls "$OUT"/decode_latency.json "$OUT"/decode_batch.json 2>/dev/null)
[ -n "$parts" ] && python3 benchmarks/decode_speed.py --combine $parts \
  --out "$OUT/decode_speed.json" --md "$OUT/decode_speed.md" 2>&1 | tail -30
